"""``ShardedManagedCollisionEmbeddingBagCollection`` and its sharder (torchrec's ``mc_embeddingbag``), row-wise only.

Data flow (``W`` ranks; see :mod:`tritonrec.dist.mc_sharding` for how ids and rows are split)::

    raw-id KJT (this rank's samples) -> input_hash_func, id range check
      -> bucketize by raw-id range (ceil(input_hash_size / W) ids per rank) -> KJTAllToAll      (one all-to-all)
      -> this rank's MCH modules: profile (insert / evict) + remap -> local rows of this rank's row-wise shard
      -> local SUM lookup -> reduce-scatter -> [B_me, sum(D)] (MEAN divided by the global bag length)

The lookup, the reduce-scatter and the fused optimizer are the row-wise sharding of
:class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection` (the MC step is its ``input_transform``); only
the bucketing differs: by raw-id range instead of by table row. ``forward`` returns ``(KeyedTensor awaitable,
None awaitable)`` as torchrec's, or with ``return_remapped_features=True`` the remapped KJT of this rank's samples
(global rows, sent back by the reverse all-to-all, :class:`~tritonrec.dist.mc_sharding.RemappedFeaturesAwaitable`).
A variable batch per feature (VBE: ``stride_per_key_per_rank`` and ``inverse_indices``) is taken as by torchrec
1.8's: each feature's bags go with their own batch sizes, the MCH modules see the KJT's ids (not the expanded
batch's), the reduce-scatter carries each feature's batch sizes and the output is expanded with the inverse indices
to ``[B, sum(D)]`` (hash ZCH tables too); refused with ``return_remapped_features`` (as torchrec).
A row given to a new id is reset before the lookup (``init_fn`` redraw, fused optimizer state zeroed) as torchrec's
sharded module does (:mod:`tritonrec.dist.mc_row_reset`; the unsharded module keeps it unless built with
``reset_evicted_rows=True``). What this shares with the MC-EC
lives in :mod:`tritonrec.dist.mc_sharded_base`.

State dict: ``_embedding_module.embedding_bags.<table>.weight`` and
``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` (torchrec's keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from tritonrec.dist.mc_sharded_base import (
    ManagedCollisionContext,
    ManagedCollisionSharder,
    ShardedManagedCollisionModule,
)
from tritonrec.dist.sharding.base import EmbeddingSharding
from tritonrec.dist.sharding.common import ShardingContext
from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection


class ManagedCollisionEmbeddingBagCollectionContext(ManagedCollisionContext, EmbeddingBagCollectionContext):
    """The EBC context plus the rows the MCH modules handed to new ids this batch (local rows per table)."""


class ShardedManagedCollisionEmbeddingBagCollection(
    ShardedManagedCollisionModule[
        ShardedEmbeddingBagCollection, list[torch.Tensor], KeyedTensor, ManagedCollisionEmbeddingBagCollectionContext
    ]
):
    """Model-parallel :class:`ManagedCollisionEmbeddingBagCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection`; every table must be row-wise."""

    _unsharded_type = ManagedCollisionEmbeddingBagCollection
    _inner_type = ShardedEmbeddingBagCollection

    @property
    def _embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        return self._embedding_module

    def create_context(self) -> ManagedCollisionEmbeddingBagCollectionContext:
        return ManagedCollisionEmbeddingBagCollectionContext()

    def _check_input(self, features: KeyedJaggedTensor) -> None:
        if self._embedding_module.is_weighted() and features.weights_or_none() is None:
            raise ValueError(f"{type(self).__name__} is weighted (is_weighted=True) but features has no weights")

    def _check_variable_batch(self, features: KeyedJaggedTensor) -> None:
        """A VBE input is taken as torchrec 1.8's (bags bucketized per feature with their own batch sizes, output
        expanded with the KJT's inverse indices), except with ``return_remapped_features`` (torchrec: "VBE is not
        supported currently for return_remapped_features=True")."""
        if self._return_remapped_features:
            raise NotImplementedError(
                f"{type(self).__name__} does not take a variable batch per feature (VBE) input with "
                "return_remapped_features=True (as torchrec's)"
            )
        if features.inverse_indices_or_none() is None:
            raise ValueError("a variable batch per feature (VBE) needs the KJT's inverse_indices, got None")

    def _record_input(self, ctx: ManagedCollisionEmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> None:
        ctx.variable_batch_per_feature = features.variable_stride_per_key()

    def _record_sharding_input(
        self, sharding: EmbeddingSharding, ctx: ShardingContext, selected: KeyedJaggedTensor
    ) -> bool:
        """Nothing more for the pooled output dist (a VBE output reads the inverse indices the batch recorded); the
        unbucketize permutation is kept only for ``return_remapped_features``: it puts the returned rows in input
        order."""
        return self._return_remapped_features

    def is_weighted(self) -> bool:
        return self._embedding_module.is_weighted()

    def embedding_bag_configs(self) -> list:
        return self._embedding_module.embedding_bag_configs()


class ManagedCollisionEmbeddingBagCollectionSharder(ManagedCollisionSharder[ManagedCollisionEmbeddingBagCollection]):
    """Shards :class:`ManagedCollisionEmbeddingBagCollection` row-wise (the only sharding type it offers, as
    torchrec's), with the EBC's compute kernels and fused optimizer options.

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (the reduce-scatter's wire).
    """

    _sharded_type = ShardedManagedCollisionEmbeddingBagCollection

    def _table_weights(self, module: Any) -> dict[str, nn.Parameter]:
        return {config.name: module.embedding_bags[config.name].weight for config in module.embedding_bag_configs()}


__all__ = [
    "ManagedCollisionEmbeddingBagCollectionContext",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]
