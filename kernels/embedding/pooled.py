"""``pooled_embedding_lookup``: the table-batched pooled lookup with its backward, as one autograd op.

Forward: :mod:`~tritonrec.kernels.embedding.pooled_forward`. Backward, by what the caller asked for:

* ``fused=state``: the optimizer runs inside the backward and updates ``weights`` (and ``state``) in place; no weight
  gradient is returned or materialised.
* ``table_weights=[...]`` (views of each table inside ``weights``, e.g. a module's parameters): each gets its own
  gradient, dense ``[rows, dim]`` or, with ``sparse_grad=True``, a coalesced sparse COO tensor of the touched rows.
* otherwise, when ``weights`` itself requires grad: a dense flat gradient.

In every case duplicate rows are combined once per row in a canonical order
(:mod:`~tritonrec.kernels.embedding.grad_plan`), so results do not depend on how the batch was ordered. The
gradient of ``per_sample_weights`` is returned when it requires grad (computed before any fused update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tritonrec.kernels.backend import Backend, resolve_backend
from tritonrec.kernels.checks import check_same_device
from tritonrec.kernels.embedding import op_checks
from tritonrec.kernels.embedding.fused_update import fused_update_reference, fused_update_triton
from tritonrec.kernels.embedding.grad_plan import (
    RowGradientPlan,
    build_row_gradient_plan,
    pooled_fingerprints,
    pooled_value_info,
)
from tritonrec.kernels.embedding.layout import (
    BoundsCheckMode,
    TableBatchedLayout,
    check_bounds,
    feature_value_offsets,
)
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState
from tritonrec.kernels.embedding.pooled_forward import pooled_forward_reference, pooled_forward_triton
from tritonrec.kernels.embedding.row_gradients import (
    compact_offsets,
    per_sample_weight_grad_reference,
    per_sample_weight_grad_triton,
    row_gradient_sums_reference,
    row_gradient_sums_triton,
)


@dataclass
class _LookupArgs:
    """Non-differentiable inputs and options, carried from forward to backward."""

    layout: TableBatchedLayout
    indices: torch.Tensor
    offsets: torch.Tensor
    bag_divisors: torch.Tensor | None
    batch_size: int
    all_rows_valid: bool
    use_triton: bool
    sparse_grad: bool
    fused: FusedOptimizerState | None
    has_table_weights: bool


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


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, args, weights, per_sample_weights, fused_trigger, *table_weights):  # type: ignore[override]
        run = pooled_forward_triton if args.use_triton else pooled_forward_reference
        extra = () if args.use_triton else (args.all_rows_valid,)
        out = run(
            weights,
            args.layout,
            args.indices,
            args.offsets,
            per_sample_weights,
            args.bag_divisors,
            args.batch_size,
            *extra,
        )
        ctx.args = args
        # an attribute, not a saved tensor: a fused update changes the weights in place during backward, and a
        # second lookup of the same weights in the graph must not trip autograd's saved-tensor version check
        ctx.weights = weights
        ctx.save_for_backward(per_sample_weights)
        return out

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        args: _LookupArgs = ctx.args
        weights = ctx.weights
        (per_sample_weights,) = ctx.saved_tensors
        layout, indices = args.layout, args.indices
        num_tables = layout.num_tables
        grad = grad_output.contiguous().float()
        info = pooled_value_info(
            layout,
            indices,
            args.offsets,
            per_sample_weights,
            args.bag_divisors,
            args.batch_size,
            layout.total_dim,
            args.all_rows_valid,
        )
        grad_flat = grad.reshape(-1)
        psw_grad = None
        if ctx.needs_input_grad[2]:
            if args.use_triton:
                psw_grad = per_sample_weight_grad_triton(weights, layout, indices, info, grad_flat)
            else:
                starts = feature_value_offsets(args.offsets, layout.num_features, args.batch_size)
                psw_grad = per_sample_weight_grad_reference(weights, layout, indices, info, grad_flat, starts)
            psw_grad = psw_grad.to(per_sample_weights.dtype)
        table_needs = list(ctx.needs_input_grad[4:]) if args.has_table_weights else [False] * num_tables
        wants_rows = args.fused is not None or ctx.needs_input_grad[1] or any(table_needs)
        weight_grads: list[torch.Tensor | None] = [None] * (num_tables if args.has_table_weights else 0)
        flat_grad = None
        if wants_rows:
            plan = build_row_gradient_plan(layout, indices, info, pooled_fingerprints(info, grad))
            if args.fused is not None:
                update = fused_update_triton if args.use_triton else fused_update_reference
                with torch.no_grad():
                    update(weights, layout, plan, grad_flat, args.fused)
            else:
                sums = (row_gradient_sums_triton if args.use_triton else row_gradient_sums_reference)(
                    layout, plan, grad_flat
                )
                grads = weight_gradients(
                    layout, plan, sums, weights, args.has_table_weights, args.sparse_grad, table_needs
                )
                if args.has_table_weights:
                    weight_grads = grads
                else:
                    flat_grad = grads[0]
        return None, flat_grad, psw_grad, None, *weight_grads


def fused_trigger(fused: FusedOptimizerState | None) -> torch.Tensor | None:
    """An empty leaf that requires grad, passed as an input in fused mode so the output requires grad (and the
    backward, which holds the update, runs) even when no other input does (FBGEMM's placeholder trick)."""
    return torch.empty(0, requires_grad=True) if fused is not None and torch.is_grad_enabled() else None


def pooled_embedding_lookup(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    bag_divisors: torch.Tensor | None = None,
    *,
    table_weights: Sequence[torch.Tensor] | None = None,
    sparse_grad: bool = False,
    fused: FusedOptimizerState | None = None,
    bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Pooled lookup of all features in one launch: ``[B, layout.total_dim]`` fp32.

    Args:
        weights: flat ``[layout.num_weights]`` fp32 / fp16 / bf16 buffer holding every table.
        layout: the tables and the feature -> table map.
        indices: ``[N]`` int32/int64, key-major (a KJT's values); indices are local to their table.
        offsets: ``[F * B + 1]`` int32/int64 bag offsets (a KJT's offsets).
        per_sample_weights: optional ``[N]`` weights (differentiable).
        bag_divisors: optional ``[F * B]`` divisors for MEAN tables instead of the local bag lengths.
        table_weights: optional per-table views of ``weights`` that receive the gradients (module parameters).
        sparse_grad: with ``table_weights``, return sparse COO row gradients instead of dense ones.
        fused: optimizer state; the backward then updates ``weights`` in place (no gradient is returned).
        bounds_check: what an index outside its table does (see :class:`BoundsCheckMode`).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.
    """
    layout = op_checks.check_layout(layout)
    op_checks.check_weights(weights, layout)
    op_checks.check_indices(indices)
    batch_size = op_checks.check_pooled_offsets(offsets, layout, indices.numel())
    op_checks.check_per_value(per_sample_weights, "per_sample_weights", indices.numel())
    op_checks.check_bag_divisors(bag_divisors, offsets, layout, batch_size)
    check_same_device(
        weights=weights,
        indices=indices,
        offsets=offsets,
        per_sample_weights=per_sample_weights,
        bag_divisors=bag_divisors,
    )
    op_checks.check_table_weights(table_weights, weights, layout)
    op_checks.check_fused(fused, layout, weights)
    op_checks.check_bounds_mode(bounds_check)
    if sparse_grad and table_weights is None:
        raise ValueError("sparse_grad=True needs table_weights (sparse gradients are per table), got None")
    if fused is not None and (sparse_grad or weights.requires_grad):
        raise ValueError(
            "fused updates weights in place and returns no gradient: pass sparse_grad=False and weights that do not "
            f"require grad, got sparse_grad={sparse_grad}, weights.requires_grad={weights.requires_grad}"
        )
    all_valid = bounds_check != BoundsCheckMode.IGNORE and check_bounds(
        layout, indices, feature_value_offsets(offsets, layout.num_features, batch_size), bounds_check
    )
    use_triton = resolve_backend(backend, weights, indices) == "triton"
    args = _LookupArgs(
        layout,
        indices,
        offsets,
        bag_divisors,
        batch_size,
        all_valid,
        use_triton,
        sparse_grad,
        fused,
        table_weights is not None,
    )
    return _PooledLookup.apply(args, weights, per_sample_weights, fused_trigger(fused), *(table_weights or ()))
