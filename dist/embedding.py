"""``ShardedEmbeddingCollection`` and ``EmbeddingCollectionSharder``: sequence embeddings on sharded tables
(torchrec's names; data-parallel, table-wise, column-wise, table-column-wise and row-wise, row-wise on CPU too).

A sharded EC takes this rank's KJT and returns ``{embedding name: JaggedTensor}`` with one ``[D]`` row per value, in
the KJT's order, equal to the unsharded module's (a feature several tables read is ``feature@table`` in each). The
rows of a table's features come back from the ranks that looked them up by the sequence all-to-all (row-wise: then
put back in input order with the bucketizer's permutation); column blocks are concatenated in column order.

``use_index_dedup``: each feature's ids are made unique before the input dist (fewer ids on the wire and fewer rows
looked up), and the rows are expanded back after the output dist; gradients of repeated ids add up as without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.embeddingbag import check_index_bounds, feature_row_limits
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharded_tables import ShardedTablesMixin, input_dist_checks, run_input_dists
from tritonrec.dist.sharding.common import ShardingContext
from tritonrec.dist.types import (
    BaseEmbeddingSharder,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    FusedOptimizerModule,
    Multistreamable,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from tritonrec.kernels.embedding import BoundsCheckMode
from tritonrec.modules.embedding_modules import EmbeddingCollection

SEQUENCE_SHARDING_TYPES = [
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
]


class EmbeddingCollectionContext(Multistreamable):
    """Per batch: each sharding's context and, per feature, this rank's input lengths and values (and, with index
    dedup, the inverse of each feature's unique ids)."""

    def __init__(self) -> None:
        self.sharding_contexts: list[ShardingContext] = []
        self.input_features: dict[str, JaggedTensor] = {}
        self.inverse: dict[str, torch.Tensor] = {}

    def record_stream(self, stream: torch.Stream) -> None:
        for context in self.sharding_contexts:
            context.record_stream(stream)


class EmbeddingCollectionAwaitable(LazyAwaitable[dict[str, JaggedTensor]]):
    """Every sharding's output dist; ``wait()`` cuts the rows per feature and column block and assembles them."""

    def __init__(
        self,
        awaitables: list[Awaitable[torch.Tensor]],
        ctx: EmbeddingCollectionContext,
        names: list[str],
        need_indices: bool,
        sources: dict[str, str],
    ) -> None:
        super().__init__()
        self._awaitables = awaitables
        self._ctx = ctx
        self._names = names
        self._need_indices = need_indices
        self._sources = sources  # embedding name -> the feature (KJT key) it reads

    def _rows_by_name(self) -> dict[str, torch.Tensor]:
        """Every sharding's output rows, waited for, each embedding's column blocks joined: ``{name: [N, D]}``."""
        blocks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for awaitable, context in zip(self._awaitables, self._ctx.sharding_contexts, strict=True):
            rows = awaitable.wait()
            slots = context.extra["slots"]
            for (name, col_offset, _, _), piece in zip(slots, rows.split([n for *_, n in slots]), strict=True):
                blocks.setdefault(name, []).append((col_offset, piece))
        joined = {}
        for name, named_blocks in blocks.items():
            parts = [piece for _, piece in sorted(named_blocks, key=lambda b: b[0])]
            joined[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return joined

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        joined = self._rows_by_name()
        out = {}
        for name in self._names:
            rows = joined[name]
            feature = self._sources[name]
            if feature in self._ctx.inverse:
                rows = rows.index_select(0, self._ctx.inverse[feature])
            original = self._ctx.input_features[feature]
            out[name] = JaggedTensor(
                values=rows, lengths=original.lengths(), weights=original.values() if self._need_indices else None
            )
        return out


def dedup_indices(features: KeyedJaggedTensor, names: list[str]) -> tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]:
    """Each feature's unique ids (all in its first bag) and, per feature, the inverse that expands them back."""
    per_feature = features.to_dict()
    batch = features.stride()
    values, lengths, inverse = [], [], {}
    for name in names:
        unique, inverse[name] = torch.unique(per_feature[name].values(), return_inverse=True)
        bag_lengths = torch.zeros(batch, dtype=features.lengths().dtype, device=features.device())
        if batch:
            bag_lengths[0] = unique.numel()
        values.append(unique)
        lengths.append(bag_lengths)
    deduped = KeyedJaggedTensor(names, torch.cat(values), lengths=torch.cat(lengths), stride=batch)
    return deduped, inverse


def sequence_input_features(
    module: nn.Module,
    features: object,
    feature_names: list[str],
    limits: dict[str, int],
    bounds_check: BoundsCheckMode,
) -> dict[str, JaggedTensor]:
    """A sharded EC's checks of its input KJT (a KJT with every key in ``feature_names``, one batch size for all keys,
    ids within ``limits`` under ``FATAL``), then ``{feature: JaggedTensor}`` of those keys (what the output keeps
    for the lengths and, with ``need_indices``, the ids)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
    missing = [f for f in feature_names if f not in features.index_per_key()]
    if missing:
        raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
    if features.variable_stride_per_key():
        raise ValueError(f"{type(module).__name__} needs one batch size for all keys (no variable batch per feature)")
    if bounds_check == BoundsCheckMode.FATAL:
        check_index_bounds(features, limits)
    per_feature = features.to_dict()
    return {name: per_feature[name] for name in feature_names}


class ShardedEmbeddingCollection(
    ShardedTablesMixin,
    ShardedModule[list[KeyedJaggedTensor], list[Any], dict[str, JaggedTensor], EmbeddingCollectionContext],
    FusedOptimizerModule,
):
    """Model-parallel :class:`EmbeddingCollection` (see module docstring); arguments as
    :class:`~tritonrec.dist.embeddingbag.ShardedEmbeddingBagCollection`, plus ``use_index_dedup``."""

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        use_index_dedup: bool = False,
        module_fqn: str | None = None,
    ) -> None:
        ShardedModule.__init__(self, qcomm_codecs_registry)
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(f"module must be an EmbeddingCollection, got {type(module).__name__}")
        for name, sharding in table_name_to_parameter_sharding.items():
            if sharding.sharding_type not in SEQUENCE_SHARDING_TYPES:
                raise ValueError(
                    f"table {name!r}: {sharding.sharding_type} is not a sequence sharding type (supported: "
                    f"{SEQUENCE_SHARDING_TYPES})"
                )
        configs = module.embedding_configs()
        weights = {c.name: module.embeddings[c.name].weight for c in configs}
        self._build(
            module, configs, weights, table_name_to_parameter_sharding, env, fused_params, device,
            qcomm_codecs_registry, pooled=False, container="embeddings",
        )  # fmt: skip
        self._need_indices = module.need_indices()
        self._use_index_dedup = bool(use_index_dedup)
        self._embedding_names = [n for t in self._tables for n in t.embedding_names]
        self._sources = {
            n: f for t in self._tables for n, f in zip(t.embedding_names, t.config.feature_names, strict=True)
        }
        self._features = list(dict.fromkeys(self._sources.values()))  # each KJT key once
        self._limits = feature_row_limits(self._configs)
        # set by a wrapper (managed collision) to transform each sharding's distributed KJT before its lookup
        self.input_transform: Callable[[Any, Any, KeyedJaggedTensor], KeyedJaggedTensor] | None = None

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext()

    def input_dist(
        self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        # a rank rejecting its batch joins the checks the others' all-to-alls run
        with input_dist_checks(list(self._shardings), f"{type(self).__name__}.input_dist"):
            ctx.input_features = sequence_input_features(
                self, features, self._features, self._limits, self._options.bounds_check
            )
            if self._use_index_dedup:
                features, ctx.inverse = dedup_indices(features, self._features)
            ctx.sharding_contexts = [ShardingContext() for _ in self._shardings]
            return run_input_dists(list(self._shardings), features, ctx.sharding_contexts)

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: list[KeyedJaggedTensor]) -> list[Any]:
        shardings, contexts = self._shardings, ctx.sharding_contexts
        return [
            s.compute(self._transform(ctx, s, kjt), c)
            for s, kjt, c in zip(shardings, dist_input, contexts, strict=True)
        ]

    def _transform(
        self, ctx: EmbeddingCollectionContext, sharding: Any, features: KeyedJaggedTensor
    ) -> KeyedJaggedTensor:
        """What a sharding's lookup receives: the distributed KJT, or (``input_transform`` set) its transform."""
        return features if self.input_transform is None else self.input_transform(ctx, sharding, features)

    def output_dist(self, ctx: EmbeddingCollectionContext, output: list[Any]) -> LazyAwaitable[dict[str, JaggedTensor]]:
        contexts = ctx.sharding_contexts
        awaitables = [s.output_dist(o, c) for s, o, c in zip(self._shardings, output, contexts, strict=True)]
        return EmbeddingCollectionAwaitable(awaitables, ctx, self._embedding_names, self._need_indices, self._sources)

    def compute_and_output_dist(
        self, ctx: EmbeddingCollectionContext, input: list[KeyedJaggedTensor]
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        awaitables = []
        for sharding, kjt, context in zip(self._shardings, input, ctx.sharding_contexts, strict=True):
            local = sharding.compute(self._transform(ctx, sharding, kjt), context)
            awaitables.append(sharding.output_dist(local, context))
        return EmbeddingCollectionAwaitable(awaitables, ctx, self._embedding_names, self._need_indices, self._sources)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._after_apply()
        return self

    def embedding_configs(self) -> list:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    @property
    def shardings(self) -> list:
        return list(self._shardings)


class EmbeddingCollectionSharder(BaseEmbeddingSharder[EmbeddingCollection]):
    """Shards :class:`EmbeddingCollection` (and ``FusedEmbeddingCollection``).

    Args:
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs.
        use_index_dedup: send each feature's unique ids only (see module docstring).
    """

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
        module: EmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, self._use_index_dedup,
            module_fqn,
        )  # fmt: skip

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    def shardable_parameters(self, module: EmbeddingCollection) -> dict[str, nn.Parameter]:
        return {config.name: module.embeddings[config.name].weight for config in module.embedding_configs()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SEQUENCE_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = [
    "EmbeddingCollectionAwaitable",
    "EmbeddingCollectionContext",
    "EmbeddingCollectionSharder",
    "ShardedEmbeddingCollection",
    "dedup_indices",
    "sequence_input_features",
]
