"""Gradient rows and their sums in torch, as the twins of the backward read them: the compact layout of row sums
(table ``t``'s unique rows as one ``[U_t, D_t]`` block, blocks in table order), spans of unique rows of one dim, the
gradient rows read in place from the flat gradient wherever they lie on a grid, and chunked ``embedding_bag`` sums
of each row's sorted run of contributions.

Shared by :func:`~tritonrec.kernels.embedding.row_gradients.row_gradient_sums_reference` and the fused update's twin
(:func:`~tritonrec.kernels.embedding.fused_update.fused_update_reference`); re-exported by
:mod:`~tritonrec.kernels.embedding.row_gradients`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonrec.kernels.embedding.grad_plan import RowGradientPlan
from tritonrec.kernels.embedding.layout import TableBatchedLayout


def compact_offsets(layout: TableBatchedLayout, plan: RowGradientPlan) -> list[int]:
    """``[T + 1]`` element offsets of each table's ``[U_t, D_t]`` block in the compact row-gradient buffer."""
    out = [0]
    for t, spec in enumerate(layout.tables):
        out.append(out[-1] + (plan.table_unique_offsets[t + 1] - plan.table_unique_offsets[t]) * spec.dim)
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


__all__ = [
    "RowSpan",
    "compact_offsets",
    "grad_rows",
    "gradient_row_source",
    "iter_row_sums",
    "pooled_gradient_grid",
    "row_spans",
    "segment_sums",
]
