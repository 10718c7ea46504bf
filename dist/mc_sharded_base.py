"""What the sharded managed-collision EC and EBC share (:mod:`tritonrec.dist.mc_embedding`,
:mod:`tritonrec.dist.mc_embeddingbag`), row-wise only.

Both wrap the inner sharded module (:class:`~tritonrec.dist.embedding.ShardedEmbeddingCollection` or
:class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection`) whose row-wise sharding does the lookup, the
output dist and the fused optimizer; on top of it they hold the :class:`ShardedManagedCollisionCollection` (the MCH
or hash ZCH modules of this rank's row shards), run its preprocess (``input_hash_func``, id range check) in
``input_dist``, bucket by raw-id range (hash ZCH: by bucket, :mod:`tritonrec.dist.mc_hash_zch_sharding`) instead of by
table row, run its remap as the inner module's ``input_transform`` (just before the
lookup, so a pipeline prefetching the next input dist does not reorder the MCH updates), reset the rows the remap
handed to new ids (``init_fn`` redraw, fused optimizer state zeroed: :mod:`tritonrec.dist.mc_row_reset`, torchrec's
``_evict``) before the lookup reads them, and, with
``return_remapped_features``, send the remapped rows back to the samples' ranks. A variable batch per feature (VBE)
keeps each feature's batch sizes through the bucketing and the all-to-all (the pooled output dist expands it with
the KJT's inverse indices).

A subclass names the unsharded module type it takes (``_unsharded_type``) and the inner sharded module it builds
(``_inner_type``), and fills the hooks where the EC and the EBC differ: which input it refuses (``_check_input``,
``_check_variable_batch``: every VBE input by default), what the input dist sends (``_dedup``: the MC-EC's index
dedup), what its output dist reads from the batch context (``_record_input``) and from each sharding context
(``_record_sharding_input``, which also says whether the unbucketize permutation is needed).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, LazyNoWait
from tritonrec.dist.embedding import ShardedEmbeddingCollection
from tritonrec.dist.embeddingbag import ShardedEmbeddingBagCollection
from tritonrec.dist.mc_hash_zch_sharding import bucketize_by_rank, destinations
from tritonrec.dist.mc_row_reset import reset_evicted_rows
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
    BaseEmbeddingSharder,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    FusedOptimizerModule,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from tritonrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)


class ManagedCollisionContext:
    """Mixed in before the inner module's context: the rows the MCH modules handed to new ids this batch (local rows
    per table) and, for ``return_remapped_features``, the preprocessed input and the pending reverse all-to-alls."""

    sharding_contexts: list[ShardingContext]

    def __init__(self) -> None:
        super().__init__()
        self.evictions_per_table: dict[str, torch.Tensor | None] = {}
        self.mc_features: KeyedJaggedTensor | None = None  # preprocessed input (return_remapped_features)
        self.inverse_indices: tuple[list[str], torch.Tensor] | None = None  # the input KJT's (VBE)
        self.remapped_returns: list[tuple[list[str], ShardingContext, Any]] = []


_Inner = TypeVar("_Inner", ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)
_DistOut = TypeVar("_DistOut")
_Embeddings = TypeVar("_Embeddings")
_Ctx = TypeVar("_Ctx", bound=ManagedCollisionContext)


class ShardedManagedCollisionModule(
    ShardedModule[list[KeyedJaggedTensor], _DistOut, Any, _Ctx],
    FusedOptimizerModule,
    Generic[_Inner, _DistOut, _Embeddings, _Ctx],
):
    """Model-parallel managed-collision EC / EBC (see module docstring): ``_embedding_module`` is the inner sharded
    module, ``_managed_collision_collection`` this rank's MCH modules; every table must be row-wise."""

    _unsharded_type: ClassVar[type[nn.Module]]
    # the inner sharded module, built from the unsharded one's _embedding_module with this module's arguments
    _inner_type: ClassVar[type[nn.Module]]
    _embedding_module: _Inner

    def __init__(
        self,
        module: ManagedCollisionEmbeddingCollection | ManagedCollisionEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, self._unsharded_type):
            raise TypeError(f"module must be a {self._unsharded_type.__name__}, got {type(module).__name__}")
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
        self._embedding_module = self._inner_type(  # type: ignore[call-arg]
            module._embedding_module,
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        inner = self._embedding_module
        check_row_wise_plan(inner._tables, type(self).__name__)
        self._managed_collision_collection = ShardedManagedCollisionCollection(
            module._managed_collision_collection, inner._tables, env.process_group, inner._device
        )
        self._return_remapped_features = module._return_remapped_features
        self._select_cache: dict[Any, list[int]] = {}
        self._allow_in_place_embed_weight_update = module._allow_in_place_embed_weight_update
        # the MC step runs on each sharding's delivered KJT, just before its lookup
        inner.input_transform = self._remap

    def _check_input(self, features: KeyedJaggedTensor) -> None:
        """Refuse a batch the inner module cannot take (raised inside the input dist checks); none by default."""

    def _check_variable_batch(self, features: KeyedJaggedTensor) -> None:
        """Refuse a variable batch per feature (VBE) input the module cannot take; all by default (the MC-EC:
        torchrec 1.8's MC input dist skips the EC's VBE padding and sequence VBE context)."""
        raise NotImplementedError(f"{type(self).__name__} does not take a variable batch per feature (VBE) input")

    @abc.abstractmethod
    def _record_input(self, ctx: _Ctx, features: KeyedJaggedTensor) -> None:
        """Put in ``ctx`` what the inner module's output dist reads of this rank's preprocessed batch."""

    def _dedup(self, ctx: _Ctx, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The preprocessed batch the input dist sends (the MC-EC's index dedup: :mod:`tritonrec.dist.mc_dedup`);
        unchanged by default."""
        return features

    @abc.abstractmethod
    def _record_sharding_input(
        self, sharding: EmbeddingSharding, ctx: ShardingContext, selected: KeyedJaggedTensor
    ) -> bool:
        """Put in ``ctx`` what the sharding's output dist reads of its selected features; return whether the
        unbucketize permutation (rows back in input order) is needed."""

    def input_dist(self, ctx: _Ctx, features: KeyedJaggedTensor) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        inner = self._embedding_module
        shardings = list(inner._shardings)
        # a rank rejecting its batch joins the checks the others' all-to-alls run
        with input_dist_checks(shardings, f"{type(self).__name__}.input_dist"):
            if not isinstance(features, KeyedJaggedTensor):
                raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
            index = features.index_per_key()
            missing = [f for f in inner._features if f not in index]
            if missing:
                raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
            self._check_input(features)
            if features.variable_stride_per_key():
                self._check_variable_batch(features)
            ctx.inverse_indices = features.inverse_indices_or_none()  # read before the select: a permute drops them
            with torch.no_grad():
                selected = select_features(features, inner._features, self._select_cache)
                features = self._managed_collision_collection.preprocess(selected)
            ctx.mc_features = features
            self._record_input(ctx, features)
            features = self._dedup(ctx, features)
            ctx.sharding_contexts = [ShardingContext() for _ in shardings]
            for context in ctx.sharding_contexts:  # a VBE output is expanded with them (keyed by feature)
                context.extra["inverse_indices"] = ctx.inverse_indices
            return InputDistAwaitable(
                [self._rw_input_dist(s, features, c) for s, c in zip(shardings, ctx.sharding_contexts, strict=True)]
            )

    def _rw_input_dist(
        self, sharding: EmbeddingSharding, features: KeyedJaggedTensor, ctx: ShardingContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """The row-wise sharding's input dist (:class:`~tritonrec.dist.sharding.rw.RwSharding`), bucketing by raw-id
        range: ids keep their value up to the rank's block start (:meth:`ShardedManagedCollisionCollection.remap` adds
        it back)."""
        names = sharding.rank_features(sharding.rank)
        selected = sharding.select(features, names)
        ctx.variable_batch = selected.variable_stride_per_key()
        ctx.lengths = selected.lengths()  # this rank's lengths: the sequence output's, the bag MEAN divisor
        ctx.batch_size_per_feature_pre_a2a = selected.stride_per_key()
        keep_permute = self._record_sharding_input(sharding, ctx, selected)
        mcc = self._managed_collision_collection
        routes = mcc.routes(names)
        if routes is None:
            bucketized, ctx.unbucketize_permute = bucketize(
                selected, mcc.block_sizes(names), sharding.world_size, keep_permute, sharding.lookup.backend
            )
        else:  # a hash ZCH table: ids go to the rank owning their bucket (torchrec's total_num_buckets bucketize)
            ranks, sent = destinations(selected, routes)
            bucketized, permute = bucketize_by_rank(selected, ranks, sent, sharding.world_size)
            ctx.unbucketize_permute = permute if keep_permute else None
            if ctx.variable_batch:  # its bags are rank-major, then the input's: give each key its own batch size
                per_key = [[s] for s in selected.stride_per_key()] * sharding.world_size
                bucketized = KeyedJaggedTensor(
                    bucketized.keys(),
                    bucketized.values(),
                    bucketized.weights_or_none(),
                    lengths=bucketized.lengths(),
                    stride_per_key_per_rank=per_key,
                )
        return sharding.all_to_all(bucketized, [len(names)] * sharding.world_size, ctx)

    def _remap(self, ctx: _Ctx, sharding: Any, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        remapped = self._managed_collision_collection.remap(features)
        if self._return_remapped_features:  # the rows go back to the samples' ranks
            (index,) = [i for i, s in enumerate(self._embedding_module._shardings) if s is sharding]
            context = ctx.sharding_contexts[index]
            work = self._managed_collision_collection.return_dist(remapped, context, sharding.input_dist_pg)
            ctx.remapped_returns.append((sharding.rank_features(sharding.rank), context, work))
        # as torchrec's sharded module: the rows handed to new ids are reset before this batch's lookup reads them
        evictions = self._managed_collision_collection.evict()
        lookups = [s.lookup for s in self._embedding_module._shardings]
        reset_evicted_rows(lookups, evictions, self._allow_in_place_embed_weight_update)
        ctx.evictions_per_table.update(evictions)
        return remapped

    def compute(self, ctx: _Ctx, dist_input: list[KeyedJaggedTensor]) -> _DistOut:
        return self._embedding_module.compute(ctx, dist_input)

    def output_dist(
        self, ctx: _Ctx, output: _DistOut
    ) -> tuple[LazyAwaitable[_Embeddings], LazyAwaitable[KeyedJaggedTensor | None]]:
        return self._embedding_module.output_dist(ctx, output), self._remapped_features(ctx)

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: _Ctx, input: list[KeyedJaggedTensor]
    ) -> tuple[LazyAwaitable[_Embeddings], LazyAwaitable[KeyedJaggedTensor | None]]:
        return self._embedding_module.compute_and_output_dist(ctx, input), self._remapped_features(ctx)

    def _remapped_features(self, ctx: _Ctx) -> LazyAwaitable[KeyedJaggedTensor | None]:
        if not self._return_remapped_features:
            return LazyNoWait(None)
        keys = self._managed_collision_collection._output_features
        return RemappedFeaturesAwaitable(ctx.mc_features, keys, ctx.remapped_returns)  # type: ignore[arg-type]

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer:
        return self._embedding_module.fused_optimizer


_Module = TypeVar("_Module", bound=nn.Module)


class ManagedCollisionSharder(BaseEmbeddingSharder[_Module]):
    """Shards a managed-collision EC / EBC row-wise (the only sharding type it offers, as torchrec's) into
    ``_sharded_type``, with the inner module's compute kernels and fused optimizer options.

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (the output dist's wire).
    """

    _sharded_type: ClassVar[type[ShardedManagedCollisionModule]]

    def shard(
        self,
        module: _Module,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedManagedCollisionModule:
        return self._sharded_type(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, module_fqn
        )

    @property
    def module_type(self) -> type[_Module]:
        return self._sharded_type._unsharded_type

    def shardable_parameters(self, module: _Module) -> dict[str, nn.Parameter]:
        if not isinstance(module, self.module_type):
            raise TypeError(f"module must be a {self.module_type.__name__}, got {type(module).__name__}")
        return self._table_weights(module._embedding_module)

    @abc.abstractmethod
    def _table_weights(self, module: Any) -> dict[str, nn.Parameter]:
        """Table name -> weight of the unsharded module's inner embedding module."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = ["ManagedCollisionContext", "ManagedCollisionSharder", "ShardedManagedCollisionModule"]
