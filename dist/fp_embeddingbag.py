"""``ShardedFeatureProcessedEmbeddingBagCollection`` and its sharder: position-weighted features on sharded tables.

Each value's position in its bag is computed on the rank that owns the sample, before the input dist, and travels as
the KJT's weights (row-wise bucketizing keeps them with their values). The rank that looks a value up turns its
position into the learned position weight of its feature, so the weighted lookup sees exactly what the unsharded
module computes. The position weights are replicated on every rank; each rank's lookups produce part of their
gradient, and the parts are summed over the ranks inside the backward, so every replica takes the same step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from tritonrec.dist.grad_sync import all_reduced_params
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
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
from tritonrec.modules.feature_processor import (
    FeatureProcessedEmbeddingBagCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)


def _position_weights(processors: nn.Module, features: list[str]) -> dict[str, nn.Parameter]:
    """Feature -> its learned position weights ``[max_feature_length]`` (features without one weigh 1)."""
    if isinstance(processors, PositionWeightedModuleCollection):
        return {f: processors.position_weights[f] for f in features if f in processors.position_weights}
    if isinstance(processors, nn.ModuleDict) and all(
        isinstance(m, PositionWeightedModule) for m in processors.values()
    ):
        return {f: processors[f].position_weight for f in features}
    raise TypeError(
        "sharding supports PositionWeightedModule / PositionWeightedModuleCollection feature processors, got "
        f"{type(processors).__name__}"
    )


def positions_in_bags(features: KeyedJaggedTensor) -> torch.Tensor:
    """``[N]`` position of every value inside its bag."""
    offsets = features.offsets().long()
    lengths = offsets[1:] - offsets[:-1]
    n = features.values().numel()
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=n)
    return torch.arange(n, device=offsets.device) - starts


class _ProcessedContext(EmbeddingBagCollectionContext):
    """The EBC context plus this batch's (gradient-synchronised) position weights."""

    def __init__(self) -> None:
        super().__init__()
        self.position_weights: dict[str, torch.Tensor] = {}


class _WithPositionWeightGraph(LazyAwaitable[KeyedTensor]):
    """The EBC's output, tied (by a zero term) to the position weights so every rank runs their all-reduce."""

    def __init__(self, inner: LazyAwaitable[KeyedTensor], weights: list[torch.Tensor]) -> None:
        super().__init__()
        self._inner = inner
        # Built now, as the lookup reads the weights, not at wait(): a semi-sync pipeline waits for batch i + 1's
        # output after batch i's optimizer step has changed the weights in place, and autograd refuses a view of
        # them (the all-reduce's output) used after that.
        self._tie = torch.stack([w.sum() for w in weights]).sum() * 0.0 if weights else None

    def _wait_impl(self) -> KeyedTensor:
        kt = self._inner.wait()
        if self._tie is None:
            return kt
        return KeyedTensor(kt.keys(), kt.length_per_key(), kt.values() + self._tie)


class ShardedFeatureProcessedEmbeddingBagCollection(
    ShardedModule[list[KeyedJaggedTensor], list[torch.Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Model-parallel :class:`FeatureProcessedEmbeddingBagCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection`."""

    def __init__(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, FeatureProcessedEmbeddingBagCollection):
            raise TypeError(f"module must be a FeatureProcessedEmbeddingBagCollection, got {type(module).__name__}")
        self._embedding_bag_collection = ShardedEmbeddingBagCollection(
            module._embedding_bag_collection,
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry,
            module_fqn,
        )
        self._feature_processors = module._feature_processors
        self._feature_processors.to(self._embedding_bag_collection._device)
        self._names = module._feature_names
        self._pg = env.process_group
        self._embedding_bag_collection.input_transform = self._process

    def _weights(self) -> dict[str, nn.Parameter]:
        return _position_weights(self._feature_processors, self._names)

    def create_context(self) -> _ProcessedContext:
        return _ProcessedContext()

    def input_dist(self, ctx: _ProcessedContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        weights = self._weights()
        for key in features.keys():
            if key in weights:
                lengths = features[key].lengths()
                longest = int(lengths.max()) if lengths.numel() else 0
                if longest > weights[key].numel():
                    raise ValueError(
                        f"feature {key!r} has a bag of {longest} values, more than its max_feature_length "
                        f"{weights[key].numel()}"
                    )
        positioned = KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values(),
            weights=positions_in_bags(features).float(),
            lengths=features.lengths(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
            inverse_indices=features.inverse_indices_or_none(),
        )
        return self._embedding_bag_collection.input_dist(ctx, positioned)

    def _sync_position_weights(self, ctx: _ProcessedContext) -> None:
        """The position weights this batch's lookups use, with the all-reduce of their gradients in the backward.
        Taken when the batch is looked up, not at its input dist: a train pipeline starts batch ``i + 1``'s input
        dist before batch ``i``'s optimizer step changes the weights in place."""
        weights = self._weights()
        names = list(weights)
        synced = all_reduced_params([weights[n] for n in names], self._pg, average=False)  # type: ignore[arg-type]
        ctx.position_weights = dict(zip(names, synced, strict=True))

    def _process(self, ctx: _ProcessedContext, sharding: Any, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Positions (the distributed KJT's weights) -> each value's feature's position weight."""
        names = sharding.lookup.features
        if not names:
            return features
        weights = ctx.position_weights
        device = features.device()
        tables = [weights[n] if n in weights else torch.ones(1, device=device) for n in names]
        starts = torch.tensor([0, *torch.tensor([t.numel() for t in tables]).cumsum(0).tolist()[:-1]], device=device)
        has = torch.tensor([n in weights for n in names], device=device)
        counts = torch.tensor(features.length_per_key(), device=device)
        feature_of = torch.repeat_interleave(torch.arange(len(names), device=device), counts)
        positions = features.weights().long()
        index = starts[feature_of] + torch.where(has[feature_of], positions, torch.zeros_like(positions))
        processed = torch.cat(tables).index_select(0, index)
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values(),
            weights=processed,
            lengths=features.lengths(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
            stride=None if features.variable_stride_per_key() else features.stride(),
        )

    def compute(self, ctx: _ProcessedContext, dist_input: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
        self._sync_position_weights(ctx)
        return self._embedding_bag_collection.compute(ctx, dist_input)

    def output_dist(self, ctx: _ProcessedContext, output: list[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        inner = self._embedding_bag_collection.output_dist(ctx, output)
        return _WithPositionWeightGraph(inner, list(ctx.position_weights.values()))

    def compute_and_output_dist(
        self, ctx: _ProcessedContext, input: list[KeyedJaggedTensor]
    ) -> LazyAwaitable[KeyedTensor]:
        self._sync_position_weights(ctx)
        inner = self._embedding_bag_collection.compute_and_output_dist(ctx, input)
        return _WithPositionWeightGraph(inner, list(ctx.position_weights.values()))

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer:
        return self._embedding_bag_collection.fused_optimizer

    def is_weighted(self) -> bool:
        return True


class FeatureProcessedEmbeddingBagCollectionSharder(BaseEmbeddingSharder[FeatureProcessedEmbeddingBagCollection]):
    """Shards :class:`FeatureProcessedEmbeddingBagCollection` (every sharding type, as the EBC sharder)."""

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedFeatureProcessedEmbeddingBagCollection:
        return ShardedFeatureProcessedEmbeddingBagCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, module_fqn
        )

    @property
    def module_type(self) -> type[FeatureProcessedEmbeddingBagCollection]:
        return FeatureProcessedEmbeddingBagCollection

    def shardable_parameters(self, module: FeatureProcessedEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        ebc = module._embedding_bag_collection
        return {config.name: ebc.embedding_bags[config.name].weight for config in ebc.embedding_bag_configs()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in ShardingType]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = [
    "FeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedFeatureProcessedEmbeddingBagCollection",
    "positions_in_bags",
]
