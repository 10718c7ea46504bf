"""``ShardedManagedCollisionEmbeddingCollection`` and its sharder (torchrec's ``mc_embedding``), row-wise only.

Data flow (``W`` ranks; see :mod:`tritonrec.dist.mc_sharding` for how ids and rows are split)::

    raw-id KJT (this rank's samples) -> input_hash_func, id range check
      -> bucketize by raw-id range (ceil(input_hash_size / W) ids per rank, unbucketize permutation kept)
      -> KJTAllToAll -> this rank's MCH modules: profile (insert / evict) + remap -> local rows of its row shard
      -> local lookup [N, D] -> sequence all-to-all -> rows back in input order -> {embedding name: JaggedTensor}

The lookup, the sequence all-to-all and the fused optimizer are the row-wise sharding of
:class:`~tritonrec.dist.embedding.ShardedEmbeddingCollection` (the MC step is its ``input_transform``); only the
bucketing differs: by raw-id range instead of by table row. ``forward`` returns ``(dict awaitable, None awaitable)``
as torchrec's, or with ``return_remapped_features=True`` the remapped KJT of this rank's samples (global rows, sent
back by the reverse all-to-all); VBE inputs are refused (torchrec 1.8's MC input dist skips the EC's VBE padding and
sequence VBE context). ``use_index_dedup`` (on the sharder, as torchrec's EC sharder): each table's ids are made
unique per rank before the input dist and every feature's rows expanded back after it
(:mod:`tritonrec.dist.mc_dedup`). With ``need_indices`` the output's weights are this rank's
input ids after ``input_hash_func`` (not the remapped rows). A row given to a new id is reset before the lookup
(``init_fn`` redraw, fused optimizer state zeroed) as torchrec's sharded module does
(:mod:`tritonrec.dist.mc_row_reset`; the unsharded module keeps it unless built with ``reset_evicted_rows=True``).
What this shares with the MC-EBC lives in :mod:`tritonrec.dist.mc_sharded_base`.

State dict: ``_embedding_module.embeddings.<table>.weight`` and
``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` (torchrec's keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.awaitable import LazyAwaitable
from tritonrec.dist.embedding import (
    EmbeddingCollectionAwaitable,
    EmbeddingCollectionContext,
    ShardedEmbeddingCollection,
)
from tritonrec.dist.mc_dedup import DedupEmbeddingCollectionAwaitable, dedup_per_table
from tritonrec.dist.mc_sharded_base import (
    ManagedCollisionContext,
    ManagedCollisionSharder,
    ShardedManagedCollisionModule,
)
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharding.base import EmbeddingSharding, record_slots
from tritonrec.dist.sharding.common import ShardingContext
from tritonrec.dist.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingEnv
from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection


class ManagedCollisionEmbeddingCollectionContext(ManagedCollisionContext, EmbeddingCollectionContext):
    """The EC context plus the rows the MCH modules handed to new ids this batch (local rows per table) and, with
    index dedup, per feature the feature holding its table's unique ids and the inverse into them."""

    def __init__(self) -> None:
        super().__init__()
        self.dedup_inverse: dict[str, tuple[str, torch.Tensor]] = {}


class ShardedManagedCollisionEmbeddingCollection(
    ShardedManagedCollisionModule[
        ShardedEmbeddingCollection, list[Any], dict[str, JaggedTensor], ManagedCollisionEmbeddingCollectionContext
    ]
):
    """Model-parallel :class:`ManagedCollisionEmbeddingCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embedding.ShardedEmbeddingCollection`, ``use_index_dedup`` per table
    (:mod:`tritonrec.dist.mc_dedup`); every table must be row-wise."""

    _unsharded_type = ManagedCollisionEmbeddingCollection
    _inner_type = ShardedEmbeddingCollection

    def __init__(
        self,
        module: ManagedCollisionEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        if not isinstance(use_index_dedup, bool):
            raise TypeError(f"use_index_dedup must be a bool, got {type(use_index_dedup).__name__}")
        super().__init__(
            module, table_name_to_parameter_sharding, env, fused_params, device, qcomm_codecs_registry, module_fqn
        )
        if use_index_dedup and self._return_remapped_features:
            raise NotImplementedError(
                f"{type(self).__name__} does not take use_index_dedup=True with return_remapped_features=True "
                "(the returned rows would be the unique ids')"
            )
        per_feature = [t for t, m in module._managed_collision_collection._managed_collision_modules.items()
                       if getattr(m, "_per_feature", False)]  # fmt: skip
        if use_index_dedup and per_feature:
            raise NotImplementedError(
                f"{type(self).__name__} does not take use_index_dedup=True with PER_FEATURE_TTL_EVICTION tables "
                f"{per_feature}: the unique ids of a table no longer say which feature sent them (each feature's TTL)"
            )
        self._use_index_dedup = use_index_dedup

    @property
    def _embedding_collection(self) -> ShardedEmbeddingCollection:
        return self._embedding_module

    def create_context(self) -> ManagedCollisionEmbeddingCollectionContext:
        return ManagedCollisionEmbeddingCollectionContext()

    def _record_input(self, ctx: ManagedCollisionEmbeddingCollectionContext, features: KeyedJaggedTensor) -> None:
        """Each feature's input, from which the sequence output takes its lengths (and, with need_indices, ids)."""
        per_feature = features.to_dict()
        ctx.input_features = {name: per_feature[name] for name in self._embedding_module._features}

    def _dedup(self, ctx: ManagedCollisionEmbeddingCollectionContext, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not self._use_index_dedup:
            return features
        with torch.no_grad():
            deduped, ctx.dedup_inverse = dedup_per_table(features, self._managed_collision_collection._feature_to_table)
        return deduped

    def _expanded(
        self, ctx: ManagedCollisionEmbeddingCollectionContext, embeddings: Any
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """The inner module's output awaitable, expanding each feature's rows back when the batch was deduplicated."""
        if not self._use_index_dedup:
            return embeddings
        assert isinstance(embeddings, EmbeddingCollectionAwaitable)
        return DedupEmbeddingCollectionAwaitable(embeddings, ctx.dedup_inverse)

    def output_dist(self, ctx: ManagedCollisionEmbeddingCollectionContext, output: list[Any]) -> Any:
        embeddings, remapped = super().output_dist(ctx, output)
        return self._expanded(ctx, embeddings), remapped

    def compute_and_output_dist(self, ctx: ManagedCollisionEmbeddingCollectionContext, input: Any) -> Any:  # type: ignore[override]
        embeddings, remapped = super().compute_and_output_dist(ctx, input)
        return self._expanded(ctx, embeddings), remapped

    def _record_sharding_input(
        self, sharding: EmbeddingSharding, ctx: ShardingContext, selected: KeyedJaggedTensor
    ) -> bool:
        """The sequence output dist's slots; the unbucketize permutation is always kept: it puts the looked-up rows
        back in input order after the sequence all-to-all."""
        record_slots(ctx, selected, list(sharding.output_columns.blocks))
        return True

    def embedding_configs(self) -> list:
        return self._embedding_module.embedding_configs()

    def need_indices(self) -> bool:
        return self._embedding_module.need_indices()


class ManagedCollisionEmbeddingCollectionSharder(ManagedCollisionSharder[ManagedCollisionEmbeddingCollection]):
    """Shards :class:`ManagedCollisionEmbeddingCollection` row-wise (the only sharding type it offers, as
    torchrec's), with the EC's compute kernels and fused optimizer options.

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (the sequence all-to-all's wire).
        use_index_dedup: send each table's unique ids per rank only (:mod:`tritonrec.dist.mc_dedup`; torchrec takes
            it from its EC sharder).
    """

    _sharded_type = ShardedManagedCollisionEmbeddingCollection

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)
        self._use_index_dedup = use_index_dedup

    def shard(
        self,
        module: ManagedCollisionEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedManagedCollisionEmbeddingCollection:
        return ShardedManagedCollisionEmbeddingCollection(
            module,
            params,
            env,
            self._fused_params,
            device,
            self.qcomm_codecs_registry,
            module_fqn,
            use_index_dedup=self._use_index_dedup,
        )

    def _table_weights(self, module: Any) -> dict[str, nn.Parameter]:
        return {config.name: module.embeddings[config.name].weight for config in module.embedding_configs()}


__all__ = [
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]
