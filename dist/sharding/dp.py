"""Data-parallel sharding: every rank holds every table whole and looks up its own batch; nothing is distributed in
the forward. The gradient is all-reduced inside the backward (averaged over ranks when gradient division is on, as
the other shardings' gradients are), before a fused update, so every replica takes the same step.
"""

from __future__ import annotations

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, NoWait
from tritonrec.dist.embedding_lookup import pad_variable_batch
from tritonrec.dist.sharding.base import EmbeddingSharding, no_dist, record_slots, sequence_rows, shard_columns
from tritonrec.dist.sharding.common import LocalShard, OutputColumns, ShardingContext
from tritonrec.dist.types import ShardingType


class DpSharding(EmbeddingSharding):
    """Data parallel (see module docstring). Variable batch per feature: each feature's rows are expanded with the
    KJT's inverse indices."""

    sharding_type = ShardingType.DATA_PARALLEL.value
    supports_variable_batch = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        shards = self.shards_per_rank[self.rank]
        self._features = self.rank_features(self.rank)
        self._columns = shard_columns(shards)
        self.lookup.all_reduce_gradients(self.pg)

    def local_shards(self, rank: int) -> list[LocalShard]:
        return [
            LocalShard(table, rank, table.shards[rank], table.pooling, tuple(table.config.feature_names))
            for table in self.tables
        ]

    distributes_input = False

    @property
    def output_columns(self) -> OutputColumns:
        return self._columns

    def input_dist(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        selected = self.select(features, self._features)
        if not self.pooled:
            record_slots(ctx, selected, list(self._columns.blocks))
        ctx.variable_batch = selected.variable_stride_per_key()
        return no_dist(selected)

    def compute(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> torch.Tensor:
        if not self.pooled or not features.variable_stride_per_key():
            return super().compute(features, ctx)
        self.lookup.ensure_packed()
        padded = self.lookup.forward_pooled(pad_variable_batch(features))  # feature f's bags are rows [:b_f]
        keys, inverse = ctx.extra["inverse_indices"]
        row_of = {k: i for i, k in enumerate(keys)}
        blocks, start = [], 0
        # the inverse indices are the KJT's, keyed by feature (not by the embedding names of the columns)
        for feature, (_, _, width) in zip(self._features, self._columns.blocks, strict=True):
            blocks.append(padded[:, start : start + width].index_select(0, inverse[row_of[feature]].long()))
            start += width
        return torch.cat(blocks, dim=1) if blocks else padded[:0]

    def output_dist(self, local: torch.Tensor, ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        if not self.pooled:  # the lookup's per-feature rows, already in this rank's order
            return NoWait(sequence_rows(local, self.row_width, self.device))  # type: ignore[arg-type]
        return NoWait(local)


__all__ = ["DpSharding"]
