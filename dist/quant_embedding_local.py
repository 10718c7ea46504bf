"""``ShardedQuantEmbeddingCollectionLocal``: the quantized
:class:`~tritonrec.modules.quant_embedding_collection.QuantEmbeddingCollection` sharded over the devices of one
process for inference (torchrec's design: ``ShardingEnv.from_local(world_size, 0)``, ``KJTOneToAll`` in, the rows
brought back with ``SeqEmbeddingsAllToOne``; no autograd). On CPU every "device" is the CPU.

Sharding types: table-wise, row-wise (even, or uneven with ``row_wise(sizes_placement=...)``) and column-wise; the
others are refused by name. Each device looks its shards up with
:class:`~tritonrec.dist.quant_embedding.QuantSequenceLookup` (the unsharded module's codes, scale and bias bytes, one
kernel launch per feature), so every feature's rows equal the unsharded module's bit for bit: row-wise rows are put
back in input order (the bucketizer's unbucketize permutation), column blocks are concatenated by column offset, and
the rows are cast to ``output_dtype`` once, as the unsharded module does. Unlike the process-group form, tables of one
sharding type may have different dims (nothing travels in one all-to-all). Output keys: the unsharded module's order.

State dict: the unsharded module's keys, in torchrec's quant layout (:mod:`tritonrec.dist.quant_state`, as
:class:`~tritonrec.dist.quant_embeddingbag.ShardedQuantEmbeddingBagCollection`): live views of the shards.
"""

from __future__ import annotations

from typing import Any

import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.all_to_one import SeqEmbeddingsAllToOne
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, NoWait
from tritonrec.dist.dist_data import KJTOneToAll, rank_device
from tritonrec.dist.embedding import EmbeddingCollectionContext, sequence_input_features
from tritonrec.dist.embeddingbag import feature_row_limits
from tritonrec.dist.quant_embedding import QUANT_SEQUENCE_SHARDING_TYPES, QuantSequenceLookup, Source
from tritonrec.dist.quant_state import QuantShardView, check_quant_plan, load_quant_tables, table_state
from tritonrec.dist.sharding.common import LocalShard, ShardedTable, select_features, sharded_tables
from tritonrec.dist.sharding.rw import bucketize, row_boundaries
from tritonrec.dist.types import (
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from tritonrec.kernels.embedding import BoundsCheckMode, PoolingMode
from tritonrec.modules.embedding_configs import QUANT_BITS
from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection
from tritonrec.modules.quant_state import BUFFER_NAMES

# per device: the rows of each of its lookup's features, ``[n, cols]`` fp32
DeviceRows = list[list[torch.Tensor]]


def _bring_back(rows: DeviceRows, merge: SeqEmbeddingsAllToOne) -> DeviceRows:
    """Every device's rows on the calling device: one copy per device (its rows flattened into one tensor)."""
    flat = [torch.cat([r.reshape(-1) for r in per_device]) if per_device else torch.zeros(0) for per_device in rows]
    moved = merge(flat)
    out = []
    for per_device, tensor in zip(rows, moved, strict=True):
        pieces = tensor.split([r.numel() for r in per_device]) if per_device else []
        out.append([p.view(r.shape) for p, r in zip(pieces, per_device, strict=True)])
    return out


class _LocalSequenceSharding:
    """One sharding type's tables over the devices: the KJT split, each device's quantized sequence lookup, and
    each embedding name's rows assembled on the calling device."""

    def __init__(
        self,
        kind: str,
        tables: list[ShardedTable],
        world_size: int,
        device: torch.device,
        source: Source,
        bounds_check: BoundsCheckMode,
        backend: Any,
    ) -> None:
        self.world_size, self.backend = world_size, backend
        self.row_wise = kind == ShardingType.ROW_WISE.value
        # per device: its shards, tables in plan order, a table's blocks in shard order
        self.shards_per_device = [
            [
                LocalShard(table, k, spec, PoolingMode.SUM, tuple(table.config.feature_names))
                for table in tables
                for k, spec in enumerate(table.shards)
                if spec.rank == r
            ]
            for r in range(world_size)
        ]
        self.lookups = [
            QuantSequenceLookup(shards, source, rank_device(device.type, r), bounds_check, backend)
            for r, shards in enumerate(self.shards_per_device)
        ]
        self.merge = SeqEmbeddingsAllToOne(device, world_size)
        self._cache: dict[Any, list[int]] = {}
        if self.row_wise:  # every device reads every feature of the group, in the same order
            first = self.shards_per_device[0]
            self.send = [f for s in first for f in s.features]
            self.names = [n for s in first for n in s.embedding_names]
            self.block_sizes = [max(x.rows for x in s.table.shards) for s in first for _ in s.features]
            bounds = row_boundaries(first, world_size)  # uneven row blocks (sizes_placement): bucketize by these
            self.boundaries = None if bounds is None else torch.tensor(bounds, dtype=torch.int64, device=device)
            self.splitter = KJTOneToAll([len(self.send)] * world_size, world_size, device)
        else:
            self.send = [f for shards in self.shards_per_device for s in shards for f in s.features]
            # per device, per lookup feature: (embedding name, the block's first column)
            self.blocks = [
                [(n, s.spec.col_offset) for s in shards for n in s.embedding_names] for shards in self.shards_per_device
            ]
            counts = [sum(len(s.features) for s in shards) for shards in self.shards_per_device]
            self.splitter = KJTOneToAll(counts, world_size, device)

    def views(self) -> list[tuple[LocalShard, QuantShardView]]:
        return [pair for lookup in self.lookups for pair in lookup.views]

    def split(self, features: KeyedJaggedTensor) -> tuple[list[KeyedJaggedTensor], Any]:
        """``features`` -> each device's KJT (row-wise: bucketized, with the unbucketize permutation and sizes)."""
        selected = select_features(features, self.send, self._cache)
        if not self.row_wise:
            return self.splitter(selected), None
        bucketized, permute = bucketize(
            selected, self.block_sizes, self.world_size, True, self.backend, self.boundaries
        )
        return self.splitter(bucketized), (permute, bucketized.length_per_key(), selected.length_per_key())

    def compute(self, parts: list[KeyedJaggedTensor]) -> DeviceRows:
        return [lookup.forward_sequence(kjt) for lookup, kjt in zip(self.lookups, parts, strict=True)]

    def assemble(self, rows: DeviceRows, meta: Any) -> dict[str, torch.Tensor]:
        """Each embedding name's rows ``[N_f, dim]`` fp32 on the calling device, in input order."""
        rows = _bring_back(rows, self.merge)
        if not self.row_wise:
            blocks: dict[str, list[tuple[int, torch.Tensor]]] = {}
            for names, per_device in zip(self.blocks, rows, strict=True):
                for (name, col), r in zip(names, per_device, strict=True):
                    blocks.setdefault(name, []).append((col, r))
            return {n: torch.cat([r for _, r in sorted(b, key=lambda cr: cr[0])], dim=1) for n, b in blocks.items()}
        permute, bucket_sizes, input_sizes = meta
        num = len(self.send)
        # a bucketized position (bucket-major, then feature) -> its position among its feature's rows, devices in
        # order: the unbucketize permutation cut per feature
        seg = torch.tensor(bucket_sizes, dtype=torch.int64).view(self.world_size, num)
        seg_start = torch.cumsum(seg.reshape(-1), 0) - seg.reshape(-1)
        local_start = (torch.cumsum(seg, 0) - seg).reshape(-1)
        remap = torch.arange(int(seg.sum())) + (local_start - seg_start).repeat_interleave(seg.reshape(-1))
        local = remap.to(permute.device)[permute.long()]
        out, start = {}, 0
        for f, name in enumerate(self.names):
            index = local[start : start + input_sizes[f]]
            start += input_sizes[f]
            out[name] = torch.cat([per_device[f] for per_device in rows]).index_select(0, index.to(rows[0][f].device))
        return out


class _Ready(LazyAwaitable[dict[str, JaggedTensor]]):
    def __init__(self, value: dict[str, JaggedTensor]) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        return self._value


class ShardedQuantEmbeddingCollectionLocal(
    ShardedModule[list[Any], list[Any], dict[str, JaggedTensor], EmbeddingCollectionContext]
):
    """Sharded :class:`QuantEmbeddingCollection` over the devices of one process (see module docstring).

    Args:
        module: the quantized EC (its bytes are copied into the shards, not re-quantized).
        table_name_to_parameter_sharding: its plan (table-, row- or column-wise; compute kernel ``quant``).
        env: ``ShardingEnv.from_local(world_size, 0)``: ``world_size`` devices of ``device``'s type.
        device: where inputs arrive and outputs are assembled (default: the module's device).
    """

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, QuantEmbeddingCollection):
            raise TypeError(f"module must be a QuantEmbeddingCollection, got {type(module).__name__}")
        if not isinstance(env, ShardingEnv) or env.process_group is not None:
            raise ValueError(
                f"ShardedQuantEmbeddingCollectionLocal shards over one process's devices: pass "
                f"env=ShardingEnv.from_local(world_size, 0), got {env!r}"
            )
        check_quant_plan(table_name_to_parameter_sharding, QUANT_SEQUENCE_SHARDING_TYPES, "sequence tables")
        self._device = torch.device(device) if device is not None else module.device
        self._configs = module.embedding_configs()
        self._tables = sharded_tables(self._configs, table_name_to_parameter_sharding, env.world_size)
        source: Source = {
            c.name: tuple(getattr(module.embeddings[c.name], n, None) for n in BUFFER_NAMES)  # type: ignore[misc]
            for c in self._configs
        }
        by_type: dict[str, list[ShardedTable]] = {}
        for table in self._tables:
            by_type.setdefault(table.sharding_type, []).append(table)
        self._shardings = [
            _LocalSequenceSharding(
                kind, group, env.world_size, self._device, source, module.bounds_check, module.backend
            )
            for kind, group in by_type.items()
        ]
        # the unsharded module's key order: data types in first-appearance order, tables in config order in each
        dtypes = list(dict.fromkeys(t.config.data_type for t in self._tables))
        ordered = sorted(self._tables, key=lambda t: dtypes.index(t.config.data_type))
        self._names = [n for t in ordered for n in t.embedding_names]
        self._sources = {
            n: f for t in self._tables for n, f in zip(t.embedding_names, t.config.feature_names, strict=True)
        }
        self._features = list(dict.fromkeys(self._sources.values()))
        self._limits = feature_row_limits(self._configs)
        self._bounds_check = module.bounds_check
        self._need_indices = module.need_indices()
        self._output_dtype = module.output_dtype()

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext()

    def input_dist(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        ctx.input_features = sequence_input_features(self, features, self._features, self._limits, self._bounds_check)
        return NoWait(NoWait([s.split(features) for s in self._shardings]))

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: list[Any]) -> list[Any]:
        with torch.no_grad():
            return [(s.compute(parts), meta) for s, (parts, meta) in zip(self._shardings, dist_input, strict=True)]

    def output_dist(self, ctx: EmbeddingCollectionContext, output: list[Any]) -> LazyAwaitable[dict[str, JaggedTensor]]:
        with torch.no_grad():
            rows: dict[str, torch.Tensor] = {}
            for sharding, (per_device, meta) in zip(self._shardings, output, strict=True):
                rows.update(sharding.assemble(per_device, meta))
        result = {}
        for name in self._names:
            feature = ctx.input_features[self._sources[name]]
            result[name] = JaggedTensor(
                values=rows[name].to(self._output_dtype),
                lengths=feature.lengths(),
                weights=feature.values() if self._need_indices else None,
            )
        return _Ready(result)

    def embedding_configs(self) -> list:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def output_dtype(self) -> torch.dtype:
        """The output rows' dtype, the unsharded module's."""
        return self._output_dtype

    def copy(self, device: torch.device) -> ShardedQuantEmbeddingCollectionLocal:
        """``self`` (torchrec's ``ModuleNoCopyMixin``): the shards already sit on their devices."""
        return self

    def sharded_tables(self) -> list[ShardedTable]:
        return self._tables

    def _table_views(self) -> list[tuple[ShardedTable, list[QuantShardView], int]]:
        """Each table with its shards' storage views (shard order) and its bit width."""
        views: dict[str, list[tuple[int, QuantShardView]]] = {t.name: [] for t in self._tables}
        for sharding in self._shardings:
            for shard, view in sharding.views():
                views[shard.table.name].append((shard.shard_index, view))
        return [
            (t, [v for _, v in sorted(views[t.name], key=lambda kv: kv[0])], QUANT_BITS[t.config.data_type])
            for t in self._tables
        ]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """torchrec's layout (:mod:`tritonrec.dist.quant_state`): live views of the shards."""
        for table, views, bits in self._table_views():
            for name, value in table_state(table, views, bits).items():
                destination[f"{prefix}embeddings.{table.name}.{name}"] = value

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Checks every table's entries first (``ValueError`` naming the key), then copies into the shards."""
        load_quant_tables(state_dict, prefix, "embeddings", self._table_views(), strict, missing_keys, unexpected_keys)


__all__ = ["ShardedQuantEmbeddingCollectionLocal"]
