"""Row-wise sharding: every rank holds one block of ``ceil(rows / W)`` rows of every table (trailing blocks may be
short or empty), or uneven blocks (``row_wise(sizes_placement=...)``: explicit rows per rank, possibly none), and
each index goes to the rank holding its row, made local to the block: by block sizes, or by each feature's row
boundaries (the bucketizer's ``block_bucketize_pos``) once any table's blocks are uneven.

Data flow (pooled)::

    KJT -> block_bucketize_sparse_features (W buckets, indices made shard-local) -> KJTAllToAll
      -> local SUM lookup [sum(B), D] (partial bags) -> PooledEmbeddingsReduceScatter -> [B_me, D]
      -> MEAN features divided by the bag length this rank holds (the global one: torchrec #2362 divides partial
         bags by their partial lengths)

Sequence (EC): the lookup's rows go back by the sequence all-to-all and are put in input order with the bucketizer's
``unbucketize_permute``. Variable batch per feature: the reduce-scatter carries each feature's own batch sizes.
"""

from __future__ import annotations

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.embedding_dist import (
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from tritonrec.dist.kjt_dist import get_recat
from tritonrec.dist.qcomm_protocol import CommOp
from tritonrec.dist.sharding.base import EmbeddingSharding, feature_dims, record_slots, sequence_rows, shard_columns
from tritonrec.dist.sharding.common import LocalShard, OutputColumns, ShardingContext, mean_divisor
from tritonrec.dist.sharding.tw import expand_variable_batch, lookup_received
from tritonrec.dist.sharding_plan_checks import row_blocks
from tritonrec.dist.types import ShardingType
from tritonrec.kernels import block_bucketize_sparse_features
from tritonrec.kernels.embedding import PoolingMode


def row_boundaries(shards: list[LocalShard], world_size: int) -> list[list[int]] | None:
    """Per feature of ``shards`` (each a row-wise table, its shards in rank order), the ``world_size + 1`` rows its
    table's blocks start at, then its row count: the bucketizer's ``block_bucketize_pos``. ``None`` when every table
    has ``ceil(rows / W)`` blocks, which block sizes describe; such a table among uneven ones gets the boundaries
    ``p * ceil(rows / W)``, which bucket every id (past the table's rows too) as its block size does."""
    bounds, uneven = [], False
    for shard in shards:
        rows, sizes = shard.table.config.num_embeddings, [s.rows for s in shard.table.shards]
        if sizes == row_blocks(rows, world_size):
            table_bounds = [p * max(sizes) for p in range(world_size + 1)]
        else:
            uneven, table_bounds = True, [s.row_offset for s in shard.table.shards] + [rows]
        bounds += [table_bounds] * len(shard.features)
    return bounds if uneven else None


def bucketize(
    features: KeyedJaggedTensor,
    block_sizes: list[int],
    num_buckets: int,
    sequence: bool,
    backend: str,
    boundaries: torch.Tensor | None = None,
) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    """``features`` (F keys) -> a KJT of ``num_buckets * F`` keys (bucket-major) whose indices are local to their
    bucket's row block, and (``sequence``) the unbucketize permutation. Variable-stride inputs stay variable.
    ``boundaries [F, num_buckets + 1]`` (:func:`row_boundaries`, on the features' device): bucket by those uneven
    row blocks instead of ``block_sizes``."""
    lengths, values = features.lengths(), features.values()
    keys = features.keys()
    strides = features.stride_per_key()
    sizes = torch.tensor(block_sizes, dtype=torch.int64, device=lengths.device)
    if features.variable_stride_per_key():
        # the bucketizer takes one batch size for all features: give it one "feature" per bag instead
        per_bag = torch.tensor(strides, device=lengths.device)
        sizes = sizes.repeat_interleave(per_bag, output_size=lengths.numel())
        if boundaries is not None:
            boundaries = boundaries.repeat_interleave(per_bag, dim=0, output_size=lengths.numel())
    new_lengths, new_values, new_weights, _, unbucketize = block_bucketize_sparse_features(
        lengths,
        values,
        sizes,
        num_buckets,
        features.weights_or_none(),
        sequence=sequence,
        block_bucketize_pos=boundaries,
        backend=backend,
    )
    bucket_keys = keys * num_buckets
    if features.variable_stride_per_key():
        per_key = [[s] for s in strides] * num_buckets
        out = KeyedJaggedTensor(
            bucket_keys, new_values, new_weights, lengths=new_lengths, stride_per_key_per_rank=per_key
        )
    else:
        # our op's outputs on a checked KJT: consistent by construction, so no re-validation
        out = KeyedJaggedTensor._trusted(bucket_keys, new_values, new_weights, new_lengths, features.stride())
    return out, unbucketize


class RwSharding(EmbeddingSharding):
    """Row-wise (see module docstring)."""

    sharding_type = ShardingType.ROW_WISE.value
    supports_variable_batch = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        shards = self.shards_per_rank[self.rank]
        self._features = self.rank_features(self.rank)  # every rank reads every feature, in the same order
        self._block_sizes = [max(s.rows for s in shard.table.shards) for shard in shards for _ in shard.features]
        bounds = row_boundaries(shards, self.world_size)
        self._boundaries = None if bounds is None else torch.tensor(bounds, dtype=torch.int64, device=self.device)
        self._dims = feature_dims(shards)
        self._is_mean = [shard.table.is_mean for shard in shards for _ in shard.features]
        self._columns = shard_columns(shards)  # row shards hold every column: col_offset 0
        if self.pooled:
            codecs = self.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
            self.rs = PooledEmbeddingsReduceScatter(self.pg, codecs=codecs)
            self.vb_rs = VariableBatchPooledEmbeddingsReduceScatter(self.pg, codecs=codecs)
        else:
            self.seq_a2a = SequenceEmbeddingsAllToAll(
                self.pg,
                [len(self._features)] * self.world_size,
                self.device,
                codecs=self.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
            )

    def local_shards(self, rank: int) -> list[LocalShard]:
        out = []
        for table in self.tables:
            (k,) = [k for k, spec in enumerate(table.shards) if spec.rank == rank]
            pooling = PoolingMode.SUM if table.is_mean else table.pooling  # divided after the reduce-scatter
            out.append(LocalShard(table, k, table.shards[k], pooling, tuple(table.config.feature_names)))
        return out

    @property
    def output_columns(self) -> OutputColumns:
        return self._columns

    def input_dist(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        selected = self.select(features, self._features)
        if not self.pooled:
            record_slots(ctx, selected, list(self._columns.blocks))
        ctx.variable_batch = selected.variable_stride_per_key()
        ctx.lengths = selected.lengths()
        ctx.batch_size_per_feature_pre_a2a = selected.stride_per_key()
        bucketized, ctx.unbucketize_permute = bucketize(
            selected, self._block_sizes, self.world_size, not self.pooled, self.lookup.backend, self._boundaries
        )
        return self.all_to_all(bucketized, [len(self._features)] * self.world_size, ctx)

    def compute(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> torch.Tensor:
        return lookup_received(self, features, ctx, self._dims)

    def output_dist(self, local: torch.Tensor, ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        if not self.pooled:
            return self._sequence_output_dist(local, ctx)  # type: ignore[arg-type]
        if ctx.variable_batch:
            strides = ctx.stride_per_key_per_rank or []
            per_rank = [[row[r] for row in strides] for r in range(self.world_size)]
            awaitable = self.vb_rs(local, per_rank, self._dims)
            divisors = None
            if any(self._is_mean):
                lengths = ctx.lengths.split(ctx.batch_size_per_feature_pre_a2a)  # type: ignore[union-attr]
                divisors = [n.clamp(min=1).float() if m else None for n, m in zip(lengths, self._is_mean, strict=True)]
            inverse = ctx.extra["inverse_indices"]
            sizes = ctx.batch_size_per_feature_pre_a2a
            awaitable.callbacks.append(
                lambda flat: expand_variable_batch(flat, sizes, self._dims, self._features, inverse, divisors)
            )
            return awaitable
        awaitable = self.rs(local, ctx.batch_size_per_rank)
        if any(self._is_mean):
            lengths = ctx.lengths.view(len(self._features), -1)  # type: ignore[union-attr]
            awaitable.callbacks.append(lambda out: out / mean_divisor(lengths, self._dims, self._is_mean))
        return awaitable

    def _sequence_output_dist(self, local: list[torch.Tensor], ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        rows = sequence_rows(local, self.row_width, self.device)
        recat = None
        if len(set(ctx.batch_size_per_rank)) > 1:
            recat = get_recat(
                len(self._features), self.world_size, device=rows.device, batch_size_per_rank=ctx.batch_size_per_rank
            )
        return self.seq_a2a(
            rows,
            ctx.lengths_after_dist,
            ctx.input_splits,
            ctx.output_splits,
            unbucketize_permute_tensor=ctx.unbucketize_permute,
            batch_size_per_rank=ctx.batch_size_per_rank,
            sparse_features_recat=recat,
        )


__all__ = ["RwSharding", "bucketize", "row_boundaries"]
