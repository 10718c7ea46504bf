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
A row given to a new id keeps its weights and optimizer state, as our unsharded module and torchrec 1.8's unsharded
one (torchrec's sharded module re-initialises such rows with ``init_fn`` instead).

State dict: ``_embedding_module.embedding_bags.<table>.weight`` and
``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` (torchrec's keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, LazyNoWait
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from tritonrec.dist.mc_sharding import (
    RemappedFeaturesAwaitable,
    ShardedManagedCollisionCollection,
    check_row_wise_plan,
)
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharded_tables import InputDistAwaitable, input_dist_checks
from tritonrec.dist.sharding.base import EmbeddingSharding
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
from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

_Output = tuple[LazyAwaitable[KeyedTensor], LazyAwaitable[KeyedJaggedTensor | None]]


class ManagedCollisionEmbeddingBagCollectionContext(EmbeddingBagCollectionContext):
    """The EBC context plus the rows the MCH modules handed to new ids this batch (local rows per table)."""

    def __init__(self) -> None:
        super().__init__()
        self.evictions_per_table: dict[str, torch.Tensor | None] = {}
        self.mc_features: KeyedJaggedTensor | None = None  # preprocessed input (return_remapped_features)
        self.remapped_returns: list[tuple[list[str], ShardingContext, Any]] = []


class ShardedManagedCollisionEmbeddingBagCollection(
    ShardedModule[list[KeyedJaggedTensor], list[torch.Tensor], Any, ManagedCollisionEmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Model-parallel :class:`ManagedCollisionEmbeddingBagCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection`; every table must be row-wise."""

    def __init__(
        self,
        module: ManagedCollisionEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, ManagedCollisionEmbeddingBagCollection):
            raise TypeError(f"module must be a ManagedCollisionEmbeddingBagCollection, got {type(module).__name__}")
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
        self._embedding_module = ShardedEmbeddingBagCollection(
            module._embedding_module,
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry,
            module_fqn,
        )
        ebc = self._embedding_module
        check_row_wise_plan(ebc._tables, type(self).__name__)
        self._managed_collision_collection = ShardedManagedCollisionCollection(
            module._managed_collision_collection, ebc._tables, env.process_group, ebc._device
        )
        self._return_remapped_features = module._return_remapped_features
        self._select_cache: dict[Any, list[int]] = {}
        self._allow_in_place_embed_weight_update = module._allow_in_place_embed_weight_update
        # the MC step runs on each sharding's delivered KJT, just before its lookup
        ebc.input_transform = self._remap

    @property
    def _embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        return self._embedding_module

    def create_context(self) -> ManagedCollisionEmbeddingBagCollectionContext:
        return ManagedCollisionEmbeddingBagCollectionContext()

    def input_dist(
        self, ctx: ManagedCollisionEmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        ebc = self._embedding_module
        shardings = list(ebc._shardings)
        # a rank rejecting its batch joins the checks the others' all-to-alls run
        with input_dist_checks(shardings, f"{type(self).__name__}.input_dist"):
            if not isinstance(features, KeyedJaggedTensor):
                raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
            index = features.index_per_key()
            missing = [f for f in ebc._features if f not in index]
            if missing:
                raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
            if ebc.is_weighted() and features.weights_or_none() is None:
                raise ValueError(f"{type(self).__name__} is weighted (is_weighted=True) but features has no weights")
            if features.variable_stride_per_key():
                raise NotImplementedError(
                    f"{type(self).__name__} does not take a variable batch per feature (VBE) input"
                )
            with torch.no_grad():
                selected = select_features(features, ebc._features, self._select_cache)
                features = self._managed_collision_collection.preprocess(selected)
            ctx.mc_features = features
            ctx.variable_batch_per_feature = False
            ctx.inverse_indices = features.inverse_indices_or_none()
            ctx.sharding_contexts = [ShardingContext() for _ in shardings]
            return InputDistAwaitable(
                [self._rw_input_dist(s, features, c) for s, c in zip(shardings, ctx.sharding_contexts, strict=True)]
            )

    def _rw_input_dist(
        self, sharding: EmbeddingSharding, features: KeyedJaggedTensor, ctx: ShardingContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """The row-wise sharding's input dist (:class:`~tritonrec.dist.sharding.rw.RwSharding`), bucketing by
        raw-id range: ids keep their value up to the rank's block start (:meth:`ShardedManagedCollisionCollection.remap`
        adds it back)."""
        names = sharding.rank_features(sharding.rank)
        selected = sharding.select(features, names)
        ctx.variable_batch = False
        ctx.lengths = selected.lengths()  # this rank's bag lengths: the MEAN divisor after the reduce-scatter
        ctx.batch_size_per_feature_pre_a2a = selected.stride_per_key()
        ctx.extra["inverse_indices"] = None
        block_sizes = self._managed_collision_collection.block_sizes(names)
        # return_remapped_features: the unbucketize permutation puts the returned rows in input order
        bucketized, ctx.unbucketize_permute = bucketize(
            selected, block_sizes, sharding.world_size, self._return_remapped_features, sharding.lookup.backend
        )
        return sharding.all_to_all(bucketized, [len(names)] * sharding.world_size, ctx)

    def _remap(
        self, ctx: ManagedCollisionEmbeddingBagCollectionContext, sharding: Any, features: KeyedJaggedTensor
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
        self, ctx: ManagedCollisionEmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[torch.Tensor]:
        return self._embedding_module.compute(ctx, dist_input)

    def output_dist(self, ctx: ManagedCollisionEmbeddingBagCollectionContext, output: list[torch.Tensor]) -> _Output:
        return self._embedding_module.output_dist(ctx, output), self._remapped_features(ctx)

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: ManagedCollisionEmbeddingBagCollectionContext, input: list[KeyedJaggedTensor]
    ) -> _Output:
        return self._embedding_module.compute_and_output_dist(ctx, input), self._remapped_features(ctx)

    def _remapped_features(
        self, ctx: ManagedCollisionEmbeddingBagCollectionContext
    ) -> LazyAwaitable[KeyedJaggedTensor | None]:
        if not self._return_remapped_features:
            return LazyNoWait(None)
        keys = self._managed_collision_collection._output_features
        return RemappedFeaturesAwaitable(ctx.mc_features, keys, ctx.remapped_returns)  # type: ignore[arg-type]

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer:
        return self._embedding_module.fused_optimizer

    def is_weighted(self) -> bool:
        return self._embedding_module.is_weighted()

    def embedding_bag_configs(self) -> list:
        return self._embedding_module.embedding_bag_configs()


class ManagedCollisionEmbeddingBagCollectionSharder(ModuleSharder[ManagedCollisionEmbeddingBagCollection]):
    """Shards :class:`ManagedCollisionEmbeddingBagCollection` row-wise (the only sharding type it offers, as
    torchrec's), with the EBC's compute kernels and fused optimizer options.

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (the reduce-scatter's wire).
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
        module: ManagedCollisionEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedManagedCollisionEmbeddingBagCollection:
        return ShardedManagedCollisionEmbeddingBagCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, module_fqn
        )

    @property
    def module_type(self) -> type[ManagedCollisionEmbeddingBagCollection]:
        return ManagedCollisionEmbeddingBagCollection

    def shardable_parameters(self, module: ManagedCollisionEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        if not isinstance(module, ManagedCollisionEmbeddingBagCollection):
            raise TypeError(f"module must be a ManagedCollisionEmbeddingBagCollection, got {type(module).__name__}")
        ebc = module._embedding_module
        return {config.name: ebc.embedding_bags[config.name].weight for config in ebc.embedding_bag_configs()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = [
    "ManagedCollisionEmbeddingBagCollectionContext",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]
