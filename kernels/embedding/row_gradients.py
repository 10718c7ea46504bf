"""Backward pieces that do not update weights: per-row gradient sums (for plain torch optimizers) and the gradient of
the per-sample weights.

Row sums follow a :class:`~tritonrec.kernels.embedding.grad_plan.RowGradientPlan`: unique row ``u`` receives the sum
of its sorted run of contributions ``scale * grad[goff : goff + D]``. The result is *compact*: table ``t``'s unique
rows are stored one after another as a ``[U_t, D_t]`` block, blocks in table order (the caller scatters them into a
dense gradient or wraps them as sparse rows). The torch twin sums each run as one ``embedding_bag`` bag over the
gradient rows, read in place wherever they lie on a grid of the flat gradient (no scatter, no per-row copy).

Per-sample-weight gradient of value ``j`` in bag ``b``: ``dot(W[idx_j], grad_output[b, cols_f]) / divisor_b`` (zero
for out-of-range rows and for bags whose divisor is 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import autotune, grid_programs
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan, ValueGradientInfo
from tritonrec.kernels.embedding.layout import TableBatchedLayout
from tritonrec.kernels.embedding.pooled_forward import block_d_for


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


def compact_offsets(layout: TableBatchedLayout, plan: RowGradientPlan) -> list[int]:
    """``[T + 1]`` element offsets of each table's ``[U_t, D_t]`` block in the compact row-gradient buffer."""
    out = [0]
    for t, spec in enumerate(layout.tables):
        out.append(out[-1] + (plan.table_unique_offsets[t + 1] - plan.table_unique_offsets[t]) * spec.dim)
    return out


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


def grad_rows(
    grad_flat: torch.Tensor, grad_offsets: torch.Tensor, dim: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[n, dim]`` gradient rows starting at ``grad_offsets`` of the flat buffer, gathered through a sliding-window
    view (row ``k`` of the view is ``grad_flat[k : k + dim]``), so no ``[n, dim]`` index tensor is built."""
    if grad_offsets.numel() == 0:
        return grad_flat.new_zeros(0, dim) if out is None else out
    window = grad_flat.as_strided((grad_flat.numel() - dim + 1, dim), (1, 1))
    return (
        torch.index_select(window, 0, grad_offsets, out=out)
        if out is not None
        else window.index_select(0, grad_offsets)
    )


@dataclass(frozen=True)
class RowSpan:
    """Unique rows ``[u0, u1)`` of equal ``dim`` (their contributions ``[c0, c1)``, their compact block at
    ``start``) that the twins process with one set of torch ops; ``table`` is None when it spans every table."""

    table: int | None
    dim: int
    u0: int
    u1: int
    c0: int
    c1: int
    start: int


def row_spans(layout: TableBatchedLayout, plan: RowGradientPlan) -> list[RowSpan]:
    """One span for all tables when they share one dim (rows are then addressed by global number in the flat
    buffer viewed as ``[num_rows, D]``), else one span per table with touched rows."""
    blocks = compact_offsets(layout, plan)
    if len({spec.dim for spec in layout.tables}) == 1:
        if plan.num_unique == 0:
            return []
        return [RowSpan(None, layout.tables[0].dim, 0, plan.num_unique, 0, plan.table_contribution_offsets[-1], 0)]
    spans = []
    for t, spec in enumerate(layout.tables):
        u0, u1 = plan.table_unique_offsets[t], plan.table_unique_offsets[t + 1]
        c0, c1 = plan.table_contribution_offsets[t], plan.table_contribution_offsets[t + 1]
        if u1 > u0:
            spans.append(RowSpan(t, spec.dim, u0, u1, c0, c1, blocks[t]))
    return spans


def gradient_row_source(
    grad_flat: torch.Tensor,
    grad_offsets: torch.Tensor,
    dim: int,
    row_stride: int | None = None,
    grid: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(matrix [R, dim], ids [M])`` with ``matrix[ids[j]] == grad_flat[grad_offsets[j] : ... + dim]``.

    ``matrix`` is a view of ``grad_flat`` with row stride ``dim`` (or ``row_stride``, e.g. a pooled gradient's
    ``sum(D)``) when every offset sits on that grid, so the rows are read in place; otherwise the rows are gathered
    into a ``[M, dim]`` copy and ``ids`` is ``arange(M)``. A caller that knows the grid (``(stride, first offset
    modulo stride)``) passes it and the offsets are not checked. Overlapping rows (a stride below ``dim``) are never
    used: ``embedding_bag`` would copy the whole buffer to make them contiguous."""
    if grid is None and grad_offsets.numel():
        for stride in (dim, row_stride):
            if stride is None or stride < dim:
                continue
            residues = grad_offsets & (stride - 1) if stride & (stride - 1) == 0 else grad_offsets % stride
            low, high = torch.aminmax(residues)
            if int(low) == int(high):
                grid = (stride, int(low))
                break
    if grid is None:
        rows = grad_rows(grad_flat, grad_offsets, dim)
        return rows, torch.arange(rows.shape[0], device=grad_flat.device)
    stride, first = grid
    num_rows = (grad_flat.numel() - first - dim) // stride + 1
    matrix = grad_flat.as_strided((num_rows, dim), (stride, 1), grad_flat.storage_offset() + first)
    if stride & (stride - 1) == 0:  # a shift: int64 division is ~10x slower on CPU
        return matrix, grad_offsets >> (stride.bit_length() - 1)
    return matrix, grad_offsets.div(stride, rounding_mode="floor")


def pooled_gradient_grid(layout: TableBatchedLayout, table: int | None, row_stride: int) -> tuple[int, int] | None:
    """The grid ``(stride, first offset modulo stride)`` holding every gradient row of table ``table``'s features
    (every table's when None) in a pooled gradient, read from the layout alone: row ``b`` of feature ``f`` starts at
    ``b * row_stride + feature_out_offsets[f]``. None when no single grid of stride ``dim`` or ``row_stride`` does."""
    dim = layout.max_dim if table is None else layout.tables[table].dim
    starts = {layout.feature_out_offsets[f] for f, t in enumerate(layout.feature_tables) if table is None or t == table}
    if row_stride % dim == 0 and len({start % dim for start in starts}) == 1:
        return dim, min(starts) % dim
    if len(starts) == 1 and row_stride >= dim:
        return row_stride, starts.pop()
    return None


def segment_sums(
    matrix: torch.Tensor, ids: torch.Tensor, segment_offsets: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor:
    """``[S, D]`` fp32: segment ``s`` sums ``scales[j] * matrix[ids[j]]`` over ``j`` in
    ``[segment_offsets[s] - segment_offsets[0], segment_offsets[s + 1] - segment_offsets[0])``, strictly in ``j``
    order (``embedding_bag`` in sum mode adds a bag's rows one after another, and never splits a bag across threads),
    so a run summed in the plan's canonical order gives the same bits wherever it sits in the batch."""
    return F.embedding_bag(
        ids,
        matrix,
        segment_offsets - segment_offsets[0],
        mode="sum",
        per_sample_weights=scales,
        include_last_offset=True,
    )


def _chunk_sums(
    matrix: torch.Tensor, ids: torch.Tensor, bag_offsets: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor:
    """:func:`segment_sums` with offsets already starting at 0, through ``torch.embedding_bag`` itself (the same
    kernel without the functional wrapper's per-call checks: the plan built these tensors)."""
    return torch.embedding_bag(matrix, ids, bag_offsets, False, 0, False, scales, True)[0]


def iter_row_sums(
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    grad_flat: torch.Tensor,
    chunk_bytes: int | None = None,
) -> Iterator[tuple[RowSpan, int, int, torch.Tensor]]:
    """Yield ``(span, a, b, sums)``: the fp32 gradient sums ``[b - a, dim]`` of unique rows ``[a, b)``, at most
    ``chunk_bytes`` of sums at a time (so a consumer's temporaries stay in cache).

    Each run is one ``embedding_bag`` segment over the gradient rows read in place (:func:`gradient_row_source`),
    added in the plan's canonical order."""
    goff, scales, row_stride = plan.sorted_grad_offsets, plan.sorted_scales, plan.grad_row_stride
    for span in row_spans(layout, plan):
        grid = None if row_stride is None else pooled_gradient_grid(layout, span.table, row_stride)
        matrix, ids = gradient_row_source(grad_flat, goff[span.c0 : span.c1], span.dim, row_stride, grid)
        span_scales = None if scales is None else scales[span.c0 : span.c1]
        rows_per_chunk = max(1, chunk_bytes // (4 * span.dim)) if chunk_bytes else span.u1 - span.u0
        bounds = [*range(span.u0, span.u1, rows_per_chunk), span.u1]
        starts = plan.segment_offsets[bounds].tolist() if len(bounds) > 2 else [span.c0, span.c1]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            c0, c1 = starts[k] - span.c0, starts[k + 1] - span.c0
            bag_offsets = plan.segment_offsets[a : b + 1] - starts[k]
            sums = _chunk_sums(matrix, ids[c0:c1], bag_offsets, None if span_scales is None else span_scales[c0:c1])
            yield span, a, b, sums


def row_gradient_sums_reference(
    layout: TableBatchedLayout, plan: RowGradientPlan, grad_flat: torch.Tensor
) -> torch.Tensor:
    """The specification: compact fp32 row sums (see module docstring and :func:`iter_row_sums`)."""
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
