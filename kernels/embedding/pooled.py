"""``pooled_embedding_lookup``: the table-batched pooled lookup with its backward, as the ``tritonrec`` op
``pooled_embedding_lookup`` whose autograd formula calls the backward ops below (all visible to ``torch.compile``).

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

import torch

from tritonrec.kernels.backend import Backend, resolve_backend
from tritonrec.kernels.checks import check_same_device
from tritonrec.kernels.embedding import op_checks
from tritonrec.kernels.embedding.grad_plan import (
    RowGradientPlan,
    build_row_gradient_plan,
    pooled_fingerprints,
    pooled_value_info,
)
from tritonrec.kernels.embedding.layout import (
    BoundsCheckMode,
    TableBatchedLayout,
    feature_value_offsets,
    layout_from_op_key,
)
from tritonrec.kernels.embedding.lookup_grads import (
    backward_weight_grads,
    bounds_checked,
    fake_table_gradients,
    fused_update,
    lookup_state_args,
    table_gradients,
)
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState
from tritonrec.kernels.embedding.pooled_forward import pooled_forward_reference, pooled_forward_triton
from tritonrec.kernels.embedding.row_gradients import per_sample_weight_grad_reference, per_sample_weight_grad_triton
from tritonrec.kernels.library import custom_op

# --------------------------------------------------------------------------------------------------- the ops
# The forward op takes the table views (so autograd routes their gradients), the fused state tensors and the
# trigger (so the backward can hand them to the update op, which mutates them) and the layout as its op key.
# All_rows_valid in the backward: FATAL bounds checks passed in the forward (or it raised); other modes mask.


@custom_op("pooled_embedding_lookup")
def _pooled_lookup_op(
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    table_weights: list[torch.Tensor],
    optimizer_state: list[torch.Tensor],
    trigger: torch.Tensor | None,
    layout: str,
    bounds_check: str,
    sparse_grad: bool,
    fused: int,
    backend: str,
) -> torch.Tensor:
    lay = layout_from_op_key(layout)
    batch_size = (offsets.numel() - 1) // lay.num_features
    starts = op_checks.checked_feature_starts(offsets, bag_divisors, indices.numel(), lay.num_features, batch_size)
    all_valid = bounds_checked(lay, indices, starts, bounds_check)
    if backend == "triton":
        return pooled_forward_triton(weights, lay, indices, offsets, per_sample_weights, bag_divisors, batch_size)
    return pooled_forward_reference(
        weights, lay, indices, offsets, per_sample_weights, bag_divisors, batch_size, all_valid
    )


@_pooled_lookup_op.register_fake
def _(weights, indices, offsets, per_sample_weights, bag_divisors, table_weights, optimizer_state, trigger, layout,
      bounds_check, sparse_grad, fused, backend):  # fmt: skip
    lay = layout_from_op_key(layout)
    return weights.new_empty(((offsets.shape[0] - 1) // lay.num_features, lay.total_dim), dtype=torch.float32)


def _pooled_plan(
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    grad: torch.Tensor,
    all_valid: bool,
) -> RowGradientPlan:
    """The canonical row plan of a pooled backward (``grad [B, total_dim]``)."""
    batch_size = (offsets.numel() - 1) // layout.num_features
    info = pooled_value_info(layout, indices, offsets, psw, bag_divisors, batch_size, layout.total_dim, all_valid)
    return build_row_gradient_plan(layout, indices, info, pooled_fingerprints(info, grad))


@custom_op("pooled_embedding_weight_grad")
def _pooled_weight_grad_op(
    grad: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    layout: str,
    all_rows_valid: bool,
    table_needs: list[bool],
    sparse: bool,
    backend: str,
) -> list[torch.Tensor]:
    """``grad [B, total_dim]`` fp32 -> the gradient of each table with ``table_needs[t]`` (dense or sparse COO), or
    with ``table_needs == []`` one dense flat gradient of ``weights``."""
    lay = layout_from_op_key(layout)
    plan = _pooled_plan(lay, indices, offsets, per_sample_weights, bag_divisors, grad, all_rows_valid)
    return table_gradients(lay, plan, grad.reshape(-1), weights, table_needs, sparse, backend)


@_pooled_weight_grad_op.register_fake
def _(grad, weights, indices, offsets, per_sample_weights, bag_divisors, layout, all_rows_valid, table_needs, sparse,
      backend):  # fmt: skip
    return fake_table_gradients(layout_from_op_key(layout), weights, table_needs, sparse)


@custom_op("pooled_embedding_fused_update", mutates_args=("weights", "optimizer_state"))
def _pooled_fused_update_op(
    weights: torch.Tensor,
    optimizer_state: list[torch.Tensor],
    grad: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    layout: str,
    all_rows_valid: bool,
    fused: int,
    backend: str,
) -> None:
    """The fused optimizer step of a pooled backward: updates the touched rows of ``weights`` and the state in
    place (hyperparameters read from the live state at run time)."""
    lay = layout_from_op_key(layout)
    plan = _pooled_plan(lay, indices, offsets, per_sample_weights, bag_divisors, grad, all_rows_valid)
    fused_update(weights, optimizer_state, lay, plan, grad.reshape(-1), fused, backend)


@_pooled_fused_update_op.register_fake
def _(weights, optimizer_state, grad, indices, offsets, per_sample_weights, bag_divisors, layout, all_rows_valid,
      fused, backend):  # fmt: skip
    return None


@custom_op("pooled_embedding_psw_grad")
def _psw_grad_op(
    grad: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor,
    bag_divisors: torch.Tensor | None,
    layout: str,
    all_rows_valid: bool,
    backend: str,
) -> torch.Tensor:
    """Gradient of the per-sample weights ``[N]`` (read before any fused update of the same backward changes the
    weights: the graph orders this op first because the update mutates what it reads)."""
    lay = layout_from_op_key(layout)
    batch_size = (offsets.numel() - 1) // lay.num_features
    info = pooled_value_info(
        lay, indices, offsets, per_sample_weights, bag_divisors, batch_size, lay.total_dim, all_rows_valid
    )
    grad_flat = grad.reshape(-1)
    if backend == "triton":
        psw_grad = per_sample_weight_grad_triton(weights, lay, indices, info, grad_flat)
    else:
        starts = feature_value_offsets(offsets, lay.num_features, batch_size)
        psw_grad = per_sample_weight_grad_reference(weights, lay, indices, info, grad_flat, starts)
    return psw_grad.to(per_sample_weights.dtype)


@_psw_grad_op.register_fake
def _(grad, weights, indices, offsets, per_sample_weights, bag_divisors, layout, all_rows_valid, backend):
    return torch.empty_like(per_sample_weights)


def _pooled_lookup_setup(ctx, inputs, output) -> None:
    (weights, indices, offsets, psw, bag_divisors, table_weights, optimizer_state, _, layout, bounds_check,
     sparse_grad, fused, backend) = inputs  # fmt: skip
    ctx.save_for_backward(indices, offsets, psw, bag_divisors)
    # attributes, not saved tensors: a fused update changes the weights in place during backward, and a second
    # lookup of the same weights in the graph must not trip autograd's saved-tensor version check
    ctx.weights, ctx.optimizer_state = weights, optimizer_state
    ctx.layout, ctx.all_valid, ctx.sparse, ctx.fused, ctx.backend = (
        layout, bounds_check == BoundsCheckMode.FATAL.value, sparse_grad, fused, backend
    )  # fmt: skip
    ctx.psw_needs = psw is not None and psw.requires_grad
    ctx.weights_needs = weights.requires_grad
    ctx.table_needs = [t.requires_grad for t in table_weights]


def _pooled_lookup_grad(ctx, grad_output):
    indices, offsets, psw, bag_divisors = ctx.saved_tensors
    grad = grad_output.contiguous().float()
    common = (indices, offsets, psw, bag_divisors, ctx.layout, ctx.all_valid)
    psw_grad = None
    if ctx.psw_needs:
        psw_grad = torch.ops.tritonrec.pooled_embedding_psw_grad(grad, ctx.weights, *common, ctx.backend)
    flat_grad, table_grads = backward_weight_grads(
        ctx,
        grad,
        common,
        torch.ops.tritonrec.pooled_embedding_fused_update,
        torch.ops.tritonrec.pooled_embedding_weight_grad,
    )
    return (flat_grad, None, None, psw_grad, None, table_grads, [None] * len(ctx.optimizer_state)) + (None,) * 6


_pooled_lookup_op.register_autograd(_pooled_lookup_grad, setup_context=_pooled_lookup_setup)


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
    batch_size = op_checks.check_pooled_offsets(offsets, layout)
    op_checks.check_per_value(per_sample_weights, "per_sample_weights", indices.numel())
    op_checks.check_bag_divisors(bag_divisors, layout, batch_size)
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
    resolved = resolve_backend(backend, weights, indices)
    # fused: the state tensors and trigger go in, the table views do not (they get no gradient, and the backward
    # mutates the flat buffer they alias)
    tables = [] if table_weights is None or fused is not None else list(table_weights)
    state_tensors, trigger, fused_key = lookup_state_args(fused)
    return _pooled_lookup_op(
        weights,
        indices,
        offsets,
        per_sample_weights,
        bag_divisors,
        tables,
        state_tensors,
        trigger,
        layout.op_key,
        bounds_check.value,
        sparse_grad,
        fused_key,
        resolved,
    )
