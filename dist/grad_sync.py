"""Gradient synchronisation that a shard's own backward cannot do alone, done inside the backward.

Two cases need a collective between the local lookup's backward and the weight update:

* **Data parallel.** Every rank holds the whole table and sees only its own samples, so the gradient is all-reduced
  before it is used (averaged over ranks when :func:`~tritonrec.dist.comm_ops.get_gradient_division` is on, as the
  model-parallel outputs' gradients are). Dense kernel: the reduced gradient lands in the parameters' ``.grad``.
  Fused kernel: the reduced gradient of every row touched on any rank is applied by the fused rule, so all replicas
  take the same update (and equal the unsharded module's on the global batch).
* **Rowwise Adagrad on column shards.** The rule's per-row state grows by the mean of the row's squared gradient over
  the WHOLE row, which spans every column block of the table. Each block's holder computes its partial sum of squares
  for the rows it touched; holders of the same rows exchange those (small, ``[rows touched]`` fp32) partial sums
  point to point, and all apply the same total. (torchrec uses the per-block mean and so trains differently from the
  unsharded table; we do not.)

Both hook in the same way: the lookup's per-table weights are the outputs of :class:`_TableGradSink`, whose backward
receives every table's gradient of the lookup at once (one collective per lookup, not per table) and applies it.
The rules (:func:`apply_fused_rule`) are the fused kernels' rules, written on (rows, summed gradient) pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.comm_ops import get_gradient_division
from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.kernels.embedding import FusedOptimizerState, OptimType, TableBatchedLayout
from tritonrec.kernels.embedding.optim_state import StepScalars, begin_step
from tritonrec.kernels.embedding.rounding import round_fp32_to_storage_reference

GradHandler = Callable[[Sequence[torch.Tensor | None]], None]


class _TableGradSink(torch.autograd.Function):
    """Per-table views of flat weight buffers whose backward hands all tables' gradients to ``handler``.

    ``trigger`` is an empty leaf that requires grad, so the views (and the lookup's output) require grad and the
    backward runs even though the buffers themselves never do."""

    @staticmethod
    def forward(ctx: Any, handler: GradHandler, trigger: torch.Tensor, layouts: Any, *flats: torch.Tensor) -> Any:
        ctx.handler = handler
        return tuple(layout.table_view(flat, t) for layout, flat in zip(layouts, flats, strict=True)
                     for t in range(layout.num_tables))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        ctx.handler(grads)
        return (None,) * (3 + len(grads))


def sink_views(
    handler: GradHandler, layouts: Sequence[TableBatchedLayout], flats: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per group, its tables' views (to pass as ``table_weights`` with ``sparse_grad=True``); their gradients go to
    ``handler`` once per backward, all groups together, in group-then-table order."""
    if not torch.is_grad_enabled():
        return [
            [layout.table_view(flat, t) for t in range(layout.num_tables)]
            for layout, flat in zip(layouts, flats, strict=True)
        ]
    trigger = torch.empty(0, requires_grad=True, device=flats[0].device)
    views = _TableGradSink.apply(handler, trigger, tuple(layouts), *flats)
    out, k = [], 0
    for layout in layouts:
        out.append(list(views[k : k + layout.num_tables]))
        k += layout.num_tables
    return out


class _AllReduceGrads(torch.autograd.Function):
    """Identity on parameters whose backward all-reduces their (dense) gradients in one flat buffer."""

    @staticmethod
    def forward(ctx: Any, pg: dist.ProcessGroup, divide: bool, *params: torch.Tensor) -> Any:
        ctx.pg, ctx.divide = pg, divide
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device = next((g.device for g in grads if g is not None), None)
        dense = [torch.zeros(0, device=device) if g is None else (g.to_dense() if g.is_sparse else g) for g in grads]
        flat = torch.cat([g.reshape(-1).float() for g in dense]) if dense else torch.zeros(0)
        all_reduce_(flat, ctx.pg, ctx.divide, "data-parallel gradient all-reduce")
        out, start = [], 0
        for g, d in zip(grads, dense, strict=True):
            n = d.numel()
            out.append(None if g is None else flat[start : start + n].view_as(d).to(d.dtype))
            start += n
        return (None, None, *out)


def all_reduced_params(
    params: Sequence[torch.Tensor], pg: dist.ProcessGroup, average: bool | None = None
) -> list[torch.Tensor]:
    """Views of ``params`` whose gradients are all-reduced over ``pg``: averaged when ``average`` (default: when
    gradient division is on, as for replicated tables), else summed (parameters whose per-rank gradients are parts
    of one gradient, e.g. position weights used by several ranks' shards)."""
    if not torch.is_grad_enabled() or not params:
        return list(params)
    return list(_AllReduceGrads.apply(pg, get_gradient_division() if average is None else average, *params))


def all_reduce_(flat: torch.Tensor, pg: dist.ProcessGroup, divide: bool, what: str) -> None:
    work = dist.all_reduce(flat, group=pg, async_op=True)
    wait_for_work(work, what, pg)
    if divide and pg.size() > 1:
        flat.div_(pg.size())


@dataclass
class FusedTables:
    """One fused group: its layout, flat weights and optimizer state."""

    layout: TableBatchedLayout
    weights: torch.Tensor
    state: FusedOptimizerState


def apply_fused_rule(
    group: FusedTables,
    scalars: StepScalars,
    t: int,
    rows: torch.Tensor,
    grad: torch.Tensor,
    row_square_sums: torch.Tensor | None = None,
    full_dim: int | None = None,
) -> None:
    """Update rows ``rows [U]`` (local to table ``t``) of ``group`` with their summed gradient ``grad [U, dim]``.

    The rules of :mod:`~tritonrec.kernels.embedding.fused_update` (weight decay added to the gradient first). For
    rowwise Adagrad, ``row_square_sums [U]`` (of the decayed gradient over the whole row) and ``full_dim`` (the
    whole row's width) replace the shard's own, so column shards update like the whole table."""
    layout, state = group.layout, group.state
    if rows.numel() == 0:
        return
    table = layout.table_view(group.weights, t)
    g = grad.float()
    # fp32 SGD / rowwise Adagrad add their delta in place (one read-modify-write per row, as the kernels' twin)
    in_place = table.dtype == torch.float32 and state.optim != OptimType.ADAM
    w = table.index_select(0, rows).float() if scalars.weight_decay != 0.0 or not in_place else None
    if scalars.weight_decay != 0.0:
        g = g + scalars.weight_decay * w
    dim = table.shape[1]
    if state.optim == OptimType.EXACT_SGD:
        delta = g * -scalars.lr
    elif state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
        first = layout.table_row_offsets[t]
        momentum = state.momentum1[first : first + table.shape[0]]
        squares = (g * g).sum(dim=1) if row_square_sums is None else row_square_sums
        momentum.index_add_(0, rows, squares / (full_dim or dim))
        delta = g * (-scalars.lr / (momentum.index_select(0, rows).sqrt() + scalars.eps))[:, None]
    else:
        base = layout.table_weight_offsets[t]
        m1_table = state.momentum1[base : base + table.numel()].view(table.shape)
        m2_table = state.momentum2[base : base + table.numel()].view(table.shape)
        m1 = scalars.beta1 * m1_table.index_select(0, rows) + scalars.one_minus_beta1 * g
        m2 = scalars.beta2 * m2_table.index_select(0, rows) + scalars.one_minus_beta2 * (g * g)
        m1_table.index_copy_(0, rows, m1)
        m2_table.index_copy_(0, rows, m2)
        delta = -scalars.lr * ((m1 / scalars.bias1[t]) / ((m2 / scalars.bias2[t]).sqrt() + scalars.eps))
    if in_place:
        table.index_add_(0, rows, delta)
        return
    element = None
    if table.dtype != torch.float32 and state.stochastic_rounding:
        element = layout.table_weight_offsets[t] + rows[:, None] * dim + torch.arange(dim, device=rows.device)
    stored = round_fp32_to_storage_reference(w + delta, table.dtype, state.stochastic_rounding, element, scalars.seed)
    table.index_copy_(0, rows, stored)


def _sparse_rows(
    grad: torch.Tensor | None, rows: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [U], values [U, dim])`` of a coalesced sparse (or dense, or missing) table gradient."""
    if grad is None:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dim, device=device)
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    touched = (grad != 0).any(dim=1).nonzero().squeeze(1)
    return touched, grad.index_select(0, touched)


class DataParallelFusedUpdate:
    """Fused update of replicated tables: combine every rank's touched rows and their gradients, then apply the rule
    to each row touched on any rank, identically everywhere.

    Two exchanges, chosen by size (every rank decides alike from the first, a tiny all-gather of row counts): the
    touched rows and their gradients all-gathered (sparse: ``W x`` the largest rank's rows), or a dense all-reduce of
    every table with a touched-row mask (small tables, or batches touching most rows). Sparse sums are taken in rank
    order, so replicas stay bit-identical."""

    def __init__(self, pg: dist.ProcessGroup, groups: Sequence[FusedTables], exchange: str = "auto") -> None:
        if exchange not in ("auto", "sparse", "dense"):
            raise ValueError(f"exchange must be 'auto', 'sparse' or 'dense', got exchange={exchange!r}")
        self.pg = pg
        self.groups = list(groups)
        self.specs = [(g, t, spec) for g in self.groups for t, spec in enumerate(g.layout.tables)]
        self.exchange = exchange

    def __call__(self, grads: Sequence[torch.Tensor | None]) -> None:
        device = self.groups[0].weights.device
        local = [_sparse_rows(g, s.num_rows, s.dim, device) for g, (_, _, s) in zip(grads, self.specs, strict=True)]
        counts = torch.tensor([r.numel() for r, _ in local], dtype=torch.int64, device=device)
        every = [torch.empty_like(counts) for _ in range(self.pg.size())]
        wait_for_work(dist.all_gather(every, counts, group=self.pg, async_op=True), "data-parallel row counts", self.pg)
        per_rank = [c.tolist() for c in every]
        widths = [spec.dim + 1 for _, _, spec in self.specs]
        sparse_words = max(sum(n * w for n, w in zip(c, widths, strict=True)) for c in per_rank) * self.pg.size()
        dense_words = 2 * sum(spec.num_rows * w for (_, _, spec), w in zip(self.specs, widths, strict=True))
        if self.exchange == "sparse" or (self.exchange == "auto" and sparse_words < dense_words):
            summed = self._sparse(local, per_rank)
        else:
            summed = self._dense(local)
        divisor = float(self.pg.size()) if get_gradient_division() and self.pg.size() > 1 else 1.0
        with torch.no_grad():
            scalars = {id(g): begin_step(g.state) for g in self.groups}
            for (group, t, _), (rows, grad) in zip(self.specs, summed, strict=True):
                apply_fused_rule(group, scalars[id(group)], t, rows, grad / divisor if divisor != 1.0 else grad)

    def _dense(self, local: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        for (group, _, spec), (rows, values) in zip(self.specs, local, strict=True):
            block = torch.zeros(spec.num_rows, spec.dim + 1, device=group.weights.device)
            block[rows, : spec.dim] = values.float()
            block[rows, spec.dim] = 1.0  # touched on this rank
            parts.append(block.reshape(-1))
        flat = torch.cat(parts)
        all_reduce_(flat, self.pg, False, "data-parallel fused gradient all-reduce")
        out, start = [], 0
        for _, _, spec in self.specs:
            block = flat[start : start + spec.num_rows * (spec.dim + 1)].view(spec.num_rows, spec.dim + 1)
            start += block.numel()
            rows = (block[:, spec.dim] > 0).nonzero().squeeze(1)
            out.append((rows, block.index_select(0, rows)[:, : spec.dim]))
        return out

    def _sparse(
        self, local: list[tuple[torch.Tensor, torch.Tensor]], per_rank: list[list[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All-gather each rank's (row ids, gradients) as one fp32 buffer (ids bit-cast from int32), padded to the
        largest rank's, then sum per row in rank order."""
        dims = [spec.dim for _, _, spec in self.specs]
        sizes = [sum(n * (d + 1) for n, d in zip(c, dims, strict=True)) for c in per_rank]
        ids = [rows.to(torch.int32).view(torch.float32) for rows, _ in local]
        mine = torch.cat([*ids, *(v.float().reshape(-1) for _, v in local)])
        padded = torch.zeros(max(sizes), device=mine.device)
        padded[: mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.pg.size())]
        wait_for_work(dist.all_gather(gathered, padded, group=self.pg, async_op=True), "data-parallel rows", self.pg)
        parsed = []  # per rank, per table: (rows, values)
        for buffer, counts in zip(gathered, per_rank, strict=True):
            value_sizes = [n * d for n, d in zip(counts, dims, strict=True)]
            pieces = buffer[: sum(counts) + sum(value_sizes)].split(counts + value_sizes)
            tables = len(counts)
            parsed.append(
                [(pieces[i].view(torch.int32).long(), pieces[tables + i].view(-1, dims[i])) for i in range(tables)]
            )
        out = []
        for i, (_, _, spec) in enumerate(self.specs):
            union = torch.unique(torch.cat([rank_tables[i][0] for rank_tables in parsed]))
            total = torch.zeros(union.numel(), spec.dim, device=union.device)
            for rank_tables in parsed:  # rank order: every replica sums alike
                rows, values = rank_tables[i]
                total.index_add_(0, torch.searchsorted(union, rows), values)
            out.append((union, total))
        return out


@dataclass(frozen=True)
class ColumnShardKey:
    """A column shard of a table as the exchange names it: ``(table, shard index)``, with its rank and rows."""

    table: str
    shard_index: int
    rank: int
    row_offset: int
    col_offset: int


class ColumnShardAdagradUpdate:
    """Rowwise Adagrad for column-split tables: partial row sums of squares are exchanged point to point between
    the holders of the same rows of a table, then every holder applies the whole row's mean.

    Args:
        pg: the group the ranks below belong to.
        groups: this rank's fused groups; ``local[i]`` names table ``i`` (group-then-table order).
        shards_per_rank: every rank's local column shards, in that rank's lookup order.
        full_dims: table name -> the whole table's width.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        groups: Sequence[FusedTables],
        shards_per_rank: list[list[ColumnShardKey]],
        full_dims: dict[str, int],
    ) -> None:
        self.pg = pg
        self.groups = list(groups)
        self.rank = pg.rank()
        self.local = shards_per_rank[self.rank]
        self.full_dims = full_dims
        every = [s for shards in shards_per_rank for s in shards]
        # partners of a shard: the other column blocks of the same rows of the same table, in shard order
        self.partners = {
            s: sorted(
                (p for p in every if p.table == s.table and p.row_offset == s.row_offset and p != s),
                key=lambda p: p.shard_index,
            )
            for s in every
        }
        self.shards_per_rank = shards_per_rank
        self.position = {s: i for i, s in enumerate(self.local)}

    def _messages_to(self, peer: int) -> list[tuple[ColumnShardKey, ColumnShardKey]]:
        """What this rank sends ``peer``: for each of peer's shards (its order), the partial of each of its partners
        held here (shard order), as ``(peer's shard, our shard)`` pairs."""
        return [(s, p) for s in self.shards_per_rank[peer] for p in self.partners[s] if p.rank == self.rank]

    def _messages_from(self, peer: int) -> list[tuple[ColumnShardKey, ColumnShardKey]]:
        return [(s, p) for s in self.local for p in self.partners[s] if p.rank == peer]

    def __call__(self, grads: Sequence[torch.Tensor | None]) -> None:
        tables = [(group, t, spec) for group in self.groups for t, spec in enumerate(group.layout.tables)]
        scalars = [begin_step(group.state) for group in self.groups]
        rows, decayed, partial = [], [], []
        for (group, t, spec), grad in zip(tables, grads, strict=True):
            r, values = _sparse_rows(grad, spec.num_rows, spec.dim, group.weights.device)
            g = values.float()
            wd = scalars[self.groups.index(group)].weight_decay
            if wd != 0.0:
                g = g + wd * group.layout.table_view(group.weights, t).index_select(0, r).float()
            rows.append(r)
            decayed.append(g)
            partial.append((g * g).sum(dim=1))
        received = self._exchange(partial)
        with torch.no_grad():
            for i, (group, t, _) in enumerate(tables):
                shard = self.local[i]
                parts = {shard: partial[i], **received.get(shard, {})}
                order = sorted(parts, key=lambda s: s.shard_index)
                total = parts[order[0]].clone()
                for s in order[1:]:
                    total += parts[s]
                scalars_g = scalars[self.groups.index(group)]
                # weight decay was already added to ``decayed``: apply the rule without adding it again
                no_decay = replace(scalars_g, weight_decay=0.0)
                apply_fused_rule(group, no_decay, t, rows[i], decayed[i], total, self.full_dims[shard.table])

    def _exchange(self, partial: list[torch.Tensor]) -> dict[ColumnShardKey, dict[ColumnShardKey, torch.Tensor]]:
        """Send each partner its partial sums and receive theirs (sizes known: partners touched the same rows)."""
        ops, inbox = [], []
        for peer in range(self.pg.size()):
            if peer == self.rank:
                continue
            out = self._messages_to(peer)
            if out:
                send = torch.cat([partial[self.position[p]] for _, p in out])
                ops.append(dist.P2POp(dist.isend, send, group=self.pg, group_peer=peer))
            expected = self._messages_from(peer)
            if expected:
                sizes = [partial[self.position[s]].numel() for s, _ in expected]
                buffer = torch.empty(sum(sizes), dtype=torch.float32, device=partial[0].device)
                ops.append(dist.P2POp(dist.irecv, buffer, group=self.pg, group_peer=peer))
                inbox.append((expected, sizes, buffer))
        # local partners (several column blocks of one table on this rank) need no message
        received: dict[ColumnShardKey, dict[ColumnShardKey, torch.Tensor]] = {}
        for s in self.local:
            for p in self.partners[s]:
                if p.rank == self.rank:
                    received.setdefault(s, {})[p] = partial[self.position[p]]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                wait_for_work(work, "column-shard rowwise Adagrad exchange", self.pg)
        for expected, sizes, buffer in inbox:
            for (s, p), part in zip(expected, buffer.split(sizes), strict=True):
                received.setdefault(s, {})[p] = part
        return received


__all__ = [
    "ColumnShardAdagradUpdate",
    "ColumnShardKey",
    "DataParallelFusedUpdate",
    "FusedTables",
    "all_reduced_params",
    "apply_fused_rule",
    "sink_views",
]
