"""``ShardedQuantEmbeddingBagCollection`` and ``QuantEmbeddingBagCollectionSharder``: INT8 / INT4 / INT2 (row-wise)
and FP16 / FP32 tables sharded over the devices of one process, for inference (torchrec's design:
``ShardingEnv.from_local(world_size, 0)``, ``KJTOneToAll`` in, ``EmbeddingsAllToOne`` / ``EmbeddingsAllToOneReduce``
out; no autograd).

Sharding types: table-wise, row-wise (on CPU too) and column-wise. A shard keeps its rows' codes and their fp16
scale and bias exactly as the unsharded module quantized them (a column block reuses its row's scale and bias), so
every shard dequantizes to the unsharded module's values: table- and column-wise outputs are bit-identical to it,
row-wise ones equal up to the order of the partial sums. INT4 / INT2 column blocks must start on a multiple of 2 / 4
columns (the codes of a byte stay together).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.all_to_one import EmbeddingsAllToOne, EmbeddingsAllToOneReduce
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, NoWait
from tritonrec.dist.dist_data import KJTOneToAll, rank_device
from tritonrec.dist.embeddingbag import _column_order, check_index_bounds, feature_row_limits
from tritonrec.dist.quant_state import QuantShardView, check_quant_plan, load_quant_tables, table_state
from tritonrec.dist.sharding.common import (
    LocalShard,
    ShardedTable,
    mean_divisor,
    select_features,
    sharded_tables,
)
from tritonrec.dist.sharding.rw import bucketize, row_boundaries
from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    NullShardedModuleContext,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    PoolingMode,
    QuantizedTables,
    TableBatchedLayout,
    TableSpec,
    quantized_pooled_lookup,
)
from tritonrec.kernels.embedding.quantized import has_scale_bias
from tritonrec.modules.embedding_configs import QUANT_BITS
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection
from tritonrec.modules.quant_state import BUFFER_NAMES

QUANT_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value]


def _shard_tables(
    shards: list[LocalShard], source: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bits: int, device: Any
) -> QuantizedTables:
    """The shards' codes, scale and bias cut from the unsharded module's (no re-quantization)."""
    specs = [TableSpec(s.spec.rows, s.spec.cols, s.pooling, s.table.name) for s in shards]
    layout = TableBatchedLayout(
        specs, [t for t, s in enumerate(shards) for _ in s.features], [n for s in shards for n in s.embedding_names]
    )
    codes, scales, biases = [], [], []
    for shard in shards:
        spec = shard.spec
        table_codes, scale, bias = source[shard.table.name]
        rows = slice(spec.row_offset, spec.row_offset + spec.rows)
        if spec.col_offset * bits % 8:
            per_byte = 8 // bits
            raise ValueError(
                f"table {shard.table.name!r}: an INT{bits} column block must start on a multiple of {per_byte} "
                f"columns ({per_byte} codes share a byte), got a block at column {spec.col_offset}"
            )
        first = spec.col_offset * bits // 8
        width = (spec.cols * bits + 7) // 8
        codes.append(table_codes[rows, first : first + width].reshape(-1))
        if has_scale_bias(bits):
            scales.append(scale.reshape(-1)[rows])  # the buffers are [rows, 1] (torchrec's shape)
            biases.append(bias.reshape(-1)[rows])
    empty = torch.zeros(0, dtype=torch.float16)  # FP16 / FP32 tables have no scale / bias
    return QuantizedTables(
        layout,
        bits,
        torch.cat(codes).to(device),
        torch.cat(scales or [empty]).to(device),
        torch.cat(biases or [empty]).to(device),
    )


class _QuantSharding:
    """One sharding type's shards over the devices, its input split and its output merge."""

    def __init__(
        self,
        kind: str,
        tables: list[ShardedTable],
        world_size: int,
        device: torch.device,
        source: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        bounds_check: BoundsCheckMode,
        backend: str,
    ) -> None:
        self.kind, self.world_size, self.device = kind, world_size, device
        self.bounds_check, self.backend = bounds_check, backend
        row_wise = kind == ShardingType.ROW_WISE.value
        bits_of = {t.name: QUANT_BITS[t.config.data_type] for t in tables}
        # per device: its shards, wider data types first (one lookup per data type, features contiguous)
        self.shards_per_device: list[list[LocalShard]] = []
        for r in range(world_size):
            local = []
            for table in tables:
                for k, spec in enumerate(table.shards):
                    if spec.rank == r:
                        pooling = PoolingMode.SUM if row_wise and table.is_mean else table.pooling
                        local.append(LocalShard(table, k, spec, pooling, tuple(table.config.feature_names)))
            self.shards_per_device.append(sorted(local, key=lambda s: -bits_of[s.table.name]))
        self.groups: list[list[tuple[int, int, QuantizedTables]]] = []  # per device: (first, end feature, tables)
        self.views: dict[str, list[tuple[int, QuantShardView]]] = {}  # table -> (shard index, its storage views)
        for r, shards in enumerate(self.shards_per_device):
            groups, start = [], 0
            for bits in sorted({bits_of[s.table.name] for s in shards}, reverse=True):
                mine = [s for s in shards if bits_of[s.table.name] == bits]
                count = sum(len(s.features) for s in mine)
                quantized = _shard_tables(mine, source, bits, rank_device(device.type, r))
                groups.append((start, start + count, quantized))
                for t, shard in enumerate(mine):
                    view = QuantShardView.of(quantized, t, shard.spec)
                    self.views.setdefault(shard.table.name, []).append((shard.shard_index, view))
                start += count
            self.groups.append(groups)
        self.features = [[f for s in shards for f in s.features] for shards in self.shards_per_device]
        self.row_wise = row_wise
        if row_wise:  # every device reads every feature, in the same order
            first = self.shards_per_device[0]
            self.send = self.features[0]
            self.block_sizes = [max(x.rows for x in s.table.shards) for s in first for _ in s.features]
            bounds = row_boundaries(first, world_size)  # uneven row blocks (sizes_placement): bucketize by these
            self.boundaries = None if bounds is None else torch.tensor(bounds, dtype=torch.int64, device=device)
            self.is_mean = [s.table.is_mean for s in first for _ in s.features]
            self.dims = [s.spec.cols for s in first for _ in s.features]
            self.splitter = KJTOneToAll([len(self.send)] * world_size, world_size, device)
            self.merge: nn.Module = EmbeddingsAllToOneReduce(device, world_size)
            self.columns = [(n, 0, s.spec.cols) for s in first for n in s.embedding_names]
        else:
            self.send = [f for per_device in self.features for f in per_device]
            self.splitter = KJTOneToAll([len(f) for f in self.features], world_size, device)
            self.merge = EmbeddingsAllToOne(device, world_size, cat_dim=1)
            self.columns = [
                (n, s.spec.col_offset, s.spec.cols)
                for shards in self.shards_per_device
                for s in shards
                for n in s.embedding_names
            ]
        self._cache: dict[Any, list[int]] = {}

    def split(self, features: KeyedJaggedTensor) -> tuple[list[KeyedJaggedTensor], torch.Tensor | None]:
        selected = select_features(features, self.send, self._cache)
        if not self.row_wise:
            return self.splitter(selected), None
        bucketized, _ = bucketize(selected, self.block_sizes, self.world_size, False, self.backend, self.boundaries)
        return self.splitter(bucketized), selected.lengths()

    def lookup(self, r: int, features: KeyedJaggedTensor) -> torch.Tensor:
        batch = features.stride()
        outputs = []
        offsets, value_offsets, weights = features.offsets(), features.offset_per_key(), features.weights_or_none()
        for a, b, tables in self.groups[r]:
            if b == a:
                continue
            group_offsets = offsets[a * batch : b * batch + 1]
            v0, v1 = value_offsets[a], value_offsets[b]
            outputs.append(
                quantized_pooled_lookup(
                    tables,
                    features.values()[v0:v1],
                    group_offsets - group_offsets[0],
                    None if weights is None else weights[v0:v1],
                    bounds_check=self.bounds_check,
                    backend=self.backend,  # type: ignore[arg-type]
                )
            )
        if not outputs:
            return torch.zeros(batch, 0, device=features.device())
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def merge_outputs(self, outputs: list[torch.Tensor], lengths: torch.Tensor | None) -> torch.Tensor:
        merged = self.merge(outputs)
        if self.row_wise and any(self.is_mean):
            merged = merged / mean_divisor(lengths.view(len(self.send), -1), self.dims, self.is_mean)  # type: ignore[union-attr]
        return merged


class ShardedQuantEmbeddingBagCollection(ShardedModule[Any, Any, KeyedTensor, NullShardedModuleContext]):
    """Sharded :class:`QuantEmbeddingBagCollection` over the devices of one process (see module docstring).

    Args:
        module: the quantized EBC.
        table_name_to_parameter_sharding: its plan (table-wise, row-wise or column-wise; compute kernel ``quant``).
        env: ``ShardingEnv.from_local(world_size, 0)``: ``world_size`` devices of ``device``'s type.
        device: where inputs arrive and outputs are merged (``cpu``: every "device" is the CPU).
    """

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, QuantEmbeddingBagCollection):
            raise TypeError(f"module must be a QuantEmbeddingBagCollection, got {type(module).__name__}")
        if not isinstance(env, ShardingEnv) or env.process_group is not None:
            raise ValueError("ShardedQuantEmbeddingBagCollection shards over one process's devices: pass "
                             "env=ShardingEnv.from_local(world_size, 0)")  # fmt: skip
        check_quant_plan(table_name_to_parameter_sharding, QUANT_SHARDING_TYPES, "tables")
        # the module's own device: a QuantEmbeddingBagCollection has no ``device`` attribute, its buffers say where
        self._device = (
            torch.device(device)
            if device is not None
            else next((b.device for b in module.buffers()), torch.device("cpu"))
        )
        configs = module.embedding_bag_configs()
        tables = sharded_tables(configs, table_name_to_parameter_sharding, env.world_size)
        source = {
            c.name: tuple(getattr(module.embedding_bags[c.name], name, None) for name in BUFFER_NAMES) for c in configs
        }
        by_type: dict[str, list[ShardedTable]] = {}
        for table in tables:
            by_type.setdefault(table.sharding_type, []).append(table)
        self._shardings = [
            _QuantSharding(kind, group, env.world_size, self._device, source, module.bounds_check, module.backend)
            for kind, group in by_type.items()
        ]
        self._is_weighted = module.is_weighted()
        self._configs = configs
        self._names = [n for t in tables for n in t.embedding_names]  # output keys, as the unsharded module's
        dims = {n: t.config.embedding_dim for t in tables for n in t.embedding_names}
        self._dims = [dims[n] for n in self._names]
        order = _column_order([c for s in self._shardings for c in s.columns], self._names, dims)
        self._column_order = None if order is None else torch.tensor(order, device=self._device)
        self._limits = feature_row_limits(configs)
        self._bounds_check = module.bounds_check
        self._tables = tables
        self._output_dtype = module.output_dtype()

    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(self, ctx: NullShardedModuleContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError(f"{type(self).__name__} is weighted (is_weighted=True) but features has no weights")
        if self._bounds_check == BoundsCheckMode.FATAL:
            check_index_bounds(features, self._limits)
        return NoWait(NoWait([s.split(features) for s in self._shardings]))

    def compute(self, ctx: NullShardedModuleContext, dist_input: Any) -> Any:
        with torch.no_grad():
            return [
                ([s.lookup(r, kjt) for r, kjt in enumerate(parts)], lengths)
                for s, (parts, lengths) in zip(self._shardings, dist_input, strict=True)
            ]

    def output_dist(self, ctx: NullShardedModuleContext, output: Any) -> LazyAwaitable[KeyedTensor]:
        merged = [s.merge_outputs(outs, lengths) for s, (outs, lengths) in zip(self._shardings, output, strict=True)]
        values = merged[0] if len(merged) == 1 else torch.cat(merged, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order)
        values = values.to(self._output_dtype)
        return _Ready(KeyedTensor(keys=self._names, length_per_key=self._dims, values=values))

    def embedding_bag_configs(self) -> list:
        return self._configs

    def output_dtype(self) -> torch.dtype:
        """The pooled output's dtype, the unsharded module's."""
        return self._output_dtype

    def copy(self, device: torch.device) -> ShardedQuantEmbeddingBagCollection:
        """``self``, as torchrec's sharded modules (``ModuleNoCopyMixin``): its shards already sit on their devices."""
        return self

    def _table_views(self) -> list[tuple[ShardedTable, list[QuantShardView], int]]:
        """Each table with its shards' storage views (shard order) and its bit width."""
        views = {name: v for s in self._shardings for name, v in s.views.items()}
        return [
            (t, [view for _, view in sorted(views[t.name], key=lambda kv: kv[0])], QUANT_BITS[t.config.data_type])
            for t in self._tables
        ]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """torchrec's layout (:mod:`tritonrec.dist.quant_state`): live views of the shards."""
        for table, views, bits in self._table_views():
            for name, value in table_state(table, views, bits).items():
                destination[f"{prefix}embedding_bags.{table.name}.{name}"] = value

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Checks every table's entries first (``ValueError`` naming the key), then copies into the shards."""
        load_quant_tables(
            state_dict, prefix, "embedding_bags", self._table_views(), strict, missing_keys, unexpected_keys
        )


class _Ready(LazyAwaitable[KeyedTensor]):
    def __init__(self, value: KeyedTensor) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> KeyedTensor:
        return self._value


class QuantEmbeddingBagCollectionSharder(ModuleSharder[QuantEmbeddingBagCollection]):
    """Shards :class:`QuantEmbeddingBagCollection` table-wise, row-wise or column-wise over one process's devices
    (``ShardingEnv.from_local``) or over the ranks of a process group."""

    def shard(
        self,
        module: QuantEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule:
        """``env`` with a process group: :class:`~tritonrec.dist.quant_embeddingbag_pg.
        ShardedQuantEmbeddingBagCollectionPG` (one batch per rank); ``from_local``: the single-process form."""
        if isinstance(env, ShardingEnv) and env.process_group is not None:
            from tritonrec.dist.quant_embeddingbag_pg import ShardedQuantEmbeddingBagCollectionPG  # imports this file

            return ShardedQuantEmbeddingBagCollectionPG(module, params, env, device, self.qcomm_codecs_registry)
        return ShardedQuantEmbeddingBagCollection(module, params, env, device)

    @property
    def module_type(self) -> type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection

    def shardable_parameters(self, module: QuantEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """Table -> a ``[rows, dim]`` meta tensor (the codes are bytes; plans count columns)."""
        return {
            c.name: nn.Parameter(torch.empty(c.num_embeddings, c.embedding_dim, device="meta"), requires_grad=False)
            for c in module.embedding_bag_configs()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(QUANT_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.QUANT.value]


__all__ = ["QuantEmbeddingBagCollectionSharder", "ShardedQuantEmbeddingBagCollection"]
