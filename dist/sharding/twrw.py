"""Table-row-wise and grid sharding: a table (TWRW) or each column block of a table (GRID) lives on one node, row-wise
over that node's ``L`` local ranks; across nodes it is table-wise.

Data flow (pooled), with ``H`` nodes of ``L`` ranks and rank ``r = node * L + local``::

    KJT -> block_bucketize (L buckets per table) -> keys ordered by destination rank
      -> KJTAllToAll (stagger H: each key's bags arrive grouped by the source's local rank)
      -> local SUM lookup [sum(B), D_node] (partial bags)
      -> reduce-scatter inside the node (intra-node group): local rank j gets the node's sums for the samples of
         every rank with local index j
      -> all-to-all across nodes (cross-node group of local index j): [B_me, sum over nodes D_node] (skipped on
         one node, where it would return its input)
      -> MEAN divided by the bag length this rank holds

The groups come from :func:`~tritonrec.dist.comm.intra_and_cross_node_pg` (``LOCAL_WORLD_SIZE`` ranks per node).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm import get_local_size, intra_and_cross_node_pg
from tritonrec.dist.embedding_dist import PooledEmbeddingsAllToAll, PooledEmbeddingsReduceScatter
from tritonrec.dist.qcomm_protocol import CommOp
from tritonrec.dist.sharding.base import EmbeddingSharding, columns_of, feature_dims
from tritonrec.dist.sharding.common import LocalShard, OutputColumns, ShardingContext, mean_divisor
from tritonrec.dist.sharding.rw import bucketize
from tritonrec.dist.types import ShardingType
from tritonrec.kernels.embedding import PoolingMode


class _TwoStage(Awaitable[torch.Tensor]):
    """The intra-node reduce-scatter, then (launched when it is done) the cross-node all-to-all, as one awaitable."""

    def __init__(self, first: Awaitable[torch.Tensor], launch_second) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self._first = first
        self._launch_second = launch_second

    def _wait_impl(self) -> torch.Tensor:
        return self._launch_second(self._first.wait()).wait()


class TwRwSharding(EmbeddingSharding):
    """TWRW / GRID (see module docstring)."""

    sharding_type = ShardingType.TABLE_ROW_WISE.value

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        world = dist.group.WORLD
        if self.pg is not world:
            raise ValueError(
                f"{self.sharding_type} sharding needs the world process group (node groups are built on it)"
            )
        self.local_size = get_local_size(self.world_size)
        self.num_nodes = self.world_size // self.local_size
        self.node, self.local_rank = divmod(self.rank, self.local_size)
        node_ranks = [n * self.local_size for n in range(self.num_nodes)]
        # every local rank of a node reads the same features (one row block of each of the node's units)
        self._node_features = [self.rank_features(r) for r in node_ranks]
        for r in range(self.world_size):
            if self.rank_features(r) != self._node_features[r // self.local_size]:
                raise ValueError(
                    f"{self.sharding_type}: rank {r} holds a different set of shards than its node's first rank; "
                    "each table (or column block) must be row-wise over all ranks of one node"
                )
        self._send = [f for feats in self._node_features for f in feats]
        self._block_sizes = [
            max(s.rows for s in shard.table.shards if s.col_offset == shard.spec.col_offset)
            for r in node_ranks
            for shard in self.shards_per_rank[r]
            for _ in shard.features
        ]
        total = len(self._send)
        starts = [sum(len(f) for f in self._node_features[:n]) for n in range(self.num_nodes)]
        # bucketized keys are [local rank j][every node's features]; rank n * L + j needs node n's, bucket j
        self._permute = [
            j * total + starts[n] + i
            for n in range(self.num_nodes)
            for j in range(self.local_size)
            for i in range(len(self._node_features[n]))
        ]
        self._identity_permute = self._permute == list(range(len(self._permute)))  # one node: already in order
        self._splits = [len(self._node_features[r // self.local_size]) for r in range(self.world_size)]
        self._local_features = self._node_features[self.node]
        self._dims = feature_dims(self.shards_per_rank[self.rank])
        node_dims = [sum(feature_dims(self.shards_per_rank[r])) for r in node_ranks]
        self._is_mean_per_node = [
            [s.table.is_mean for s in self.shards_per_rank[r] for _ in s.features] for r in node_ranks
        ]
        self._output_dims = [d for r in node_ranks for d in feature_dims(self.shards_per_rank[r])]
        self._columns = columns_of([self.shards_per_rank[r] for r in node_ranks])
        intra, cross = intra_and_cross_node_pg(device=None, backend=dist.get_backend(self.pg))
        self.intra_rs = PooledEmbeddingsReduceScatter(
            intra, codecs=self.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        )
        self.cross_a2a = PooledEmbeddingsAllToAll(
            cross, node_dims, self.device, codecs=self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        )

    def local_shards(self, rank: int) -> list[LocalShard]:
        out = []
        for table in self.tables:
            for k, spec in enumerate(table.shards):
                if spec.rank == rank:
                    pooling = PoolingMode.SUM if table.is_mean else table.pooling
                    out.append(LocalShard(table, k, spec, pooling, tuple(table.config.feature_names)))
        return out

    @property
    def output_columns(self) -> OutputColumns:
        return self._columns

    def input_dist(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        selected = self.select(features, self._send)
        if selected.variable_stride_per_key():
            raise ValueError(f"{self.sharding_type} sharding does not take a variable batch per feature (VBE)")
        ctx.lengths = selected.lengths()
        bucketized, _ = bucketize(selected, self._block_sizes, self.local_size, False, self.lookup.backend)
        ordered = bucketized if self._identity_permute else bucketized.permute(self._permute)
        return self.all_to_all(ordered, self._splits, ctx, stagger=self.num_nodes)

    def output_dist(self, local: torch.Tensor, ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        batch = ctx.batch_size_per_rank
        nodes, size = range(self.num_nodes), self.local_size
        rs_splits = [sum(batch[x + size * y] for y in nodes) for x in range(size)]
        cross_batch = [batch[self.local_rank + size * y] for y in nodes]
        first = self.intra_rs(local, rs_splits)
        # one node: the cross-node group is this rank alone and its all-to-all would hand the reduced sums back
        # unchanged (~1 ms a step of launches, waits and copies, both ways, on 2 ranks)
        awaitable: Awaitable[torch.Tensor] = (
            first if self.num_nodes == 1 else _TwoStage(first, lambda reduced: self.cross_a2a(reduced, cross_batch))
        )
        is_mean = [m for per_node in self._is_mean_per_node for m in per_node]
        if any(is_mean):
            lengths = ctx.lengths.view(len(self._send), -1)  # type: ignore[union-attr]
            awaitable.callbacks.append(lambda out: out / mean_divisor(lengths, self._output_dims, is_mean))
        return awaitable


class GridSharding(TwRwSharding):
    sharding_type = ShardingType.GRID_SHARD.value


__all__ = ["GridSharding", "TwRwSharding"]
