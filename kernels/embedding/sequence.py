"""``sequence_embedding_lookup``: one table row per value, every feature in one launch, with its backward.

Feature ``f`` owns values ``indices[feature_value_offsets[f]:feature_value_offsets[f + 1]]`` (a KJT's
``offset_per_key()``; sample boundaries do not matter here) and gets an ``[N_f, D_f]`` block of the output. Tables
may have different dims (torchrec's EmbeddingCollection needs one dim for all, #294). The output is the flat fp32
concatenation of the blocks in feature order; :func:`split_sequence_output` views it per feature.

Backward: as for pooled lookups (fused update, per-table dense / sparse gradients or a flat dense gradient), with
each value's own output row as its gradient row; rows are combined once per table row in a canonical order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, grid_programs, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import check_same_device
from tritonrec.kernels.embedding import op_checks
from tritonrec.kernels.embedding.fused_update import fused_update_reference, fused_update_triton
from tritonrec.kernels.embedding.grad_plan import build_row_gradient_plan, sequence_fingerprints, sequence_value_info
from tritonrec.kernels.embedding.layout import BoundsCheckMode, TableBatchedLayout, check_bounds
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState
from tritonrec.kernels.embedding.pooled import fused_trigger, weight_gradients
from tritonrec.kernels.embedding.pooled_forward import block_d_for
from tritonrec.kernels.embedding.row_gradients import row_gradient_sums_reference, row_gradient_sums_triton


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


def _output_size(layout: TableBatchedLayout, feature_value_offsets: Sequence[int]) -> int:
    return sum((feature_value_offsets[f + 1] - feature_value_offsets[f]) * d for f, d in enumerate(layout.feature_dims))


def sequence_forward_triton(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    feature_value_offsets: Sequence[int],
    features: torch.Tensor,
    out_offsets: torch.Tensor,
) -> torch.Tensor:
    out = torch.empty(_output_size(layout, feature_value_offsets), dtype=torch.float32, device=weights.device)
    if indices.numel() == 0:
        return out
    meta = layout.tensors(weights.device)
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
    out = torch.empty(_output_size(layout, feature_value_offsets), dtype=torch.float32, device=weights.device)
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


@dataclass
class _SequenceArgs:
    layout: TableBatchedLayout
    indices: torch.Tensor
    feature_value_offsets: list[int]
    all_rows_valid: bool
    use_triton: bool
    sparse_grad: bool
    fused: FusedOptimizerState | None
    has_table_weights: bool


class _SequenceLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, args, weights, fused_trigger, *table_weights):  # type: ignore[override]
        info = sequence_value_info(args.layout, args.indices, args.feature_value_offsets, args.all_rows_valid)
        if args.use_triton:
            out = sequence_forward_triton(
                weights, args.layout, args.indices, args.feature_value_offsets, info.features, info.grad_offsets
            )
        else:
            out = sequence_forward_reference(
                weights, args.layout, args.indices, args.feature_value_offsets, args.all_rows_valid
            )
        ctx.args, ctx.weights, ctx.info = args, weights, info
        return out

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        args: _SequenceArgs = ctx.args
        weights, info, layout = ctx.weights, ctx.info, args.layout
        table_needs = list(ctx.needs_input_grad[3:]) if args.has_table_weights else [False] * layout.num_tables
        weight_grads: list[torch.Tensor | None] = [None] * (layout.num_tables if args.has_table_weights else 0)
        flat_grad = None
        if args.fused is None and not ctx.needs_input_grad[1] and not any(table_needs):
            return None, None, None, *weight_grads
        grad_flat = grad_output.contiguous().float()
        fingerprints = sequence_fingerprints(info, layout, grad_flat)
        plan = build_row_gradient_plan(layout, args.indices, info, fingerprints)
        if args.fused is not None:
            update = fused_update_triton if args.use_triton else fused_update_reference
            with torch.no_grad():
                update(weights, layout, plan, grad_flat, args.fused)
            return None, None, None, *weight_grads
        sums = (row_gradient_sums_triton if args.use_triton else row_gradient_sums_reference)(layout, plan, grad_flat)
        grads = weight_gradients(layout, plan, sums, weights, args.has_table_weights, args.sparse_grad, table_needs)
        if args.has_table_weights:
            weight_grads = grads
        else:
            flat_grad = grads[0]
        return None, flat_grad, None, *weight_grads


def _check_feature_value_offsets(
    feature_value_offsets: object, layout: TableBatchedLayout, num_values: int
) -> list[int]:
    if isinstance(feature_value_offsets, torch.Tensor):
        feature_value_offsets = feature_value_offsets.tolist()
    if not isinstance(feature_value_offsets, (list, tuple)) or not all(
        isinstance(v, int) for v in feature_value_offsets
    ):
        raise TypeError(f"feature_value_offsets must be a list of ints, got {feature_value_offsets!r}")
    values = list(feature_value_offsets)
    if len(values) != layout.num_features + 1:
        raise ValueError(
            f"feature_value_offsets must have F + 1 = {layout.num_features + 1} entries, got {len(values)}"
        )
    if values[0] != 0 or values[-1] != num_values or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(
            f"feature_value_offsets must rise from 0 to the number of indices ({num_values}), got {values}"
        )
    return values


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
    all_valid = check_bounds(layout, indices, starts, bounds_check)
    use_triton = resolve_backend(backend, weights, indices) == "triton"
    args = _SequenceArgs(layout, indices, starts, all_valid, use_triton, sparse_grad, fused, table_weights is not None)
    return _SequenceLookup.apply(args, weights, fused_trigger(fused), *(table_weights or ()))


def split_sequence_output(
    flat: torch.Tensor, layout: TableBatchedLayout, feature_value_offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Per-feature ``[N_f, D_f]`` views of a :func:`sequence_embedding_lookup` output."""
    sizes = [(feature_value_offsets[f + 1] - feature_value_offsets[f]) * d for f, d in enumerate(layout.feature_dims)]
    return [part.view(-1, d) for part, d in zip(torch.split(flat, sizes), layout.feature_dims, strict=True)]
