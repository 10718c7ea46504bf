"""``ShardedQuantEmbeddingCollection`` and ``QuantEmbeddingCollectionSharder``: the quantized
:class:`~tritonrec.modules.quant_embedding_collection.QuantEmbeddingCollection` (INT8 / INT4 / INT2 row-wise, FP16,
FP32 tables) sharded over the ranks of a process group for inference, as DistributedModelParallel shards it.

Sharding types: table-wise, row-wise (even, or uneven with ``row_wise(sizes_placement=...)``) and column-wise, on
CPU too (torchrec 1.8's sharded quant EC runs table- and row-wise only on CPU, column-wise only on CUDA); the others
(data-parallel, table-row-wise, table-column-wise, grid) are refused by name. The data flow is the float EC's
(:mod:`tritonrec.dist.sharding`: KJT all-to-all, local lookup, sequence all-to-all, row-wise unbucketize, column
blocks concatenated); only the lookup differs: each local shard keeps the unsharded module's codes, scale and bias
bytes (a column block reuses its rows' scale and bias), so each rank's output equals the unsharded module's on that
rank's batch bit for bit. Rows travel in fp32 and are cast to ``output_dtype`` after the all-to-all (the cast the
unsharded module does). As for the float EC, the tables of one sharding type need equal dims (column-wise: equal
block widths), since the sequence all-to-all sends one row width. INT4 / INT2 column blocks must start on a
multiple of 2 / 4 columns.

State dict: the unsharded module's keys (``embeddings.<table>.weight``, and ``.weight_qscale`` / ``.weight_qbias``
for INT tables), each a ``ShardedTensor`` over the group of the global tensor (codes: offsets, sizes in bytes) whose
local shards are live views of this rank's storage; column-wise scale / bias: a list of this rank's blocks' copies
(torchrec's quant layout, :mod:`tritonrec.dist.quant_state`). ``load_state_dict`` takes the unsharded module's state
dict (any layout it loads) or a same-plan sharded one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.embedding import EmbeddingCollectionAwaitable, EmbeddingCollectionContext, sequence_input_features
from tritonrec.dist.embeddingbag import feature_row_limits
from tritonrec.dist.quant_embeddingbag import _shard_tables
from tritonrec.dist.quant_state import ProcessGroupQuantState, QuantShardView, check_quant_plan
from tritonrec.dist.sharded_state import drop_internal_keys, ignore_internal_keys
from tritonrec.dist.sharded_tables import input_dist_checks, run_input_dists
from tritonrec.dist.sharding import CwSharding, LocalShard, RwSharding, TwCwSharding, sharded_tables
from tritonrec.dist.sharding.common import ShardingContext, group_by_sharding_type
from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
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
from tritonrec.modules.embedding_configs import QUANT_BITS
from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection
from tritonrec.modules.quant_state import BUFFER_NAMES

QUANT_SEQUENCE_SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
]

Source = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class QuantSequenceLookup(nn.Module):
    """This rank's quantized shards of one sharding: ``forward_sequence`` maps the received KJT (keys: the shards'
    features, in shard order) to each feature's rows ``[N_f, cols]`` fp32, dequantized exactly as the unsharded
    module does (one kernel launch per feature, each id a one-row bag: the unsharded QuantEC's lookup).

    Args:
        shards: the local shards, in the input dist's order.
        source: table -> the unsharded module's (codes ``[rows, row_bytes]``, scale, bias ``[rows, 1]``).
        device: where the shards live.
        bounds_check / backend: the unsharded module's.
    """

    def __init__(
        self,
        shards: list[LocalShard],
        source: Source,
        device: torch.device,
        bounds_check: BoundsCheckMode,
        backend: Any,
    ) -> None:
        super().__init__()
        self.bounds_check, self.backend = bounds_check, backend
        self.shards = list(shards)
        self.views: list[tuple[LocalShard, QuantShardView]] = []
        self._slots: list[QuantizedTables] = []  # per local feature: its shard as a one-table, one-feature batch
        stored: dict[int, tuple[QuantizedTables, int]] = {}  # local shard -> its data type's storage, table
        for bits in dict.fromkeys(QUANT_BITS[s.table.config.data_type] for s in self.shards):
            mine = [i for i, s in enumerate(self.shards) if QUANT_BITS[s.table.config.data_type] == bits]
            tables = _shard_tables([self.shards[i] for i in mine], source, bits, device)
            stored.update({i: (tables, t) for t, i in enumerate(mine)})
        for i, shard in enumerate(self.shards):
            tables, t = stored[i]
            self.views.append((shard, QuantShardView.of(tables, t, shard.spec)))
            scale, bias = tables.table_scale_bias(t)
            spec = TableSpec(shard.spec.rows, shard.spec.cols, PoolingMode.SUM, shard.table.name)
            for feature in shard.features:
                layout = TableBatchedLayout([spec], [0], [feature])
                self._slots.append(QuantizedTables(layout, tables.bits, tables.table_codes(t).reshape(-1), scale, bias))

    def ensure_packed(self) -> bool:
        return False  # the storage never moves (inference, as the unsharded module's ``copy``)

    def exchange_column_squares(self, *args: Any) -> None:
        """Nothing to exchange: quantized tables are not trained."""

    def forward_sequence(self, features: KeyedJaggedTensor) -> list[torch.Tensor]:
        offsets, values = features.offset_per_key(), features.values()
        out = []
        for f, tables in enumerate(self._slots):
            ids = values[offsets[f] : offsets[f + 1]]
            one_id_bags = torch.arange(ids.numel() + 1, dtype=torch.int64, device=ids.device)
            out.append(
                quantized_pooled_lookup(tables, ids, one_id_bags, bounds_check=self.bounds_check, backend=self.backend)
            )
        return out


class _QuantSequenceSharding:
    """Mixed into a float sequence sharding: the same dists, a :class:`QuantSequenceLookup` (shards in plan order)."""

    def __init__(self, *args: Any, source: Source, **kwargs: Any) -> None:
        self._quant_source = source  # read by build_lookup during the base __init__
        super().__init__(*args, **kwargs)

    def order_shards(self, shards: list[LocalShard], config_rank: dict[str, int]) -> list[LocalShard]:
        return list(shards)

    def build_lookup(self, shards, compute_kernel, device, fused, seed_base, bounds_check, backend):  # type: ignore[no-untyped-def]
        return QuantSequenceLookup(shards, self._quant_source, device, bounds_check, backend)


# the float sequence shardings with the quantized lookup: QuantTwCwSharding, QuantCwSharding, QuantRwSharding
QUANT_SEQUENCE_SHARDINGS = {
    cls.sharding_type: type(f"Quant{cls.__name__}", (_QuantSequenceSharding, cls), {})
    for cls in (TwCwSharding, CwSharding, RwSharding)
}


class _Cast(LazyAwaitable[dict[str, JaggedTensor]]):
    """The assembled rows cast to the module's ``output_dtype`` (the unsharded module's single cast)."""

    def __init__(self, inner: EmbeddingCollectionAwaitable, dtype: torch.dtype) -> None:
        super().__init__()
        self._inner, self._dtype = inner, dtype

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        out = self._inner.wait()
        return {
            k: JaggedTensor(values=jt.values().to(self._dtype), lengths=jt.lengths(), weights=jt.weights_or_none())
            for k, jt in out.items()
        }


class ShardedQuantEmbeddingCollection(
    ProcessGroupQuantState,
    ShardedModule[list[KeyedJaggedTensor], list[Any], dict[str, JaggedTensor], EmbeddingCollectionContext],
):
    """Sharded :class:`QuantEmbeddingCollection` over a process group (see module docstring).

    Args:
        module: the quantized EC (its bytes are copied into the shards, not re-quantized).
        table_name_to_parameter_sharding: its plan (table-, row- or column-wise; compute kernel ``quant``).
        env: ``ShardingEnv.from_process_group(pg)``.
        device: where this rank's shards live and its outputs arrive (default: the module's device).
        qcomm_codecs_registry: codecs of the sequence all-to-all.
    """

    _state_attribute = "embeddings"

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, QuantEmbeddingCollection):
            raise TypeError(f"module must be a QuantEmbeddingCollection, got {type(module).__name__}")
        if not isinstance(env, ShardingEnv) or env.process_group is None:
            raise ValueError(
                f"ShardedQuantEmbeddingCollection shards over the ranks of a process group: pass "
                f"env=ShardingEnv.from_process_group(pg), got {env!r} (from_local: "
                f"ShardedQuantEmbeddingCollectionLocal, which QuantEmbeddingCollectionSharder.shard picks)"
            )
        check_quant_plan(table_name_to_parameter_sharding, QUANT_SEQUENCE_SHARDING_TYPES, "sequence tables")
        self._device = torch.device(device) if device is not None else module.device
        self._configs = module.embedding_configs()
        self._tables = sharded_tables(self._configs, table_name_to_parameter_sharding, env.world_size)
        for table in self._tables:  # every rank refuses a plan, not only the ranks holding the misaligned block
            bits = QUANT_BITS[table.config.data_type]
            for spec in table.shards:
                if spec.col_offset * bits % 8:
                    raise ValueError(
                        f"table {table.name!r}: an INT{bits} column block must start on a multiple of {8 // bits} "
                        f"columns ({8 // bits} codes share a byte), got a block at column {spec.col_offset}"
                    )
        source = {
            c.name: tuple(getattr(module.embeddings[c.name], n, None) for n in BUFFER_NAMES) for c in self._configs
        }
        groups = group_by_sharding_type(self._tables)
        self._shardings = nn.ModuleList(
            QUANT_SEQUENCE_SHARDINGS[kind](
                group, env, self._device, EmbeddingComputeKernel.QUANT.value, None, self.qcomm_codecs_registry,
                pooled=False, bounds_check=module.bounds_check, backend=module.backend, source=source,
            )
            for kind, group in groups.items()
        )  # fmt: skip
        # sharding types in first-appearance order (torchrec's); tables in module order in each (torchrec: by rank)
        self._embedding_names = [n for group in groups.values() for t in group for n in t.embedding_names]
        self._sources = {
            n: f for t in self._tables for n, f in zip(t.embedding_names, t.config.feature_names, strict=True)
        }
        self._features = list(dict.fromkeys(self._sources.values()))
        self._limits = feature_row_limits(self._configs)
        self._bounds_check = module.bounds_check
        self._need_indices = module.need_indices()
        self._output_dtype = module.output_dtype()
        self._env = env
        self._register_state_dict_hook(drop_internal_keys)  # the all-to-alls' recat buffers are not state
        self.register_load_state_dict_post_hook(ignore_internal_keys)

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext()

    def input_dist(
        self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        # a rank rejecting its batch joins the checks the others' all-to-alls run (the float EC's protocol)
        with input_dist_checks(list(self._shardings), f"{type(self).__name__}.input_dist"):
            ctx.input_features = sequence_input_features(
                self, features, self._features, self._limits, self._bounds_check
            )
            ctx.sharding_contexts = [ShardingContext() for _ in self._shardings]
            return run_input_dists(list(self._shardings), features, ctx.sharding_contexts)

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: list[KeyedJaggedTensor]) -> list[Any]:
        with torch.no_grad():
            return [
                s.compute(kjt, c) for s, kjt, c in zip(self._shardings, dist_input, ctx.sharding_contexts, strict=True)
            ]

    def output_dist(self, ctx: EmbeddingCollectionContext, output: list[Any]) -> LazyAwaitable[dict[str, JaggedTensor]]:
        with torch.no_grad():
            contexts = ctx.sharding_contexts
            awaitables = [s.output_dist(o, c) for s, o, c in zip(self._shardings, output, contexts, strict=True)]
        names, sources = self._embedding_names, self._sources
        return _Cast(
            EmbeddingCollectionAwaitable(awaitables, ctx, names, self._need_indices, sources), self._output_dtype
        )

    def embedding_configs(self) -> list:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices


class QuantEmbeddingCollectionSharder(ModuleSharder[QuantEmbeddingCollection]):
    """Shards :class:`QuantEmbeddingCollection` table-, row- or column-wise over a process group or over one
    process's devices (``ShardingEnv.from_local``), for inference."""

    def shard(
        self,
        module: QuantEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule:
        """``env`` with a process group: :class:`ShardedQuantEmbeddingCollection`; ``from_local``:
        :class:`~tritonrec.dist.quant_embedding_local.ShardedQuantEmbeddingCollectionLocal`."""
        if isinstance(env, ShardingEnv) and env.process_group is None:
            from tritonrec.dist.quant_embedding_local import ShardedQuantEmbeddingCollectionLocal  # imports this file

            return ShardedQuantEmbeddingCollectionLocal(module, params, env, device)
        return ShardedQuantEmbeddingCollection(module, params, env, device, self.qcomm_codecs_registry)

    @property
    def module_type(self) -> type[QuantEmbeddingCollection]:
        return QuantEmbeddingCollection

    def shardable_parameters(self, module: QuantEmbeddingCollection) -> dict[str, nn.Parameter]:
        """Table -> a ``[rows, dim]`` meta tensor (the codes are bytes; plans count columns)."""
        return {
            c.name: nn.Parameter(torch.empty(c.num_embeddings, c.embedding_dim, device="meta"), requires_grad=False)
            for c in module.embedding_configs()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(QUANT_SEQUENCE_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.QUANT.value]


__all__ = [
    "QUANT_SEQUENCE_SHARDING_TYPES",
    "QuantEmbeddingCollectionSharder",
    "QuantSequenceLookup",
    "ShardedQuantEmbeddingCollection",
]
