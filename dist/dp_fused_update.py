"""Fused update of data-parallel (replicated) tables inside the backward: every rank's touched rows and their
gradients are combined, and the rule is applied to each row touched on any rank, identically on every replica (see
:mod:`tritonrec.dist.grad_sync` for how the handler receives the gradients).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from tritonrec.dist.comm_ops import get_gradient_division
from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.fused_spans import (
    FusedTables,
    SpanRows,
    WidthSpan,
    apply_span_rule,
    decayed_gradient,
    spans_rows,
    width_spans,
)
from tritonrec.dist.grad_sync import all_reduce_
from tritonrec.dist.tensor_collectives import all_gather_tensor
from tritonrec.kernels.embedding.optim_state import begin_step


def _table_counts(span: WidthSpan, rows: torch.Tensor) -> list[int]:
    """Rows of each table of ``span`` among the ascending span rows ``rows``."""
    layout = span.group.layout
    bounds = [layout.table_row_offsets[t] - span.first_row for t in range(span.first, span.end + 1)]
    at = torch.searchsorted(rows, torch.tensor(bounds, dtype=rows.dtype, device=rows.device)).tolist()
    return [b - a for a, b in itertools.pairwise(at)]


# Largest common multiple of the span widths for which the gathered rows are read in place (padding each rank's
# segment to a multiple of it); past it (many odd widths) they are copied into one block first.
_MAX_ALIGN = 1 << 16


# Row ids travel bit-cast to fp32 inside the data-parallel exchange: a span keeps its rows below 2**31.
_MAX_SPAN_ROWS = 2**31 - 1


class DataParallelFusedUpdate:
    """Fused update of replicated tables: combine every rank's touched rows and their gradients, then apply the rule
    to each row touched on any rank, identically everywhere.

    Two exchanges, chosen by size (every rank decides alike from the first, a tiny all-gather of row counts): the
    touched rows and their gradients all-gathered (sparse: ``W x`` the largest rank's rows), or a dense all-reduce of
    every table with a touched-row mask (small tables, or batches touching most rows). Sparse sums are taken in rank
    order, so replicas stay bit-identical. Tables of one width are handled together
    (:mod:`~tritonrec.dist.fused_spans`).
    """

    def __init__(self, pg: dist.ProcessGroup, groups: Sequence[FusedTables], exchange: str = "auto") -> None:
        if exchange not in ("auto", "sparse", "dense"):
            raise ValueError(f"exchange must be 'auto', 'sparse' or 'dense', got exchange={exchange!r}")
        self.pg = pg
        self.groups = list(groups)
        self.spans = width_spans(self.groups, _MAX_SPAN_ROWS)
        self.exchange = exchange
        self.max_align = _MAX_ALIGN

    def __call__(self, grads: Sequence[torch.Tensor | None]) -> None:
        device = self.groups[0].weights.device
        local = spans_rows(self.spans, grads)
        counts = torch.tensor([t.rows.numel() for t in local], dtype=torch.int64, device=device)
        every = [torch.empty_like(counts) for _ in range(self.pg.size())]
        wait_for_work(dist.all_gather(every, counts, group=self.pg, async_op=True), "data-parallel row counts", self.pg)
        per_rank = [c.tolist() for c in every]
        widths = [span.dim + 1 for span in self.spans]
        sparse_words = max(sum(n * w for n, w in zip(c, widths, strict=True)) for c in per_rank) * self.pg.size()
        dense_words = 2 * sum(span.num_rows * w for span, w in zip(self.spans, widths, strict=True))
        divisor = float(self.pg.size()) if get_gradient_division() and self.pg.size() > 1 else 1.0
        if self.exchange == "sparse" or (self.exchange == "auto" and sparse_words < dense_words):
            summed = self._sparse(local, per_rank, 1.0 / divisor)
        else:
            summed = self._dense(local)
            if divisor != 1.0:
                for _, grad in summed:
                    grad.div_(divisor)
        with torch.no_grad():
            scalars = {id(g): begin_step(g.state) for g in self.groups}
            for span, (rows, grad) in zip(self.spans, summed, strict=True):
                touched = SpanRows(rows, grad, _table_counts(span, rows))
                step = scalars[id(span.group)]
                g = decayed_gradient(span, touched, step)
                apply_span_rule(span, replace(step, weight_decay=0.0), touched, g)

    def _dense(self, local: list[SpanRows]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        for span, touched in zip(self.spans, local, strict=True):
            block = torch.zeros(span.num_rows, span.dim + 1, device=span.group.weights.device)
            block[touched.rows, : span.dim] = touched.values.float()
            block[touched.rows, span.dim] = 1.0  # touched on this rank
            parts.append(block.reshape(-1))
        flat = torch.cat(parts)
        all_reduce_(flat, self.pg, False, "data-parallel fused gradient all-reduce")
        out, start = [], 0
        for span in self.spans:
            block = flat[start : start + span.num_rows * (span.dim + 1)].view(span.num_rows, span.dim + 1)
            start += block.numel()
            rows = (block[:, span.dim] > 0).nonzero().squeeze(1)
            out.append((rows, block.index_select(0, rows)[:, : span.dim]))
        return out

    def _sparse(
        self, local: list[SpanRows], per_rank: list[list[int]], scale: float
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All-gather each rank's touched rows and gradients as one fp32 segment per rank (ids bit-cast from int32),
        then sum each row's gradients (times ``scale``) in rank order, reading them in place from what arrived.

        A rank's segment holds each span's ``[n, dim]`` gradients at an offset that is a multiple of ``dim``, then
        the ids; every segment is ``size`` long, a multiple of every width, so span ``i``'s rows of all ranks lie on
        one grid of stride ``dim``: one ``[rows, dim]`` view of the gathered buffer."""
        dims = [span.dim for span in self.spans]
        layouts = [_segment_layout(dims, counts) for counts in per_rank]
        align = math.lcm(*dims)
        aligned = align <= self.max_align
        size = max(used for _, _, used in layouts)
        size = -(-size // align) * align if aligned else size
        device = self.groups[0].weights.device
        send = torch.empty(size, device=device)
        value_offsets, ids_offset, _ = layouts[self.pg.rank()]
        for touched, offset, dim in zip(local, value_offsets, dims, strict=True):
            send[offset : offset + touched.values.numel()].view(-1, dim).copy_(touched.values)
        ids = [t.rows.to(torch.int32).view(torch.float32) for t in local]
        torch.cat(ids, out=send[ids_offset : ids_offset + sum(i.numel() for i in ids)])
        gathered = torch.empty(self.pg.size() * size, device=device)
        work = all_gather_tensor(gathered, send, group=self.pg, async_op=True)
        wait_for_work(work, "data-parallel rows", self.pg)
        out = []
        for i, dim in enumerate(dims):
            rows, positions, blocks = [], [], []
            for r, (offsets, ids_at, _) in enumerate(layouts):
                n = per_rank[r][i]
                first_id = r * size + ids_at + sum(per_rank[r][:i])
                rows.append(gathered[first_id : first_id + n].view(torch.int32))
                start = r * size + offsets[i]
                if aligned:
                    positions.append(torch.arange(start // dim, start // dim + n, device=device))
                else:
                    blocks.append(gathered[start : start + n * dim].view(n, dim))
            if aligned:
                matrix = gathered[: gathered.numel() // dim * dim].view(-1, dim)
                out.append(sum_rows_in_order(rows, matrix, torch.cat(positions), scale))
            else:
                blocks_cat = torch.cat(blocks)
                ids_cat = torch.arange(blocks_cat.shape[0], device=device)
                out.append(sum_rows_in_order(rows, blocks_cat, ids_cat, scale))
        return out


def _segment_layout(dims: list[int], counts: list[int]) -> tuple[list[int], int, int]:
    """A rank's segment of the data-parallel exchange: the element offset of each span's gradients (a multiple of
    its width), of the ids, and the elements used."""
    offsets, at = [], 0
    for dim, n in zip(dims, counts, strict=True):
        at = -(-at // dim) * dim
        offsets.append(at)
        at += n * dim
    return offsets, at, at + sum(counts)


def sum_rows_in_order(
    rows: Sequence[torch.Tensor], matrix: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(union [U] ascending int64, sums [U, D] fp32)`` of the parts ``rows[k]`` (their concatenation, in order, is
    ``[N]`` row ids): entry ``j``'s gradient is ``matrix[positions[j]]``, and each row's entries are added in part
    order, times ``scale`` (every replica that sums the same parts gets the same bits). One stable sort of the ids
    and one segment sum (``embedding_bag`` adds a segment's rows one after another), instead of one scatter per
    part."""
    all_rows = torch.cat(list(rows)) if len(rows) > 1 else rows[0]
    sorted_rows, order = torch.sort(all_rows, stable=True)
    union, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    if union.numel() == 0:
        return union.long(), matrix.new_zeros(0, matrix.shape[1], dtype=torch.float32)
    starts = torch.cumsum(counts, dim=0) - counts
    weights = None if scale == 1.0 else torch.full((order.numel(),), scale, device=matrix.device)
    sums = torch.nn.functional.embedding_bag(
        positions.index_select(0, order), matrix, starts, mode="sum", per_sample_weights=weights
    )
    return union.long(), sums


__all__ = ["DataParallelFusedUpdate", "sum_rows_in_order"]
