"""What the backward of both table-batched lookups (pooled and sequence) shares: the bounds-check mode applied
inside the forward ops, per-table gradients from a row plan (and their fake shapes), the fused update run on the
tensors an op was given, and the fused state's op arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tritonrec.kernels.embedding.fused_update import fused_update_reference, fused_update_triton
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan
from tritonrec.kernels.embedding.layout import BoundsCheckMode, TableBatchedLayout, check_bounds
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState, fused_state_from_op_key
from tritonrec.kernels.embedding.row_gradients import (
    compact_offsets,
    row_gradient_sums_reference,
    row_gradient_sums_triton,
)
from tritonrec.kernels.library import optional_outputs


def bounds_checked(layout: TableBatchedLayout, indices: torch.Tensor, starts: list[int], bounds_check: str) -> bool:
    """Apply the bounds-check mode (a value check, run inside the forward ops); True when every index is known to be
    in range."""
    mode = BoundsCheckMode(bounds_check)
    return mode != BoundsCheckMode.IGNORE and check_bounds(layout, indices, starts, mode)


def weight_gradients(
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    sums: torch.Tensor,
    weights: torch.Tensor,
    per_table: bool,
    sparse: bool,
    needs: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Turn compact row sums into the gradients autograd expects: one per table (dense or sparse COO) when
    ``per_table``, else one dense flat gradient. ``needs[t]`` says whether table ``t``'s gradient is wanted."""
    blocks = compact_offsets(layout, plan)
    flat = None if per_table else torch.zeros_like(weights)
    grads: list[torch.Tensor | None] = []
    for t, spec in enumerate(layout.tables):
        u0, u1 = plan.table_unique_offsets[t], plan.table_unique_offsets[t + 1]
        if per_table and not needs[t]:
            grads.append(None)
            continue
        rows = plan.unique_local_rows[u0:u1]
        block = sums[blocks[t] : blocks[t + 1]].view(u1 - u0, spec.dim).to(weights.dtype)
        if flat is not None:
            layout.table_view(flat, t).index_copy_(0, rows, block)
        elif sparse:
            grads.append(
                torch.sparse_coo_tensor(
                    rows[None], block, (spec.num_rows, spec.dim), is_coalesced=True, check_invariants=False
                )
            )
        else:
            dense = torch.zeros((spec.num_rows, spec.dim), dtype=weights.dtype, device=weights.device)
            grads.append(dense.index_copy_(0, rows, block))
    return [flat] if flat is not None else grads


def table_gradients(
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    grad_flat: torch.Tensor,
    weights: torch.Tensor,
    table_needs: Sequence[bool],
    sparse: bool,
    backend: str,
) -> list[torch.Tensor]:
    """Row sums of ``plan`` turned into the wanted gradients (see :func:`weight_gradients`), ``None`` left out."""
    sums = (row_gradient_sums_triton if backend == "triton" else row_gradient_sums_reference)(layout, plan, grad_flat)
    grads = weight_gradients(layout, plan, sums, weights, bool(table_needs), sparse, table_needs)
    return [g for g in grads if g is not None]


def fake_table_gradients(
    layout: TableBatchedLayout, weights: torch.Tensor, table_needs: Sequence[bool], sparse: bool
) -> list[torch.Tensor]:
    if sparse:
        raise RuntimeError(
            "sparse_grad=True (sparse COO table gradients) is not supported under torch.compile / torch.export; "
            "use dense gradients or a fused optimizer there"
        )
    if not table_needs:
        return [torch.empty_like(weights)]
    return [
        weights.new_empty((spec.num_rows, spec.dim))
        for spec, need in zip(layout.tables, table_needs, strict=True)
        if need
    ]


def fused_update(
    weights: torch.Tensor,
    optimizer_state: list[torch.Tensor],
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    grad_flat: torch.Tensor,
    fused: int,
    backend: str,
) -> None:
    """Run the fused rule of state ``fused`` on the tensors the op was given (under ``torch.compile`` they are the
    graph's, which may be other objects than the state's own)."""
    state = fused_state_from_op_key(fused)
    names = list(state.state_tensors())
    own = [getattr(state, name) for name in names]
    update = fused_update_triton if backend == "triton" else fused_update_reference
    try:
        for name, tensor in zip(names, optimizer_state, strict=True):
            setattr(state, name, tensor)
        with torch.no_grad():
            update(weights, layout, plan, grad_flat, state)
    finally:
        for name, tensor in zip(names, own, strict=True):
            setattr(state, name, tensor)


def lookup_state_args(fused: FusedOptimizerState | None) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
    """``(state tensors, trigger, op key)`` of a fused state (``([], None, -1)`` without one) for a lookup op.

    The trigger, an empty leaf that requires grad, makes the lookup's output require grad (so the backward, which
    holds the update, runs) even when no other input does (FBGEMM's placeholder trick)."""
    if fused is None:
        return [], None, -1
    return list(fused.state_tensors().values()), fused.trigger, fused.op_key


def backward_weight_grads(
    ctx: Any,
    grad: torch.Tensor,
    common: tuple[Any, ...],
    fused_update_op: Callable[..., None],
    weight_grad_op: Callable[..., list[torch.Tensor]],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The weights' part of a lookup op's backward, shared by the pooled and sequence lookups: ``(flat gradient,
    per-table gradients)``. A fused state updates the rows in place (no gradient); otherwise the tables that need one
    get theirs, or the flat buffer gets one. ``common`` are the op's own arguments after ``grad, weights``."""
    flat_grad, table_grads = None, [None] * len(ctx.table_needs)
    if ctx.fused >= 0:
        fused_update_op(ctx.weights, ctx.optimizer_state, grad, *common, ctx.fused, ctx.backend)
    elif any(ctx.table_needs):
        grads = weight_grad_op(grad, ctx.weights, *common, ctx.table_needs, ctx.sparse, ctx.backend)
        table_grads = optional_outputs(grads, ctx.table_needs)
    elif ctx.weights_needs:
        (flat_grad,) = weight_grad_op(grad, ctx.weights, *common, [], False, ctx.backend)
    return flat_grad, table_grads
