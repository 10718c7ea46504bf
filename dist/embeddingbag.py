"""``ShardedEmbeddingBagCollection`` and ``EmbeddingBagCollectionSharder`` (torchrec's names and semantics).

A sharded EBC takes this rank's batch (a KJT) and returns this rank's pooled embeddings ``KeyedTensor [B_me, sum(D)]``
in the unsharded module's key order, equal to what the unsharded module gives for those samples. Inside, each
(sharding type, compute kernel) of the plan is one sharding (:mod:`tritonrec.dist.sharding`) whose input dist,
lookup and output dist run as the three :class:`~tritonrec.dist.types.ShardedModule` steps; the outputs are then
put back in key order (column shards in column order).

Example (2 ranks, each a process in a gloo group)::

    ebc = EmbeddingBagCollection(tables, device="meta")
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "lr": 0.1})
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": row_wise()}, sharder, 2, 2, "cpu")
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    pooled = sharded(kjt).wait()   # KeyedTensor; loss.backward() updates the shards in place
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
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
from tritonrec.kernels.checks import merge_spans, spans_out_of_range
from tritonrec.kernels.embedding import BoundsCheckMode
from tritonrec.modules.embedding_modules import EmbeddingBagCollection


class EmbeddingBagCollectionContext(Multistreamable):
    """Per batch: each sharding's context, and the input's variable-batch layout."""

    def __init__(self) -> None:
        self.sharding_contexts: list[ShardingContext] = []
        self.inverse_indices: tuple[list[str], torch.Tensor] | None = None
        self.variable_batch_per_feature = False

    def record_stream(self, stream: torch.Stream) -> None:
        for context in self.sharding_contexts:
            context.record_stream(stream)


class EmbeddingBagCollectionAwaitable(LazyAwaitable[KeyedTensor]):
    """Every sharding's output dist; ``wait()`` concatenates them and puts the columns in key order."""

    def __init__(
        self,
        awaitables: list[Awaitable[torch.Tensor]],
        column_order: torch.Tensor | None,
        keys: list[str],
        dims: list[int],
    ) -> None:
        super().__init__()
        self._awaitables = awaitables
        self._column_order = column_order
        self._keys = keys
        self._dims = dims

    def _wait_impl(self) -> KeyedTensor:
        outputs = [a.wait() for a in self._awaitables]
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=values)


def _column_order(blocks: list[tuple[str, int, int]], names: list[str], dims: dict[str, int]) -> list[int] | None:
    """Indices of the concatenated shardings' columns in key order (each embedding's blocks in column order)."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    position = 0
    for feature, col_offset, width in blocks:
        spans.setdefault(feature, []).append((col_offset, position, width))
        position += width
    order = []
    for name in names:
        covered = 0
        for col_offset, start, width in sorted(spans[name]):
            if col_offset != covered:
                raise ValueError(f"feature {name!r}: column shards leave a gap or overlap at column {covered}")
            order.extend(range(start, start + width))
            covered += width
        if covered != dims[name]:
            raise ValueError(f"feature {name!r}: column shards cover {covered} of {dims[name]} columns")
    return None if order == list(range(len(order))) else order


class ShardedEmbeddingBagCollection(
    ShardedTablesMixin,
    ShardedModule[list[KeyedJaggedTensor], list[torch.Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Model-parallel :class:`EmbeddingBagCollection` (see module docstring).

    Args:
        module: the unsharded EBC (plain, weighted, or ``FusedEmbeddingBagCollection``); may live on ``meta``.
        table_name_to_parameter_sharding: the module's plan (table -> ParameterSharding).
        env: the process group.
        fused_params: optimizer and lookup options (:mod:`tritonrec.dist.fused_params`).
        device: where this rank's shards live (default: the module's device, or CPU/CUDA for a meta module).
        qcomm_codecs_registry: comm op name -> codecs on the output dists' wire.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        ShardedModule.__init__(self, qcomm_codecs_registry)
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"module must be an EmbeddingBagCollection, got {type(module).__name__}")
        configs = module.embedding_bag_configs()
        self._is_weighted = module.is_weighted()
        self._module_fqn = module_fqn
        weights = {c.name: module.embedding_bags[c.name].weight for c in configs}
        self._build(
            module, configs, weights, table_name_to_parameter_sharding, env, fused_params, device,
            qcomm_codecs_registry, pooled=True, container="embedding_bags",
        )  # fmt: skip
        # output keys are embedding names (``feature@table`` for a feature several tables read), as unsharded
        self._embedding_names = [n for t in self._tables for n in t.embedding_names]
        dims = {n: t.config.embedding_dim for t in self._tables for n in t.embedding_names}
        self._dims = [dims[n] for n in self._embedding_names]
        blocks = [b for s in self._shardings for b in s.output_columns.blocks]
        order = _column_order(blocks, self._embedding_names, dims)
        self._column_order = None if order is None else torch.tensor(order, device=self._device)
        self._features = list(dict.fromkeys(f for c in self._configs for f in c.feature_names))
        # FATAL bounds check on the global ids before the input dist: row-wise bucketizing would spread an id past its
        # table round-robin into a shard (where it may look valid), and the error names the global id
        self._limits = feature_row_limits(self._configs)
        # set by a wrapper (feature processors) to transform each sharding's distributed KJT before its lookup
        self.input_transform: Callable[[Any, Any, KeyedJaggedTensor], KeyedJaggedTensor] | None = None

    # ---------------------------------------------------------------------------------------------------- steps
    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext()

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        # a rank rejecting its batch joins the checks the others' all-to-alls run
        with input_dist_checks(list(self._shardings), f"{type(self).__name__}.input_dist"):
            self._check_features(features)
            ctx.variable_batch_per_feature = features.variable_stride_per_key()
            ctx.inverse_indices = features.inverse_indices_or_none()
            ctx.sharding_contexts = [ShardingContext() for _ in self._shardings]
            for context in ctx.sharding_contexts:
                context.extra["inverse_indices"] = ctx.inverse_indices
            return run_input_dists(list(self._shardings), features, ctx.sharding_contexts)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
        shardings, contexts = self._shardings, ctx.sharding_contexts
        return [
            s.compute(self._transform(ctx, s, kjt), c)
            for s, kjt, c in zip(shardings, dist_input, contexts, strict=True)
        ]

    def _transform(self, ctx: EmbeddingBagCollectionContext, sharding: Any, features: KeyedJaggedTensor) -> Any:
        """What a sharding's lookup receives: the distributed KJT, or (feature-processed) its processed form."""
        return features if self.input_transform is None else self.input_transform(ctx, sharding, features)

    def output_dist(self, ctx: EmbeddingBagCollectionContext, output: list[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        awaitables = [
            s.output_dist(o, c) for s, o, c in zip(self._shardings, output, ctx.sharding_contexts, strict=True)
        ]
        return EmbeddingBagCollectionAwaitable(awaitables, self._column_order, self._embedding_names, self._dims)

    def compute_and_output_dist(
        self, ctx: EmbeddingBagCollectionContext, input: list[KeyedJaggedTensor]
    ) -> LazyAwaitable[KeyedTensor]:
        awaitables = []
        for sharding, kjt, context in zip(self._shardings, input, ctx.sharding_contexts, strict=True):
            local = sharding.compute(self._transform(ctx, sharding, kjt), context)
            awaitables.append(sharding.output_dist(local, context))
        return EmbeddingBagCollectionAwaitable(awaitables, self._column_order, self._embedding_names, self._dims)

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        index = features.index_per_key()
        missing = [f for f in self._features if f not in index]
        if missing:
            raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError(f"{type(self).__name__} is weighted (is_weighted=True) but features has no weights")
        if features.variable_stride_per_key():
            if features.inverse_indices_or_none() is None:
                raise ValueError("a variable batch per feature (VBE) needs the KJT's inverse_indices, got None")
            for sharding in self._shardings:
                if not sharding.supports_variable_batch:
                    raise ValueError(f"{sharding.sharding_type} sharding does not take a variable batch per feature")
        if self._options.bounds_check == BoundsCheckMode.FATAL and self._limits:
            check_index_bounds(features, self._limits)

    # -------------------------------------------------------------------------------------------------- module
    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._after_apply()
        return self

    def embedding_bag_configs(self) -> list:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def shardings(self) -> list:
        return list(self._shardings)


def feature_row_limits(configs: list) -> dict[str, int]:
    """Feature -> the rows its ids must stay below: the smallest table reading it (a shared feature's ids index
    every table that reads it)."""
    limits: dict[str, int] = {}
    for config in configs:
        for feature in config.feature_names:
            limits[feature] = min(limits.get(feature, config.num_embeddings), config.num_embeddings)
    return limits


def check_index_bounds(features: KeyedJaggedTensor, limits: dict[str, int]) -> None:
    """FATAL bounds check on the global indices of the features in ``limits``, before they are distributed (one
    host sync). Consecutive checked features with one row count form a span of ``values``, checked by one
    ``aminmax`` of a view (no copy, no per-value limit tensor); only a failing span is searched for the culprit."""
    keys = features.keys()
    starts = features.offset_per_key()
    per_key = zip(keys, starts[:-1], starts[1:], strict=True)
    spans = merge_spans([(start, end, limits[key]) for key, start, end in per_key if key in limits])
    values = features.values()
    failing = spans_out_of_range(values, spans)
    if not failing:
        return
    start, end, rows = spans[failing[0]]
    span = values[start:end]
    where = start + int(((span < 0) | (span >= rows)).nonzero()[0].item())
    key = keys[next(i for i, key_end in enumerate(starts[1:]) if where < key_end)]
    raise ValueError(
        f"index {int(values[where])} of feature {key!r} is outside its table's [0, {limits[key]}) rows "
        "(bounds_check_mode=FATAL)"
    )


class EmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Shards :class:`EmbeddingBagCollection` (and its fused / weighted forms) with every sharding type, on CPU and
    CUDA alike (torchrec refuses row-wise and table-row-wise on CPU; we run them).

    Args:
        fused_params: optimizer and lookup options for the fused kernel (:mod:`tritonrec.dist.fused_params`).
        qcomm_codecs_registry: comm op name -> codecs (``get_qcomm_codecs_registry(QCommsConfig(...))``).
    """

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry, module_fqn
        )

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def shardable_parameters(self, module: EmbeddingBagCollection) -> dict[str, nn.Parameter]:
        return {config.name: module.embedding_bags[config.name].weight for config in module.embedding_bag_configs()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t.value for t in ShardingType]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


__all__ = [
    "EmbeddingBagCollectionAwaitable",
    "EmbeddingBagCollectionContext",
    "EmbeddingBagCollectionSharder",
    "ShardedEmbeddingBagCollection",
    "check_index_bounds",
    "feature_row_limits",
]
