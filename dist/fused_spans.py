"""A fused group's tables as spans of one width, and the fused rules applied to a span's touched rows at once.

Tables of a :class:`~tritonrec.kernels.embedding.TableBatchedLayout` follow one another in the flat buffer, row
after row, so consecutive tables of one width form a single ``[rows, dim]`` block. The gradient-sync handlers
(:mod:`tritonrec.dist.grad_sync`) receive one gradient per table; here those are gathered into one
``(rows [U], values [U, dim])`` pair per span, and the rule updates all of a span's touched rows with one set of
torch ops, instead of one set per table (which costs a Python round and a pass over small tensors per table, on
every backward). Rows are span rows: row ``r`` of table ``t`` is ``r + (row_offsets[t] - row_offsets[first])``.

The rules are those of :mod:`~tritonrec.kernels.embedding.fused_update`, written on (rows, summed gradient) pairs;
a row's element offsets (which seed stochastic rounding) and its per-row state are the same as in the per-table
form, so a span update stores exactly what one update per table stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tritonrec.kernels.embedding import FusedOptimizerState, OptimType, TableBatchedLayout
from tritonrec.kernels.embedding.optim_state import StepScalars
from tritonrec.kernels.embedding.rounding import round_fp32_to_storage_reference


@dataclass
class FusedTables:
    """One fused group: its layout, flat weights and optimizer state."""

    layout: TableBatchedLayout
    weights: torch.Tensor
    state: FusedOptimizerState


@dataclass(frozen=True)
class WidthSpan:
    """Tables ``[first, end)`` of ``group``, all ``dim`` wide: rows ``[first_row, first_row + num_rows)`` of the
    group's global row numbering (a block of its flat buffer)."""

    group: FusedTables
    first: int
    end: int
    dim: int

    @property
    def first_row(self) -> int:
        return self.group.layout.table_row_offsets[self.first]

    @property
    def num_rows(self) -> int:
        return self.group.layout.table_row_offsets[self.end] - self.first_row

    @property
    def first_element(self) -> int:
        return self.group.layout.table_weight_offsets[self.first]

    def weights(self) -> torch.Tensor:
        """``[num_rows, dim]`` view of the span's block of the flat buffer."""
        start = self.first_element
        return self.group.weights[start : start + self.num_rows * self.dim].view(self.num_rows, self.dim)


def width_spans(groups: Sequence[FusedTables], max_rows: int | None = None) -> list[WidthSpan]:
    """Every group's tables as maximal runs of one width (of at most ``max_rows`` rows, where a single table does
    not exceed it), groups in order, tables in order. A span never crosses groups: each group has its own state and
    rule (tables with different fused optimizers are in different groups)."""
    spans = []
    for group in groups:
        tables, rows = group.layout.tables, group.layout.table_row_offsets
        start = 0
        for t in range(1, len(tables) + 1):
            too_many = max_rows is not None and t < len(tables) and rows[t + 1] - rows[start] > max_rows
            if t == len(tables) or tables[t].dim != tables[start].dim or too_many:
                spans.append(WidthSpan(group, start, t, tables[start].dim))
                start = t
    return spans


@dataclass
class SpanRows:
    """A span's touched rows: ``rows [U]`` (span rows, each table's ascending, tables in order), their summed
    gradients ``values [U, dim]`` and ``counts[i]`` rows of the span's ``i``-th table."""

    rows: torch.Tensor
    values: torch.Tensor
    counts: list[int]

    def table_bounds(self) -> list[int]:
        """``[T + 1]`` offsets of each table's rows in ``rows``."""
        out = [0]
        for n in self.counts:
            out.append(out[-1] + n)
        return out


def _table_rows(
    grad: torch.Tensor | None, dim: int, device: torch.device, label: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [U], values [U, dim])`` of one table's gradient: coalesced sparse (the lookup's), or none (no lookup
    read the table).

    The touched rows are the sparse gradient's indices, i.e. the ids the lookup read, kept even where a row's
    gradient is exactly zero (its upstream gradient was zero): the rule still applies to it (weight decay, Adam's
    moments), as in the unsharded module. A dense gradient cannot tell such a row from an untouched one, so it is
    refused rather than guessed from nonzero values."""
    if grad is None:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dim, device=device)
    if not grad.is_sparse:
        raise TypeError(
            f"{label}: the sharded fused update needs the lookup's sparse row gradient (its touched rows are "
            f"the ids the lookup read), got a dense gradient of shape {list(grad.shape)}"
        )
    grad = grad.coalesce()  # the lookup's are coalesced already: no work
    return grad.indices()[0], grad.values()


def _concat_rows(values: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(values)``, without the copy when the blocks already lie back to back in one buffer (the lookup's
    per-table gradients are slices of its one buffer of row sums)."""
    if len(values) == 1:
        return values[0]
    first = values[0]
    contiguous = all(v.is_contiguous() and v.dtype == first.dtype for v in values)
    storage = first.untyped_storage().data_ptr()
    position = first.data_ptr()
    for v in values:
        if not contiguous or v.untyped_storage().data_ptr() != storage or v.data_ptr() != position:
            return torch.cat(values)
        position += v.numel() * v.element_size()
    total = sum(v.shape[0] for v in values)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total, dim), (dim, 1))


def span_rows(span: WidthSpan, grads: Sequence[torch.Tensor | None]) -> SpanRows:
    """Gather the touched rows of ``span`` from ``grads`` (one per table of the span, in order)."""
    device = span.group.weights.device
    layout = span.group.layout
    rows, values = [], []
    for t, grad in zip(range(span.first, span.end), grads, strict=True):
        r, v = _table_rows(grad, span.dim, device, f"table {t} {layout.tables[t].name!r}")
        shift = layout.table_row_offsets[t] - span.first_row
        rows.append(r + shift if shift else r)
        values.append(v)
    counts = [r.numel() for r in rows]
    return SpanRows(torch.cat(rows) if len(rows) > 1 else rows[0], _concat_rows(values, span.dim), counts)


def spans_rows(spans: Sequence[WidthSpan], grads: Sequence[torch.Tensor | None]) -> list[SpanRows]:
    """Each span's touched rows from the per-table gradients of all the spans' groups (group-then-table order)."""
    tables = sum(span.end - span.first for span in spans)
    if tables != len(grads):
        raise RuntimeError(f"the fused groups have {tables} tables but the backward delivered {len(grads)} gradients")
    out, k = [], 0
    for span in spans:
        n = span.end - span.first
        out.append(span_rows(span, grads[k : k + n]))
        k += n
    return out


def decayed_gradient(span: WidthSpan, touched: SpanRows, scalars: StepScalars) -> torch.Tensor:
    """The touched rows' fp32 gradient plus ``weight_decay * w`` (L2, as the fused rules add it first): without
    weight decay, the gathered gradients themselves (which :func:`apply_span_rule` then consumes)."""
    g = touched.values.float()
    if scalars.weight_decay != 0.0:
        g = g + scalars.weight_decay * span.weights().index_select(0, touched.rows).float()
    return g


def apply_span_rule(
    span: WidthSpan,
    scalars: StepScalars,
    touched: SpanRows,
    grad: torch.Tensor,
    row_square_sums: torch.Tensor | None = None,
    full_dims: torch.Tensor | float | None = None,
) -> None:
    """Update the touched rows of ``span`` with their summed gradient ``grad [U, dim]`` fp32, which must already
    include weight decay (:func:`decayed_gradient`) and is consumed (scaled in place).

    Rowwise Adagrad: ``row_square_sums [U]`` (of the whole row's gradient) and ``full_dims`` (the whole row's width:
    one number, or ``[U]``) replace the span's own, so column shards update like the whole table."""
    rows = touched.rows
    if rows.numel() == 0:
        return
    state = span.group.state
    table = span.weights()
    # fp32 SGD / either Adagrad add their delta in place (one read-modify-write per row, as the kernels' twin)
    in_place = table.dtype == torch.float32 and state.optim != OptimType.ADAM
    w = None if in_place else table.index_select(0, rows).float()
    if state.optim == OptimType.EXACT_SGD:
        delta = grad.mul_(-scalars.lr)
    elif state.optim == OptimType.EXACT_ADAGRAD:  # per element: the state block is the span's block of momentum1
        m_table = state.momentum1[span.first_element : span.first_element + table.numel()].view(table.shape)
        momentum = m_table.index_select(0, rows).add_(grad * grad)
        m_table.index_copy_(0, rows, momentum)
        delta = grad.mul_(-scalars.lr).div_(momentum.sqrt_().add_(scalars.eps))
    elif state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
        momentum = state.momentum1[span.first_row : span.first_row + span.num_rows]
        if row_square_sums is None:  # the squared 2-norm: one fused reduction, as the twin computes it
            row_square_sums = torch.linalg.vector_norm(grad, dim=1).square_()
        momentum.index_add_(0, rows, row_square_sums / (span.dim if full_dims is None else full_dims))
        delta = grad.mul_((-scalars.lr / (momentum.index_select(0, rows).sqrt() + scalars.eps))[:, None])
    else:
        delta = _adam_delta(span, scalars, touched, grad, table.shape)
    if in_place:
        table.index_add_(0, rows, delta)
        return
    element = None
    if table.dtype != torch.float32 and state.stochastic_rounding:
        element = span.first_element + rows[:, None] * span.dim + torch.arange(span.dim, device=rows.device)
    stored = round_fp32_to_storage_reference(w + delta, table.dtype, state.stochastic_rounding, element, scalars.seed)
    table.index_copy_(0, rows, stored)


def _adam_delta(
    span: WidthSpan, scalars: StepScalars, touched: SpanRows, g: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    state, rows = span.group.state, touched.rows
    base, numel = span.first_element, shape[0] * shape[1]
    m1_table = state.momentum1[base : base + numel].view(shape)
    m2_table = state.momentum2[base : base + numel].view(shape)
    m1 = scalars.beta1 * m1_table.index_select(0, rows) + scalars.one_minus_beta1 * g
    m2 = scalars.beta2 * m2_table.index_select(0, rows) + scalars.one_minus_beta2 * (g * g)
    m1_table.index_copy_(0, rows, m1)
    m2_table.index_copy_(0, rows, m2)
    # bias corrections are per table (each counts its own updates): one value per row when the span has several
    if span.end - span.first == 1:
        bias1, bias2 = scalars.bias1[span.first], scalars.bias2[span.first]
    else:
        counts = torch.tensor(touched.counts, device=rows.device)
        bias1 = scalars.bias1[span.first : span.end].repeat_interleave(counts, output_size=rows.numel())[:, None]
        bias2 = scalars.bias2[span.first : span.end].repeat_interleave(counts, output_size=rows.numel())[:, None]
    return -scalars.lr * ((m1 / bias1) / ((m2 / bias2).sqrt() + scalars.eps))


__all__ = [
    "FusedTables",
    "SpanRows",
    "WidthSpan",
    "apply_span_rule",
    "decayed_gradient",
    "span_rows",
    "spans_rows",
    "width_spans",
]
