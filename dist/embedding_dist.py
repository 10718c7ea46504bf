"""Output-distribution modules (torchrec's ``dist_data`` names): embeddings from the ranks that computed them to the
ranks that own the samples, as nn.Modules over :mod:`tritonrec.dist.comm_ops`, returning awaitables.

Each module instance holds a :class:`~tritonrec.dist.comm_consistency.MetadataCheck` (``metadata_check``): its
first calls verify that every rank passes the same metadata before any data moves.

The single-process, multi-device (inference) counterparts live in :mod:`tritonrec.dist.all_to_one`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist import comm_checks as checks
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_consistency import MetadataCheck
from tritonrec.dist.comm_ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    reduce_scatter_base_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    variable_batch_alltoall_pooled,
)
from tritonrec.dist.kjt_dist import invert_permute
from tritonrec.kernels.checks import check_tensor

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs

TensorCallback = Callable[[torch.Tensor], torch.Tensor]


def _check_pg(pg: object) -> dist.ProcessGroup:
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__}")
    return pg


def _check_callbacks(callbacks: object) -> list[TensorCallback]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, list) or not all(callable(c) for c in callbacks):
        raise TypeError(f"callbacks must be a list of callables or None, got {callbacks!r}")
    return callbacks


class PooledEmbeddingsAwaitable(Awaitable[torch.Tensor]):
    """Awaitable of a pooled-embeddings collective's output tensor."""

    def __init__(self, tensor_awaitable: Awaitable[torch.Tensor]) -> None:
        super().__init__()
        self._tensor_awaitable = tensor_awaitable

    def _wait_impl(self) -> torch.Tensor:
        return self._tensor_awaitable.wait()


class PooledEmbeddingsAllToAll(nn.Module):
    """Pooled embeddings of this rank's tables for the global batch -> all tables for this rank's batch.

    Example (2 ranks)::

        a2a = PooledEmbeddingsAllToAll(pg, dim_sum_per_rank=[2, 1])
        rank0_output = a2a(torch.rand(6, 2)).wait()   # torch.Size([3, 3])
        rank1_output = a2a(torch.rand(6, 1)).wait()   # torch.Size([3, 3])
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        dim_sum_per_rank: list[int],
        device: torch.device | None = None,
        callbacks: list[TensorCallback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        self._dim_sum_per_rank = checks.check_sizes(dim_sum_per_rank, "dim_sum_per_rank", pg.size())
        self._callbacks = _check_callbacks(callbacks)
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()
        # Kept as buffers for torchrec state-dict compatibility; the comm op itself needs only the lists.
        self.register_buffer(
            "_dim_sum_per_rank_tensor", torch.tensor(self._dim_sum_per_rank, device=device, dtype=torch.int)
        )
        cumsum = list(itertools.accumulate(self._dim_sum_per_rank))
        self.register_buffer("_cumsum_dim_sum_per_rank_tensor", torch.tensor(cumsum, device=device, dtype=torch.int))

    def forward(
        self, local_embs: torch.Tensor, batch_size_per_rank: list[int] | None = None
    ) -> PooledEmbeddingsAwaitable:
        """``local_embs [sum(B), D_me]`` -> awaitable of ``[B_me, sum(D)]``. Without ``batch_size_per_rank``, the
        rows are split evenly over the ranks (their number must divide)."""
        with self.metadata_check.call(self._pg, type(self).__name__):  # its own checks fail on every rank too
            check_tensor(local_embs, "local_embs", ndim=2)
            world_size = self._pg.size()
            if not batch_size_per_rank:
                if local_embs.shape[0] % world_size:
                    raise ValueError(
                        f"local_embs has {local_embs.shape[0]} rows, not divisible by the world size {world_size}; "
                        "pass batch_size_per_rank for uneven batches"
                    )
                batch_size_per_rank = [local_embs.shape[0] // world_size] * world_size
            tensor_awaitable = alltoall_pooled(
                a2a_pooled_embs_tensor=local_embs,
                batch_size_per_rank=batch_size_per_rank,
                dim_sum_per_rank=self._dim_sum_per_rank,
                group=self._pg,
                codecs=self._codecs,
                metadata_check=self.metadata_check,
            )
        awaitable = PooledEmbeddingsAwaitable(tensor_awaitable)
        awaitable.callbacks.extend(self._callbacks)
        return awaitable

    @property
    def callbacks(self) -> list[TensorCallback]:
        return self._callbacks


class VariableBatchPooledEmbeddingsAllToAll(nn.Module):
    """Pooled all-to-all with a batch size per (rank, feature); see
    :func:`~tritonrec.dist.comm_ops.variable_batch_alltoall_pooled` for the flat layouts.

    Example (2 ranks; rank 0 owns f0 (dim 2), rank 1 owns f1, f2 (dim 3))::

        a2a = VariableBatchPooledEmbeddingsAllToAll(pg, emb_dim_per_rank_per_feature=[[2], [3, 3]])
        # batch sizes: f0: r0 2, r1 1;  f1: r0 1, r1 2;  f2: r0 3, r1 2
        rank0_output = a2a(torch.rand(6), [[2], [1]], [2, 1, 3]).wait()          # 2*2 + 1*3 + 3*3 = 16 values
        rank1_output = a2a(torch.rand(24), [[1, 3], [2, 2]], [1, 2, 2]).wait()   # 1*2 + 2*3 + 2*3 = 14 values
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        emb_dim_per_rank_per_feature: list[list[int]],
        device: torch.device | None = None,
        callbacks: list[TensorCallback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        self._emb_dim_per_rank_per_feature = checks.check_size_table(
            emb_dim_per_rank_per_feature, "emb_dim_per_rank_per_feature", pg.size()
        )
        self._callbacks = _check_callbacks(callbacks)
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: list[list[int]],
        batch_size_per_feature_pre_a2a: list[int],
    ) -> PooledEmbeddingsAwaitable:
        tensor_awaitable = variable_batch_alltoall_pooled(
            a2a_pooled_embs_tensor=local_embs,
            batch_size_per_rank_per_feature=batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a=batch_size_per_feature_pre_a2a,
            emb_dim_per_rank_per_feature=self._emb_dim_per_rank_per_feature,
            group=self._pg,
            codecs=self._codecs,
            metadata_check=self.metadata_check,
        )
        awaitable = PooledEmbeddingsAwaitable(tensor_awaitable)
        awaitable.callbacks.extend(self._callbacks)
        return awaitable

    @property
    def callbacks(self) -> list[TensorCallback]:
        return self._callbacks


class PooledEmbeddingsReduceScatter(nn.Module):
    """Row-wise / TWRW output dist: ``local_embs [sum(input_splits), D]`` holds partial sums for every rank's batch;
    each rank gets the total for its rows. Equal (or no) ``input_splits`` use the plain reduce-scatter, unequal ones
    the reduce-scatter-v (which works on gloo too)."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()

    def forward(self, local_embs: torch.Tensor, input_splits: list[int] | None = None) -> PooledEmbeddingsAwaitable:
        """``local_embs [sum(input_splits), D]`` -> awaitable of this rank's ``[input_splits[me], D]`` sums. Equal
        splits take the plain reduce-scatter, but must still add up to ``local_embs``' rows."""
        with self.metadata_check.call(self._pg, type(self).__name__):  # its own checks fail on every rank too
            if input_splits:
                input_splits = checks.check_sizes(input_splits, "input_splits", self._pg.size())
                rows = checks.check_float_tensor(local_embs, "local_embs", min_ndim=1).shape[0]
                if sum(input_splits) != rows:
                    raise ValueError(
                        f"local_embs has {rows} rows but sum(input_splits) = {sum(input_splits)} "
                        f"(input_splits={input_splits})"
                    )
            if input_splits and len(set(input_splits)) > 1:
                tensor_awaitable = reduce_scatter_v_pooled(
                    local_embs, input_splits, self._pg, codecs=self._codecs, metadata_check=self.metadata_check
                )
            else:
                tensor_awaitable = reduce_scatter_base_pooled(
                    local_embs, self._pg, codecs=self._codecs, metadata_check=self.metadata_check
                )
        return PooledEmbeddingsAwaitable(tensor_awaitable)


class VariableBatchPooledEmbeddingsReduceScatter(nn.Module):
    """Reduce-scatter of a flat ``[sum over ranks r, features f of B[r][f] * dim_f]`` tensor (variable batch)."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()

    def forward(
        self, local_embs: torch.Tensor, batch_size_per_rank_per_feature: list[list[int]], embedding_dims: list[int]
    ) -> PooledEmbeddingsAwaitable:
        tensor_awaitable = reduce_scatter_v_per_feature_pooled(
            local_embs, batch_size_per_rank_per_feature, embedding_dims, self._pg, self._codecs, self.metadata_check
        )
        return PooledEmbeddingsAwaitable(tensor_awaitable)


class PooledEmbeddingsAllGather(nn.Module):
    """``[B, D]`` on every rank -> ``[W * B, D]``."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()

    def forward(self, local_emb: torch.Tensor) -> PooledEmbeddingsAwaitable:
        awaitable = all_gather_base_pooled(local_emb, self._pg, codecs=self._codecs, metadata_check=self.metadata_check)
        return PooledEmbeddingsAwaitable(awaitable)


class SequenceEmbeddingsAwaitable(Awaitable[torch.Tensor]):
    """Awaitable of sequence embeddings ``[N, D]``; with ``unbucketize_permute_tensor`` (row-wise sharding), rows are
    put back in the order of the ids before bucketization."""

    def __init__(
        self,
        tensor_awaitable: Awaitable[torch.Tensor],
        unbucketize_permute_tensor: torch.Tensor | None,
        embedding_dim: int,
    ) -> None:
        super().__init__()
        self._tensor_awaitable = tensor_awaitable
        if unbucketize_permute_tensor is not None:
            permute = unbucketize_permute_tensor.long()
            self.callbacks.append(lambda out: out.view(-1, embedding_dim).index_select(0, permute))

    def _wait_impl(self) -> torch.Tensor:
        return self._tensor_awaitable.wait()


class SequenceEmbeddingsAllToAll(nn.Module):
    """Sequence embeddings back to the ranks whose ids they embed (the reverse of the sparse all-to-all).

    Args:
        pg: the group.
        features_per_rank: number of features (keys) each rank owns after the sparse all-to-all.
        device: device of the recat buffers.
        codecs: quantized communication codecs.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: list[int],
        device: torch.device | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._pg = _check_pg(pg)
        features_per_rank = checks.check_sizes(features_per_rank, "features_per_rank", pg.size())
        world_size, local_split = pg.size(), features_per_rank[pg.rank()]
        self._local_split = local_split
        # (feature, rank) rows of the received lengths -> (rank, feature) rows, and back.
        forward_recat = [r + t * world_size for r in range(world_size) for t in range(local_split)]
        backward_recat = [t + r * local_split for t in range(local_split) for r in range(world_size)]
        self.register_buffer("_forward_recat_tensor", torch.tensor(forward_recat, device=device, dtype=torch.int))
        self.register_buffer("_backward_recat_tensor", torch.tensor(backward_recat, device=device, dtype=torch.int))
        self._codecs = checks.check_codecs(codecs)
        self.metadata_check = MetadataCheck()

    def forward(
        self,
        local_embs: torch.Tensor,
        lengths: torch.Tensor,
        input_splits: list[int],
        output_splits: list[int],
        unbucketize_permute_tensor: torch.Tensor | None = None,
        batch_size_per_rank: list[int] | None = None,
        sparse_features_recat: torch.Tensor | None = None,
    ) -> SequenceEmbeddingsAwaitable:
        """``local_embs [N_me, D]`` with the post-input-dist ``lengths`` and the sparse all-to-all's ``values``
        splits (``input_splits``: ids sent per rank, ``output_splits``: ids received per rank). With unequal
        ``batch_size_per_rank``, ``sparse_features_recat`` (bag-level, :func:`~tritonrec.dist.kjt_dist.get_recat`
        with ``batch_size_per_rank``) is required."""
        with self.metadata_check.call(self._pg, type(self).__name__):  # its own checks fail on every rank too
            check_tensor(local_embs, "local_embs", ndim=2)
            variable_batch_size = batch_size_per_rank is not None and len(set(batch_size_per_rank)) > 1
            if sparse_features_recat is not None:
                check_tensor(sparse_features_recat, "sparse_features_recat", ndim=1, integer=True)
                forward_recat, backward_recat = invert_permute(sparse_features_recat), sparse_features_recat
            elif variable_batch_size and self._local_split > 0:
                raise ValueError(
                    f"batch_size_per_rank={batch_size_per_rank} varies across ranks, so sparse_features_recat (the "
                    "bag-level recat of the sparse all-to-all) is required, got None"
                )
            else:
                forward_recat, backward_recat = self._forward_recat_tensor, self._backward_recat_tensor
            tensor_awaitable = alltoall_sequence(
                a2a_sequence_embs_tensor=local_embs,
                forward_recat_tensor=forward_recat if forward_recat.numel() else None,
                backward_recat_tensor=backward_recat if backward_recat.numel() else None,
                lengths_after_sparse_data_all2all=lengths,
                input_splits=input_splits,
                output_splits=output_splits,
                variable_batch_size=variable_batch_size,
                group=self._pg,
                codecs=self._codecs,
                metadata_check=self.metadata_check,
            )
        return SequenceEmbeddingsAwaitable(tensor_awaitable, unbucketize_permute_tensor, local_embs.shape[1])


__all__ = [
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
    "SequenceEmbeddingsAllToAll",
    "SequenceEmbeddingsAwaitable",
    "VariableBatchPooledEmbeddingsAllToAll",
    "VariableBatchPooledEmbeddingsReduceScatter",
]
