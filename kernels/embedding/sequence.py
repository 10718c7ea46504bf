"""``sequence_embedding_lookup``: one table row per value, every feature in one launch, with its backward.

Feature ``f`` owns values ``indices[feature_value_offsets[f]:feature_value_offsets[f + 1]]`` (a KJT's
``offset_per_key()``; sample boundaries do not matter here) and gets an ``[N_f, D_f]`` block of the output. Tables
may have different dims (torchrec's EmbeddingCollection needs one dim for all, #294). The output is the flat fp32
concatenation of the blocks in feature order; :func:`split_sequence_output` views it per feature.

Backward: as for pooled lookups (fused update, per-table dense / sparse gradients or a flat dense gradient), with
each value's own output row as its gradient row; rows are combined once per table row in a canonical order. The
lookup and its backward pieces are ``tritonrec`` ops (see :mod:`tritonrec.kernels.library`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, grid_programs, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import check_same_device
from tritonrec.kernels.embedding import op_checks
from tritonrec.kernels.embedding.grad_plan import (
    RowGradientPlan,
    build_row_gradient_plan,
    sequence_fingerprints,
    sequence_value_info,
)
from tritonrec.kernels.embedding.layout import BoundsCheckMode, TableBatchedLayout, layout_from_op_key
from tritonrec.kernels.embedding.lookup_grads import (
    backward_weight_grads,
    bounds_checked,
    fake_table_gradients,
    fused_update,
    lookup_state_args,
    table_gradients,
)
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState
from tritonrec.kernels.embedding.pooled_forward import block_d_for
from tritonrec.kernels.library import custom_op


def _gather_configs() -> list:
    # Ordered so that the first config that fits (the default) is the largest tile for the table width.
    shapes = ((32, 4), (16, 4), (8, 4), (4, 2), (16, 8), (64, 8))
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in shapes]


def _gather_fits(config: dict, args: dict) -> bool:
    """A [BLOCK_N, BLOCK_D] tile keeps a 64-bit source and destination address per value: at 16 values per thread
    ptxas spilled on sm_90 (python -m tritonrec.kernels.aot), at 8 it does not."""
    return config["BLOCK_N"] * args["BLOCK_D"] <= 8 * 32 * config["num_warps"]


@autotune(configs=_gather_configs(), key=["N_BUCKET", "BLOCK_D"], fits=_gather_fits)
@triton.jit
def _sequence_forward_kernel(
    weights_ptr,
    indices_ptr,
    features_ptr,
    out_offsets_ptr,
    out_ptr,
    feature_weight_offsets_ptr,
    feature_rows_ptr,
    feature_dims_ptr,
    N,
    N_BUCKET,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (grid_programs(cdiv(N, BLOCK_N)), cdiv(max D, BLOCK_D)): programs stride over blocks of BLOCK_N values
    and copy their rows (zeros for out-of-range rows)."""
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    for block in range(tl.program_id(0).to(tl.int64), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        j = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = j < N
        feature = tl.load(features_ptr + j, mask=in_range, other=0)
        idx = tl.load(indices_ptr + j, mask=in_range, other=0).to(tl.int64)
        dim = tl.load(feature_dims_ptr + feature).to(tl.int64)
        row_ok = in_range & (idx >= 0) & (idx < tl.load(feature_rows_ptr + feature))
        col_ok = cols[None, :] < dim[:, None]
        row_start = tl.load(feature_weight_offsets_ptr + feature) + idx * dim
        rows = tl.load(weights_ptr + row_start[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok, other=0.0)
        out_start = tl.load(out_offsets_ptr + j, mask=in_range, other=0)
        tl.store(out_ptr + out_start[:, None] + cols[None, :], rows.to(tl.float32), mask=in_range[:, None] & col_ok)


def _output_numel(layout: TableBatchedLayout, feature_value_offsets: Sequence[int]) -> int:
    return sum((feature_value_offsets[f + 1] - feature_value_offsets[f]) * d for f, d in enumerate(layout.feature_dims))


def sequence_forward_triton(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    feature_value_offsets: Sequence[int],
    features: torch.Tensor,
    out_offsets: torch.Tensor,
) -> torch.Tensor:
    out = torch.empty(_output_numel(layout, feature_value_offsets), dtype=torch.float32, device=weights.device)
    if indices.numel() == 0:
        return out
    meta = layout.tensors(weights.device)
    indices = indices.contiguous()  # read as a flat array by the kernel
    block_d = block_d_for(layout.max_dim)
    grid = lambda cfg: (
        grid_programs(triton.cdiv(indices.numel(), cfg["BLOCK_N"])),
        triton.cdiv(layout.max_dim, block_d),
    )
    _sequence_forward_kernel[grid](
        weights,
        indices,
        features,
        out_offsets,
        out,
        meta.feature_weight_offsets,
        meta.feature_rows,
        meta.feature_dims,
        indices.numel(),
        pow2_bucket(indices.numel()),
        BLOCK_D=block_d,
    )
    return out


def sequence_forward_reference(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    feature_value_offsets: Sequence[int],
    all_rows_valid: bool = False,
) -> torch.Tensor:
    """The specification: flat fp32 concatenation of ``F.embedding`` per feature (zero rows for out-of-range)."""
    out = torch.empty(_output_numel(layout, feature_value_offsets), dtype=torch.float32, device=weights.device)
    start = 0
    for f, table in enumerate(layout.feature_tables):
        spec = layout.tables[table]
        idx = indices[feature_value_offsets[f] : feature_value_offsets[f + 1]]
        block = out[start : start + idx.numel() * spec.dim].view(idx.numel(), spec.dim)
        start += idx.numel() * spec.dim
        if idx.numel() == 0:
            continue
        ok = None if all_rows_valid else (idx >= 0) & (idx < spec.num_rows)
        if ok is None or bool(ok.all()):
            block.copy_(F.embedding(idx, layout.table_view(weights, table)))
        elif spec.num_rows == 0:
            block.zero_()
        else:
            rows = F.embedding(torch.where(ok, idx, 0), layout.table_view(weights, table))
            block.copy_(torch.where(ok[:, None], rows, 0.0))
    return out


# --------------------------------------------------------------------------------------------------- the ops
# As for the pooled op (see pooled.py): table views, fused state tensors and trigger go in; the layout as its key.
# ``feature_value_offsets`` are ints in the schema (SymInts under torch.compile, where they may be unbacked).


@custom_op("sequence_embedding_lookup")
def _sequence_lookup_op(
    weights: torch.Tensor,
    indices: torch.Tensor,
    feature_value_offsets: list[int],
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
    starts = _check_feature_value_offsets(feature_value_offsets, lay, indices.numel(), values=True)
    all_valid = bounds_checked(lay, indices, starts, bounds_check)
    if backend == "triton":
        info = sequence_value_info(lay, indices, starts, all_valid)
        return sequence_forward_triton(weights, lay, indices, starts, info.features, info.grad_offsets)
    return sequence_forward_reference(weights, lay, indices, starts, all_valid)


@_sequence_lookup_op.register_fake
def _(weights, indices, feature_value_offsets, table_weights, optimizer_state, trigger, layout, bounds_check,
      sparse_grad, fused, backend):  # fmt: skip
    lay = layout_from_op_key(layout)
    return weights.new_empty(_output_numel(lay, feature_value_offsets), dtype=torch.float32)


def _sequence_plan(
    layout: TableBatchedLayout, indices: torch.Tensor, starts: list[int], grad_flat: torch.Tensor, all_valid: bool
) -> RowGradientPlan:
    """The canonical row plan of a sequence backward (``grad_flat``: the flat output's gradient)."""
    info = sequence_value_info(layout, indices, starts, all_valid)
    return build_row_gradient_plan(layout, indices, info, sequence_fingerprints(info, layout, grad_flat))


@custom_op("sequence_embedding_weight_grad")
def _sequence_weight_grad_op(
    grad: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    feature_value_offsets: list[int],
    layout: str,
    all_rows_valid: bool,
    table_needs: list[bool],
    sparse: bool,
    backend: str,
) -> list[torch.Tensor]:
    """As ``pooled_embedding_weight_grad``, for the flat sequence output's gradient."""
    lay = layout_from_op_key(layout)
    plan = _sequence_plan(lay, indices, feature_value_offsets, grad, all_rows_valid)
    return table_gradients(lay, plan, grad, weights, table_needs, sparse, backend)


@_sequence_weight_grad_op.register_fake
def _(grad, weights, indices, feature_value_offsets, layout, all_rows_valid, table_needs, sparse, backend):
    return fake_table_gradients(layout_from_op_key(layout), weights, table_needs, sparse)


@custom_op("sequence_embedding_fused_update", mutates_args=("weights", "optimizer_state"))
def _sequence_fused_update_op(
    weights: torch.Tensor,
    optimizer_state: list[torch.Tensor],
    grad: torch.Tensor,
    indices: torch.Tensor,
    feature_value_offsets: list[int],
    layout: str,
    all_rows_valid: bool,
    fused: int,
    backend: str,
) -> None:
    lay = layout_from_op_key(layout)
    plan = _sequence_plan(lay, indices, feature_value_offsets, grad, all_rows_valid)
    fused_update(weights, optimizer_state, lay, plan, grad, fused, backend)


@_sequence_fused_update_op.register_fake
def _(weights, optimizer_state, grad, indices, feature_value_offsets, layout, all_rows_valid, fused, backend):
    return None


def _sequence_lookup_setup(ctx, inputs, output) -> None:
    (weights, indices, feature_value_offsets, table_weights, optimizer_state, _, layout, bounds_check, sparse_grad,
     fused, backend) = inputs  # fmt: skip
    ctx.save_for_backward(indices)
    ctx.weights, ctx.optimizer_state = weights, optimizer_state  # attributes: see pooled.py
    ctx.feature_value_offsets, ctx.layout, ctx.sparse, ctx.fused, ctx.backend = (
        feature_value_offsets, layout, sparse_grad, fused, backend
    )  # fmt: skip
    ctx.all_valid = bounds_check == BoundsCheckMode.FATAL.value
    ctx.weights_needs = weights.requires_grad
    ctx.table_needs = [t.requires_grad for t in table_weights]


def _sequence_lookup_grad(ctx, grad_output):
    (indices,) = ctx.saved_tensors
    grad = grad_output.contiguous().float()
    common = (indices, ctx.feature_value_offsets, ctx.layout, ctx.all_valid)
    flat_grad, table_grads = backward_weight_grads(
        ctx,
        grad,
        common,
        torch.ops.tritonrec.sequence_embedding_fused_update,
        torch.ops.tritonrec.sequence_embedding_weight_grad,
    )
    return (flat_grad, None, None, table_grads, [None] * len(ctx.optimizer_state)) + (None,) * 6


_sequence_lookup_op.register_autograd(_sequence_lookup_grad, setup_context=_sequence_lookup_setup)


def _check_feature_value_offsets(
    feature_value_offsets: object, layout: TableBatchedLayout, num_values: int, values: bool = False
) -> list[int]:
    """Type and length always; with ``values`` (inside the op, where they are real ints) that they rise from 0 to
    the number of indices."""
    if isinstance(feature_value_offsets, torch.Tensor):
        feature_value_offsets = feature_value_offsets.tolist()
    if not isinstance(feature_value_offsets, (list, tuple)) or not all(
        isinstance(v, (int, torch.SymInt)) for v in feature_value_offsets
    ):
        raise TypeError(f"feature_value_offsets must be a list of ints, got {feature_value_offsets!r}")
    offsets = list(feature_value_offsets)
    if len(offsets) != layout.num_features + 1:
        raise ValueError(
            f"feature_value_offsets must have F + 1 = {layout.num_features + 1} entries, got {len(offsets)}"
        )
    if values and (offsets[0] != 0 or offsets[-1] != num_values or any(b < a for a, b in itertools.pairwise(offsets))):
        raise ValueError(
            f"feature_value_offsets must rise from 0 to the number of indices ({num_values}), got {offsets}"
        )
    return offsets


def sequence_embedding_lookup(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    feature_value_offsets: Sequence[int],
    *,
    table_weights: Sequence[torch.Tensor] | None = None,
    sparse_grad: bool = False,
    fused: FusedOptimizerState | None = None,
    bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Row gather for every value: flat fp32 ``[sum_f N_f * D_f]`` (see :func:`split_sequence_output`).

    Arguments as in :func:`~tritonrec.kernels.embedding.pooled.pooled_embedding_lookup`, with
    ``feature_value_offsets [F + 1]`` (host ints) in place of bag offsets.
    """
    layout = op_checks.check_layout(layout)
    op_checks.check_weights(weights, layout)
    op_checks.check_indices(indices)
    check_same_device(weights=weights, indices=indices)
    starts = _check_feature_value_offsets(feature_value_offsets, layout, indices.numel())
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
    tables = [] if table_weights is None or fused is not None else list(table_weights)  # as in pooled.py
    state_tensors, trigger, fused_key = lookup_state_args(fused)
    return _sequence_lookup_op(
        weights,
        indices,
        starts,
        tables,
        state_tensors,
        trigger,
        layout.op_key,
        bounds_check.value,
        sparse_grad,
        fused_key,
        resolved,
    )


def split_sequence_output(
    flat: torch.Tensor, layout: TableBatchedLayout, feature_value_offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Per-feature ``[N_f, D_f]`` views of a :func:`sequence_embedding_lookup` output."""
    sizes = [(feature_value_offsets[f + 1] - feature_value_offsets[f]) * d for f, d in enumerate(layout.feature_dims)]
    return [part.view(-1, d) for part, d in zip(torch.split(flat, sizes), layout.feature_dims, strict=True)]
