"""Rowwise Adagrad on column-split tables (column-wise, table-column-wise, grid), exact: the rule's per-row state
grows by the mean of the squared gradient over the WHOLE row, which spans every column block of the table, so the
holders of a table's blocks exchange their partial row sums of squares inside the backward and all apply the same
total (torchrec uses each block's own mean, and so trains differently from the unsharded table; we do not).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.fused_spans import FusedTables, apply_span_rule, decayed_gradient, spans_rows, width_spans
from tritonrec.kernels.embedding.optim_state import begin_step


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

    Every holder of a table's column blocks receives the same ids for it, so all of them touch the same rows in the
    same order: the partial sums line up element by element. A rank computes the partials of all its shards at once
    (one span of equal-width tables at a time, :mod:`~tritonrec.dist.fused_spans`), sends each peer one message
    (the partials that peer's shards need, in its order) and receives one, sums each row's partials in shard order
    (identically on every holder) and updates all its rows at once.

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
        self.spans = width_spans(self.groups)
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
        # per span: the whole rows' width, one number when the span's tables share it (else per row, built per step)
        self._span_full_dims = []
        k = 0
        for span in self.spans:
            dims = [float(full_dims[s.table]) for s in self.local[k : k + span.end - span.first]]
            self._span_full_dims.append(dims[0] if len(set(dims)) == 1 else dims)
            k += span.end - span.first

    def _messages_to(self, peer: int) -> list[tuple[ColumnShardKey, ColumnShardKey]]:
        """What this rank sends ``peer``: for each of peer's shards (its order), the partial of each of its partners
        held here (shard order), as ``(peer's shard, our shard)`` pairs."""
        return [(s, p) for s in self.shards_per_rank[peer] for p in self.partners[s] if p.rank == self.rank]

    def _messages_from(self, peer: int) -> list[tuple[ColumnShardKey, ColumnShardKey]]:
        return [(s, p) for s in self.local for p in self.partners[s] if p.rank == peer]

    def __call__(self, grads: Sequence[torch.Tensor | None]) -> None:
        scalars = {id(group): begin_step(group.state) for group in self.groups}
        touched = spans_rows(self.spans, grads)
        decayed, partial, bounds = [], [], []  # per span; partial[i] of local table i is a view of its span's
        for span, rows in zip(self.spans, touched, strict=True):
            g = decayed_gradient(span, rows, scalars[id(span.group)])
            squares = torch.linalg.vector_norm(g, dim=1).square_()  # the span's partial row sums of squares
            table_bounds = rows.table_bounds()
            decayed.append(g)
            bounds.append((squares, table_bounds))
            partial.extend(squares[a:b] for a, b in itertools.pairwise(table_bounds))
        received = self._exchange(partial)
        with torch.no_grad():
            k = 0
            for span, rows, g, (squares, table_bounds), full in zip(
                self.spans, touched, decayed, bounds, self._span_full_dims, strict=True
            ):
                total = self._totals(squares, table_bounds, k, received)
                full_dims = None
                if isinstance(full, list):
                    counts = torch.tensor(rows.counts, device=g.device)
                    full_dims = torch.tensor(full, device=g.device).repeat_interleave(counts, output_size=g.shape[0])
                elif full != span.dim:
                    full_dims = full
                # weight decay was already added to ``g``: apply the rule without adding it again
                step = replace(scalars[id(span.group)], weight_decay=0.0)
                apply_span_rule(span, step, rows, g, total, full_dims)
                k += span.end - span.first

    def _totals(
        self,
        squares: torch.Tensor,
        table_bounds: list[int],
        first: int,
        received: dict[ColumnShardKey, dict[ColumnShardKey, torch.Tensor]],
    ) -> torch.Tensor:
        """The whole rows' sums of squares of one span: each table's partials added in shard order (so every holder
        adds alike), or its own when no other block of the table exists."""
        if not any(received.get(self.local[first + i]) for i in range(len(table_bounds) - 1)):
            return squares
        total = torch.empty_like(squares)
        for i, (a, b) in enumerate(itertools.pairwise(table_bounds)):
            shard = self.local[first + i]
            parts = {shard: squares[a:b], **received.get(shard, {})}
            order = [parts[s] for s in sorted(parts, key=lambda s: s.shard_index)]
            out = total[a:b]
            if len(order) == 1:
                out.copy_(order[0])
                continue
            torch.add(order[0], order[1], out=out)
            for part in order[2:]:
                out.add_(part)
        return total

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


__all__ = ["ColumnShardAdagradUpdate", "ColumnShardKey"]
