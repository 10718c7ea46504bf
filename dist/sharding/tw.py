"""Table-wise, column-wise and table-column-wise sharding: each shard (a whole table, or a block of its columns) is
a table on one rank, and every rank holding a shard of a table receives all of that table's features.

Data flow (pooled)::

    KJT (this rank's batch) -> permute keys by destination rank (a feature repeats for each shard reading it)
      -> KJTAllToAll -> local lookup [sum(B), D_me] -> PooledEmbeddingsAllToAll -> [B_me, sum over ranks D_r]

Column shards come back as separate column blocks, which the sharded module puts back in column order. Variable
batch per feature (VBE): the all-to-alls carry each feature's own batch sizes and the output is expanded with the
KJT's inverse indices.
"""

from __future__ import annotations

import itertools

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.embedding_dist import (
    PooledEmbeddingsAllToAll,
    SequenceEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
)
from tritonrec.dist.embedding_lookup import pad_variable_batch
from tritonrec.dist.kjt_dist import get_recat
from tritonrec.dist.qcomm_protocol import CommOp
from tritonrec.dist.sharding.base import EmbeddingSharding, columns_of, feature_dims, record_slots, sequence_rows
from tritonrec.dist.sharding.common import LocalShard, OutputColumns, ShardingContext
from tritonrec.dist.types import ShardingType


class TwCwSharding(EmbeddingSharding):
    """TW / CW / TWCW (see module docstring); the shards' placement comes from the plan."""

    sharding_type = ShardingType.TABLE_WISE.value
    supports_variable_batch = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._send_features = [f for r in range(self.world_size) for f in self.rank_features(r)]
        self._splits = [len(self.rank_features(r)) for r in range(self.world_size)]
        dims = [sum(feature_dims(shards)) for shards in self.shards_per_rank]
        self._dims_per_rank_per_feature = [feature_dims(shards) for shards in self.shards_per_rank]
        if self.pooled:
            self.a2a = PooledEmbeddingsAllToAll(
                self.pg, dims, self.device, codecs=self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
            )
            self.vb_a2a = VariableBatchPooledEmbeddingsAllToAll(
                self.pg, self._dims_per_rank_per_feature, codecs=self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
            )
        else:
            self.seq_a2a = SequenceEmbeddingsAllToAll(
                self.pg, self._splits, self.device, codecs=self.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
            )
        self._columns = columns_of(self.shards_per_rank)

    def local_shards(self, rank: int) -> list[LocalShard]:
        return [
            LocalShard(table, k, spec, table.pooling, tuple(table.config.feature_names))
            for table in self.tables
            for k, spec in enumerate(table.shards)
            if spec.rank == rank
        ]

    @property
    def output_columns(self) -> OutputColumns:
        return self._columns

    @property
    def send_features(self) -> list[str]:
        """The permuted input's keys: every rank's feature list, rank by rank."""
        return self._send_features

    def input_dist(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        permuted = self.select(features, self._send_features)
        if not self.pooled:
            record_slots(ctx, permuted, list(self._columns.blocks))
        ctx.variable_batch = permuted.variable_stride_per_key()
        ctx.batch_size_per_feature_pre_a2a = permuted.stride_per_key()
        return self.all_to_all(permuted, self._splits, ctx)

    def compute(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> torch.Tensor:
        return lookup_received(self, features, ctx, feature_dims(self.shards_per_rank[self.rank]))

    def output_dist(self, local: torch.Tensor, ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        if not self.pooled:
            return self._sequence_output_dist(local, ctx)  # type: ignore[arg-type]
        if not ctx.variable_batch:
            return self.a2a(local, ctx.batch_size_per_rank)
        strides = ctx.stride_per_key_per_rank or []
        per_rank_per_feature = [[row[r] for row in strides] for r in range(self.world_size)]
        awaitable = self.vb_a2a(local, per_rank_per_feature, ctx.batch_size_per_feature_pre_a2a)
        dims = [d for per_rank in self._dims_per_rank_per_feature for d in per_rank]
        inverse = ctx.extra["inverse_indices"]
        awaitable.callbacks.append(
            lambda flat: expand_variable_batch(
                flat, ctx.batch_size_per_feature_pre_a2a, dims, self._send_features, inverse
            )
        )
        return awaitable

    def _sequence_output_dist(self, local: list[torch.Tensor], ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        rows = sequence_rows(local, self.row_width, self.device)
        recat = None
        if len(set(ctx.batch_size_per_rank)) > 1:
            recat = get_recat(
                self._splits[self.rank],
                self.world_size,
                device=rows.device,
                batch_size_per_rank=ctx.batch_size_per_rank,
            )
        return self.seq_a2a(
            rows,
            ctx.lengths_after_dist,
            ctx.input_splits,
            ctx.output_splits,
            batch_size_per_rank=ctx.batch_size_per_rank,
            sparse_features_recat=recat,
        )


def lookup_received(
    sharding: EmbeddingSharding, features: KeyedJaggedTensor, ctx: ShardingContext, dims: list[int]
) -> torch.Tensor:
    """The local lookup of a KJT gathered from every rank (TW/CW, RW): a sequence lookup records the received
    lengths; a variable batch per feature (VBE) is padded to each feature's largest batch, looked up, and flattened
    back into per-rank order (``dims``: the output width of each local feature)."""
    if not sharding.pooled:
        ctx.lengths_after_dist = features.lengths()
        return EmbeddingSharding.compute(sharding, features, ctx)
    if not features.variable_stride_per_key():
        return EmbeddingSharding.compute(sharding, features, ctx)
    ctx.stride_per_key_per_rank = features.stride_per_key_per_rank()
    sharding.lookup.ensure_packed()
    padded = sharding.lookup.forward_pooled(pad_variable_batch(features))
    return flatten_per_rank(padded, ctx.stride_per_key_per_rank, dims)


def flatten_per_rank(padded: torch.Tensor, strides: list[list[int]], dims: list[int]) -> torch.Tensor:
    """A padded VBE lookup output ``[B_max, sum(dims)]`` (feature ``i``'s rows: source rank 0's bags, then rank
    1's, ...) -> the variable-batch all-to-all's flat input: for each destination rank, for each feature, its
    ``strides[i][r] x dims[i]`` values."""
    columns = [0, *itertools.accumulate(dims)]
    starts = [[0, *itertools.accumulate(row)] for row in strides]
    parts = [
        padded[starts[i][r] : starts[i][r + 1], columns[i] : columns[i + 1]].reshape(-1)
        for r in range(len(strides[0]) if strides else 0)
        for i in range(len(strides))
    ]
    # a rank without local features still sends through the all-to-all whose backward every rank must join: its
    # empty input stays in the graph (the lookup's placeholder requires grad)
    return torch.cat(parts) if parts else padded.reshape(-1)[:0]


def expand_variable_batch(
    flat: torch.Tensor,
    batch_sizes: list[int],
    dims: list[int],
    features: list[str],
    inverse_indices: tuple[list[str], torch.Tensor],
    divisors: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Per-feature ``[b_f, d_f]`` blocks of a flat VBE output -> ``[B, sum(d_f)]``: feature ``f``'s row ``i`` is
    its block's row ``inverse_indices[f][i]`` (torchrec's VBE output). ``divisors[f]``: optional ``[b_f]`` bag
    lengths to divide by (mean pooling after a partial-bag output dist)."""
    keys, inverse = inverse_indices
    row_of = {k: i for i, k in enumerate(keys)}
    blocks = flat.split([b * d for b, d in zip(batch_sizes, dims, strict=True)])
    out = []
    for f, (block, b, d, name) in enumerate(zip(blocks, batch_sizes, dims, features, strict=True)):
        rows = block.view(b, d)
        if divisors is not None and divisors[f] is not None:
            rows = rows / divisors[f][:, None]
        out.append(rows.index_select(0, inverse[row_of[name]].long()))
    return torch.cat(out, dim=1) if out else flat.new_zeros(inverse.shape[-1], 0)


class CwSharding(TwCwSharding):
    sharding_type = ShardingType.COLUMN_WISE.value


class TwCwTableColumnSharding(TwCwSharding):
    sharding_type = ShardingType.TABLE_COLUMN_WISE.value


__all__ = [
    "CwSharding",
    "TwCwSharding",
    "TwCwTableColumnSharding",
    "expand_variable_batch",
    "flatten_per_rank",
    "lookup_received",
]
