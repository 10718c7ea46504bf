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
back by the reverse all-to-all); VBE inputs are refused. With ``need_indices`` the output's weights are this rank's
input ids after ``input_hash_func`` (not the remapped rows). A row given to a new id keeps its weights and optimizer
state, as our unsharded module and torchrec 1.8's unsharded one.

State dict: ``_embedding_module.embeddings.<table>.weight`` and
``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` (torchrec's keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, LazyNoWait
from tritonrec.dist.embedding import EmbeddingCollectionContext, ShardedEmbeddingCollection
from tritonrec.dist.mc_sharding import (
    RemappedFeaturesAwaitable,
    ShardedManagedCollisionCollection,
    check_row_wise_plan,
)
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharded_tables import InputDistAwaitable, input_dist_checks
from tritonrec.dist.sharding.base import EmbeddingSharding, record_slots
from tritonrec.dist.sharding.common import ShardingContext, select_features
from tritonrec.dist.sharding.rw import bucketize
from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    FusedOptimizerModule,
    ModuleSharder,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

_Output = tuple[LazyAwaitable[dict[str, JaggedTensor]], LazyAwaitable[KeyedJaggedTensor | None]]


class ManagedCollisionEmbeddingCollectionContext(EmbeddingCollectionContext):
    """The EC context plus the rows the MCH modules handed to new ids this batch (local rows per table)."""

    def __init__(self) -> None:
        super().__init__()
        self.evictions_per_table: dict[str, torch.Tensor | None] = {}
        self.mc_features: KeyedJaggedTensor | None = None  # preprocessed input (return_remapped_features)
        self.remapped_returns: list[tuple[list[str], ShardingContext, Any]] = []


class ShardedManagedCollisionEmbeddingCollection(
    ShardedModule[list[KeyedJaggedTensor], list[Any], Any, ManagedCollisionEmbeddingCollectionContext],
    FusedOptimizerModule,
):
    """Model-parallel :class:`ManagedCollisionEmbeddingCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embedding.ShardedEmbeddingCollection` (no index dedup); every table must be row-wise."""

    def __init__(
        self,
        module: ManagedCollisionEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, ManagedCollisionEmbeddingCollection):
            raise TypeError(f"module must be a ManagedCollisionEmbeddingCollection, got {type(module).__name__}")
        if not isinstance(table_name_to_parameter_sharding, dict):
            raise TypeError(
                "table_name_to_parameter_sharding must be a dict, "
                f"got {type(table_name_to_parameter_sharding).__name__}"
            )
        for table, sharding in table_name_to_parameter_sharding.items():
            if getattr(sharding, "sharding_type", None) != ShardingType.ROW_WISE.value:
                raise ValueError(
                    f"{type(self).__name__} shards managed-collision tables row-wise only: table {table!r} has "
                    f"sharding type {getattr(sharding, 'sharding_type', sharding)!r} (use row_wise())"
                )
        self._embedding_module = ShardedEmbeddingCollection(
            module._embedding_module,  # type: ignore[arg-type]
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry,
            use_index_dedup=False,
            module_fqn=module_fqn,
        )
        ec = self._embedding_module
        check_row_wise_plan(ec._tables, type(self).__name__)
        self._managed_collision_collection = ShardedManagedCollisionCollection(
            module._managed_collision_collection, ec._tables, env.process_group, ec._device
        )
        self._return_remapped_features = module._return_remapped_features
        self._select_cache: dict[Any, list[int]] = {}
        self._allow_in_place_embed_weight_update = module._allow_in_place_embed_weight_update
        # the MC step runs on each sharding's delivered KJT, just before its lookup
        ec.input_transform = self._remap

    @property
    def _embedding_collection(self) -> ShardedEmbeddingCollection:
        return self._embedding_module

    def create_context(self) -> ManagedCollisionEmbeddingCollectionContext:
        return ManagedCollisionEmbeddingCollectionContext()

    def input_dist(
        self, ctx: ManagedCollisionEmbeddingCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        ec = self._embedding_module
        shardings = list(ec._shardings)
        # a rank rejecting its batch joins the checks the others' all-to-alls run
        with input_dist_checks(shardings, f"{type(self).__name__}.input_dist"):
            if not isinstance(features, KeyedJaggedTensor):
                raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
            index = features.index_per_key()
            missing = [f for f in ec._features if f not in index]
            if missing:
                raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
            if features.variable_stride_per_key():
                raise NotImplementedError(
                    f"{type(self).__name__} does not take a variable batch per feature (VBE) input"
                )
            with torch.no_grad():
                selected = select_features(features, ec._features, self._select_cache)
                features = self._managed_collision_collection.preprocess(selected)
            ctx.mc_features = features
            per_feature = features.to_dict()
            ctx.input_features = {name: per_feature[name] for name in ec._features}  # output lengths (and ids)
            ctx.sharding_contexts = [ShardingContext() for _ in shardings]
            return InputDistAwaitable(
                [self._rw_input_dist(s, features, c) for s, c in zip(shardings, ctx.sharding_contexts, strict=True)]
            )

    def _rw_input_dist(
        self, sharding: EmbeddingSharding, features: KeyedJaggedTensor, ctx: ShardingContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """The row-wise sequence sharding's input dist (:class:`~tritonrec.dist.sharding.rw.RwSharding`), bucketing
        by raw-id range: ids keep their value up to the rank's block start
        (:meth:`ShardedManagedCollisionCollection.remap` adds it back); the unbucketize permutation puts the looked-up
        rows back in input order after the sequence all-to-all."""
        names = sharding.rank_features(sharding.rank)
        selected = sharding.select(features, names)
        record_slots(ctx, selected, list(sharding.output_columns.blocks))
        ctx.variable_batch = False
        ctx.lengths = selected.lengths()
        ctx.batch_size_per_feature_pre_a2a = selected.stride_per_key()
        block_sizes = self._managed_collision_collection.block_sizes(names)
        bucketized, ctx.unbucketize_permute = bucketize(
            selected, block_sizes, sharding.world_size, True, sharding.lookup.backend
        )
        return sharding.all_to_all(bucketized, [len(names)] * sharding.world_size, ctx)

    def _remap(
        self, ctx: ManagedCollisionEmbeddingCollectionContext, sharding: Any, features: KeyedJaggedTensor
    ) -> KeyedJaggedTensor:
        remapped = self._managed_collision_collection.remap(features)
        if self._return_remapped_features:  # the rows go back to the samples' ranks
            (index,) = [i for i, s in enumerate(self._embedding_module._shardings) if s is sharding]
            context = ctx.sharding_contexts[index]
            work = self._managed_collision_collection.return_dist(remapped, context, sharding.input_dist_pg)
            ctx.remapped_returns.append((sharding.rank_features(sharding.rank), context, work))
        # torchrec 1.8's unsharded eviction hook is a no-op: the rows are only reported
        ctx.evictions_per_table.update(self._managed_collision_collection.evict())
        return remapped

    def compute(
        self, ctx: ManagedCollisionEmbeddingCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Any]:
        return self._embedding_module.compute(ctx, dist_input)

    def output_dist(self, ctx: ManagedCollisionEmbeddingCollectionContext, output: list[Any]) -> _Output:
        return self._embedding_module.output_dist(ctx, output), self._remapped_features(ctx)

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: ManagedCollisionEmbeddingCollectionContext, input: list[KeyedJaggedTensor]
    ) -> _Output:
        return self._embedding_module.compute_and_output_dist(ctx, input), self._remapped_features(ctx)

    def _remapped_features(
        self, ctx: ManagedCollisionEmbeddingCollectionContext
    ) -> LazyAwaitable[KeyedJaggedTensor | None]:
        if not self._return_remapped_features:
            return LazyNoWait(None)
        keys = self._managed_collision_collection._output_features
        return RemappedFeaturesAwaitable(ctx.mc_features, keys, ctx.remapped_returns)  # type: ignore[arg-type]

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer:
        return self._embedding_module.fused_optimizer

    def embedding_configs(self) -> list:
        return self._embedding_module.embedding_configs()

    def need_indices(self) -> bool:
        return self._embedding_module.need_indices()


class ManagedCollisionEmbeddingCollectionSharder(ModuleSharder[ManagedCollisionEmbeddingCollection]):
    """Shards :class:`ManagedCollisionEmbeddingCollection` row-wise (the only sharding type it offers, as
    torchrec's), with the EC's compute kernels and fused optimizer options.

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (the sequence all-to-all's wire).
    """

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        self._fused_params = fused_params

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._fused_params

    def shard(
        self,
        module: ManagedCollisionEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedManagedCollisionEmbeddingCollection:
        return ShardedManagedCollisionEmbeddingCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, module_fqn
        )

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingCollection]:
        return ManagedCollisionEmbeddingCollection

    def shardable_parameters(self, module: ManagedCollisionEmbeddingCollection) -> dict[str, nn.Parameter]:
        if not isinstance(module, ManagedCollisionEmbeddingCollection):
            raise TypeError(f"module must be a ManagedCollisionEmbeddingCollection, got {type(module).__name__}")
        ec = module._embedding_module
        return {config.name: ec.embeddings[config.name].weight for config in ec.embedding_configs()}  # type: ignore[union-attr]

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = [
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]
