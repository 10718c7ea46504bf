"""Backward pieces that do not update weights: per-row gradient sums (for plain torch optimizers) and the gradient of
the per-sample weights.

Row sums follow a :class:`~tritonrec.kernels.embedding.grad_plan.RowGradientPlan`: unique row ``u`` receives the sum
of its sorted run of contributions ``scale * grad[goff : goff + D]``. The result is *compact*: table ``t``'s unique
rows are stored one after another as a ``[U_t, D_t]`` block, blocks in table order (the caller scatters them into a
dense gradient or wraps them as sparse rows). The torch twin sums each run as one ``embedding_bag`` bag over the
gradient rows, read in place wherever they lie on a grid of the flat gradient (no scatter, no per-row copy): that
machinery lives in :mod:`~tritonrec.kernels.embedding.row_sums` and is re-exported here.

Per-sample-weight gradient of value ``j`` in bag ``b``: ``dot(W[idx_j], grad_output[b, cols_f]) / divisor_b`` (zero
for out-of-range rows and for bags whose divisor is 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import autotune, grid_programs
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan, ValueGradientInfo
from tritonrec.kernels.embedding.layout import TableBatchedLayout
from tritonrec.kernels.embedding.pooled_forward import block_d_for
from tritonrec.kernels.embedding.row_sums import (
    RowSpan,
    compact_offsets,
    grad_rows,
    gradient_row_source,
    iter_row_sums,
    pooled_gradient_grid,
    row_spans,
    segment_sums,
)


@triton.jit
def segment_grad(
    grad_ptr,
    goff_ptr,
    scale_ptr,
    start,
    end,
    cols,
    col_ok,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Sum of ``scale[j] * grad[goff[j] + cols]`` over ``j in [start, end)``, ``BLOCK_N`` contributions at a time.

    The order is fixed by the plan and the tile shape, so the sum is reproducible.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        in_run = j < end
        goff = tl.load(goff_ptr + j, mask=in_run, other=0)
        tile = tl.load(grad_ptr + goff[:, None] + cols[None, :], mask=in_run[:, None] & col_ok[None, :], other=0.0)
        if HAS_SCALE:
            tile = tile * tl.load(scale_ptr + j, mask=in_run, other=0.0)[:, None]
        acc += tile
    return tl.sum(acc, axis=0)


def _segment_configs() -> list:
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((4, 4), (1, 2), (8, 4), (16, 8))]


@autotune(configs=_segment_configs(), key=["BLOCK_D", "HAS_SCALE"])
@triton.jit
def _segment_sum_kernel(
    grad_ptr,
    goff_ptr,
    scale_ptr,
    segment_offsets_ptr,
    unique_tables_ptr,
    table_dims_ptr,
    table_unique_offsets_ptr,
    table_compact_offsets_ptr,
    out_ptr,
    num_unique,
    HAS_SCALE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (grid_programs(U), cdiv(max D, BLOCK_D)): programs stride over unique rows, one column block each."""
    for u in range(tl.program_id(0).to(tl.int64), num_unique, tl.num_programs(0)):
        table = tl.load(unique_tables_ptr + u)
        dim = tl.load(table_dims_ptr + table).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        if tl.program_id(1) * BLOCK_D < dim:
            col_ok = cols < dim
            start = tl.load(segment_offsets_ptr + u)
            end = tl.load(segment_offsets_ptr + u + 1)
            g = segment_grad(grad_ptr, goff_ptr, scale_ptr, start, end, cols, col_ok, HAS_SCALE, BLOCK_N, BLOCK_D)
            row = u - tl.load(table_unique_offsets_ptr + table)
            dst = tl.load(table_compact_offsets_ptr + table) + row * dim
            tl.store(out_ptr + dst + cols, g, mask=col_ok)


def row_gradient_sums_triton(
    layout: TableBatchedLayout, plan: RowGradientPlan, grad_flat: torch.Tensor
) -> torch.Tensor:
    device = grad_flat.device
    blocks = compact_offsets(layout, plan)
    out = torch.empty(blocks[-1], dtype=torch.float32, device=device)
    if plan.num_unique == 0:
        return out
    meta = layout.tensors(device)
    block_d = block_d_for(layout.max_dim)
    _segment_sum_kernel[(grid_programs(plan.num_unique), triton.cdiv(layout.max_dim, block_d))](
        grad_flat,
        plan.sorted_grad_offsets,
        grad_flat if plan.sorted_scales is None else plan.sorted_scales,
        plan.segment_offsets,
        plan.unique_tables,
        meta.table_dims,
        torch.tensor(plan.table_unique_offsets[:-1], dtype=torch.int64, device=device),
        torch.tensor(blocks[:-1], dtype=torch.int64, device=device),
        out,
        plan.num_unique,
        HAS_SCALE=plan.sorted_scales is not None,
        BLOCK_D=block_d,
    )
    return out


def row_gradient_sums_reference(
    layout: TableBatchedLayout, plan: RowGradientPlan, grad_flat: torch.Tensor
) -> torch.Tensor:
    """The specification: compact fp32 row sums (see module docstring and
    :func:`~tritonrec.kernels.embedding.row_sums.iter_row_sums`)."""
    blocks = [sums.reshape(-1) for _, _, _, sums in iter_row_sums(layout, plan, grad_flat)]
    if len(blocks) == 1:
        return blocks[0]
    if not blocks:
        return torch.empty(0, dtype=torch.float32, device=grad_flat.device)
    return torch.cat(blocks)


@triton.jit
def _psw_grad_kernel(
    weights_ptr,
    grad_ptr,
    indices_ptr,
    features_ptr,
    goff_ptr,
    divisors_ptr,
    feature_weight_offsets_ptr,
    feature_rows_ptr,
    feature_dims_ptr,
    out_ptr,
    N,
    max_dim,
    HAS_DIVISORS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Programs stride over blocks of BLOCK_N values (``grid_programs``): dot products of the values' table rows
    with their bags' gradient rows."""
    for block in range(tl.program_id(0).to(tl.int64), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        j = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = j < N
        feature = tl.load(features_ptr + j, mask=in_range, other=0)
        idx = tl.load(indices_ptr + j, mask=in_range, other=0).to(tl.int64)
        dim = tl.load(feature_dims_ptr + feature).to(tl.int64)
        row_ok = in_range & (idx >= 0) & (idx < tl.load(feature_rows_ptr + feature))
        row_start = tl.load(feature_weight_offsets_ptr + feature) + idx * dim
        goff = tl.load(goff_ptr + j, mask=in_range, other=0)
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for d0 in range(0, max_dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = row_ok[:, None] & (cols[None, :] < dim[:, None])
            w = tl.load(weights_ptr + row_start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = tl.load(grad_ptr + goff[:, None] + cols[None, :], mask=m, other=0.0)
            acc += w * g
        dot = tl.sum(acc, axis=1)
        if HAS_DIVISORS:
            divisor = tl.load(divisors_ptr + j, mask=in_range, other=1.0)
            dot = tl.where(divisor > 0, tl.div_rn(dot, tl.maximum(divisor, 1e-30)), 0.0)
        tl.store(out_ptr + j, dot, mask=in_range)


def per_sample_weight_grad_triton(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    info: ValueGradientInfo,
    grad_flat: torch.Tensor,
) -> torch.Tensor:
    out = torch.empty(indices.numel(), dtype=torch.float32, device=indices.device)
    if out.numel() == 0:
        return out
    meta = layout.tensors(indices.device)
    indices = indices.contiguous()  # read as a flat array by the kernel
    block_n = 16
    _psw_grad_kernel[(grid_programs(triton.cdiv(indices.numel(), block_n)),)](
        weights,
        grad_flat,
        indices,
        info.features,
        info.grad_offsets,
        grad_flat if info.divisors is None else info.divisors,
        meta.feature_weight_offsets,
        meta.feature_rows,
        meta.feature_dims,
        out,
        indices.numel(),
        layout.max_dim,
        HAS_DIVISORS=info.divisors is not None,
        BLOCK_N=block_n,
        BLOCK_D=block_d_for(layout.max_dim),
    )
    return out


def per_sample_weight_grad_reference(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    info: ValueGradientInfo,
    grad_flat: torch.Tensor,
    feature_value_offsets: Sequence[int],
) -> torch.Tensor:
    """The specification: ``[N]`` fp32 (see module docstring), one gather-and-dot per feature."""
    out = torch.zeros(indices.numel(), dtype=torch.float32, device=indices.device)
    for f, table in enumerate(layout.feature_tables):
        start, end = feature_value_offsets[f], feature_value_offsets[f + 1]
        if start == end:
            continue
        spec = layout.tables[table]
        idx = indices[start:end]
        ok = (idx >= 0) & (idx < spec.num_rows)
        rows = layout.table_view(weights, table)[torch.where(ok, idx, 0)].float() if spec.num_rows else None
        if rows is None:
            continue
        dots = (rows * grad_rows(grad_flat, info.grad_offsets[start:end], spec.dim)).sum(dim=1)
        out[start:end] = torch.where(ok, dots, 0.0)
    if info.divisors is not None:
        out = torch.where(info.divisors > 0, out / info.divisors.clamp(min=1e-30), 0.0)
    return out


__all__ = [
    "RowSpan",
    "compact_offsets",
    "grad_rows",
    "gradient_row_source",
    "iter_row_sums",
    "per_sample_weight_grad_reference",
    "per_sample_weight_grad_triton",
    "pooled_gradient_grid",
    "row_gradient_sums_reference",
    "row_gradient_sums_triton",
    "row_spans",
    "segment_grad",
    "segment_sums",
]
