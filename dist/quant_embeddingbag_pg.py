"""``ShardedQuantEmbeddingBagCollectionPG``: the quantized
:class:`~tritonrec.modules.quant_embedding_modules.QuantEmbeddingBagCollection` (INT8 / INT4 / INT2 row-wise, FP16,
FP32 tables) sharded over the ranks of a process group for inference, each rank serving its own batch.
:class:`~tritonrec.dist.quant_embeddingbag.QuantEmbeddingBagCollectionSharder` builds it when the env has a process
group (``ShardingEnv.from_process_group(pg)``); with ``ShardingEnv.from_local(world_size, 0)`` it builds the
single-process :class:`~tritonrec.dist.quant_embeddingbag.ShardedQuantEmbeddingBagCollection`.

Sharding types: table-wise, row-wise (even, or uneven with ``row_wise(sizes_placement=...)``) and column-wise (any
block widths), on CPU too; the others are refused by name. The data flow is the float EBC's
(:mod:`tritonrec.dist.sharding`: KJT all-to-all, local lookup, pooled all-to-all or reduce-scatter, MEAN divided by
the global bag lengths, column blocks put back in column order); only the lookup differs (the sharding's
``order_shards`` / ``build_lookup`` hooks): each shard keeps the unsharded module's codes, scale and bias bytes (a
column block reuses its rows' scale and bias), one lookup per data type, no autograd. Pooled rows travel in fp32 and
are cast to ``output_dtype`` once assembled (the unsharded module's single cast), so table- and column-wise outputs
equal the unsharded module's on the rank's batch bit for bit, row-wise ones up to the order of the partial sums.
INT4 / INT2 column blocks must start on a multiple of 2 / 4 columns. A variable batch per feature is refused (the
unsharded module takes none).

State dict: the unsharded module's keys (``embedding_bags.<table>.weight``, and ``.weight_qscale`` /
``.weight_qbias`` for INT tables), laid out as the sharded QuantEC's (:mod:`tritonrec.dist.quant_embedding`): a
``ShardedTensor`` over the group (codes: offsets and sizes in bytes) whose local shards are live views of this
rank's storage; column-wise scale / bias: a list of this rank's blocks' copies. ``load_state_dict`` takes the
unsharded module's state dict (any layout it loads) or a same-plan sharded one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.embeddingbag import (
    EmbeddingBagCollectionAwaitable,
    EmbeddingBagCollectionContext,
    _column_order,
    check_index_bounds,
    feature_row_limits,
)
from tritonrec.dist.quant_embeddingbag import QUANT_SHARDING_TYPES, _shard_tables
from tritonrec.dist.quant_state import ProcessGroupQuantState, QuantShardView, check_quant_plan
from tritonrec.dist.sharded_state import drop_internal_keys, ignore_internal_keys
from tritonrec.dist.sharded_tables import input_dist_checks, run_input_dists
from tritonrec.dist.sharding import CwSharding, LocalShard, RwSharding, TwCwSharding, sharded_tables
from tritonrec.dist.sharding.common import ShardingContext, group_by_sharding_type
from tritonrec.dist.types import EmbeddingComputeKernel, ParameterSharding, ShardedModule, ShardingEnv
from tritonrec.kernels.embedding import BoundsCheckMode, QuantizedTables, quantized_pooled_lookup
from tritonrec.modules.embedding_configs import QUANT_BITS
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection
from tritonrec.modules.quant_state import BUFFER_NAMES

Source = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _bits(shard: LocalShard) -> int:
    return QUANT_BITS[shard.table.config.data_type]


class QuantPooledLookup(nn.Module):
    """This rank's quantized shards of one pooled sharding: ``forward_pooled`` maps the received KJT (keys: the
    shards' features, in shard order, wider data types first) to ``[B, sum(cols)]`` fp32 pooled rows, one kernel
    launch per data type (the unsharded QuantEBC's lookup).

    Args:
        shards: the local shards, in the input dist's order (data types contiguous: ``order_shards``).
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
        self.views: list[tuple[LocalShard, QuantShardView]] = []
        self.groups: list[tuple[int, int, QuantizedTables]] = []  # (first, end feature, tables) per data type
        start = 0
        for bits in dict.fromkeys(_bits(s) for s in shards):
            mine = [s for s in shards if _bits(s) == bits]
            tables = _shard_tables(mine, source, bits, device)
            count = sum(len(s.features) for s in mine)
            self.groups.append((start, start + count, tables))
            self.views += [(s, QuantShardView.of(tables, t, s.spec)) for t, s in enumerate(mine)]
            start += count

    def ensure_packed(self) -> bool:
        return False  # the storage never moves (inference, as the unsharded module's ``copy``)

    def exchange_column_squares(self, *args: Any) -> None:
        """Nothing to exchange: quantized tables are not trained."""

    def forward_pooled(self, features: KeyedJaggedTensor) -> torch.Tensor:
        batch = features.stride()
        offsets, value_offsets, weights = features.offsets(), features.offset_per_key(), features.weights_or_none()
        outputs = []
        for a, b, tables in self.groups:
            bag_offsets = offsets[a * batch : b * batch + 1]
            v0, v1 = value_offsets[a], value_offsets[b]
            outputs.append(
                quantized_pooled_lookup(
                    tables,
                    features.values()[v0:v1],
                    bag_offsets - bag_offsets[0],
                    None if weights is None else weights[v0:v1],
                    bounds_check=self.bounds_check,
                    backend=self.backend,
                )
            )
        if not outputs:
            return torch.zeros(batch, 0, device=features.device())
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


class _QuantPooledSharding:
    """Mixed into a float pooled sharding: the same dists, a :class:`QuantPooledLookup` (wider data types first)."""

    def __init__(self, *args: Any, source: Source, **kwargs: Any) -> None:
        self._quant_source = source  # read by build_lookup during the base __init__
        super().__init__(*args, **kwargs)

    def order_shards(self, shards: list[LocalShard], config_rank: dict[str, int]) -> list[LocalShard]:
        return sorted(shards, key=lambda s: -_bits(s))  # stable: plan order within a data type, alike on every rank

    def build_lookup(self, shards, compute_kernel, device, fused, seed_base, bounds_check, backend):  # type: ignore[no-untyped-def]
        return QuantPooledLookup(shards, self._quant_source, device, bounds_check, backend)


# the float pooled shardings with the quantized lookup: QuantTwCwSharding, QuantCwSharding, QuantRwSharding
QUANT_POOLED_SHARDINGS = {
    cls.sharding_type: type(f"Quant{cls.__name__}", (_QuantPooledSharding, cls), {})
    for cls in (TwCwSharding, CwSharding, RwSharding)
}


class _Cast(LazyAwaitable[KeyedTensor]):
    """The assembled pooled rows cast to the module's ``output_dtype`` (the unsharded module's single cast)."""

    def __init__(self, inner: EmbeddingBagCollectionAwaitable, dtype: torch.dtype) -> None:
        super().__init__()
        self._inner, self._dtype = inner, dtype

    def _wait_impl(self) -> KeyedTensor:
        with torch.no_grad():
            out = self._inner.wait()
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(), values=out.values().to(self._dtype))


class ShardedQuantEmbeddingBagCollectionPG(
    ProcessGroupQuantState,
    ShardedModule[list[KeyedJaggedTensor], list[torch.Tensor], KeyedTensor, EmbeddingBagCollectionContext],
):
    """Sharded :class:`QuantEmbeddingBagCollection` over a process group (see module docstring).

    Args:
        module: the quantized EBC (its bytes are copied into the shards, not re-quantized).
        table_name_to_parameter_sharding: its plan (table-, row- or column-wise; compute kernel ``quant``).
        env: ``ShardingEnv.from_process_group(pg)``.
        device: where this rank's shards live and its outputs arrive (default: the module's device).
        qcomm_codecs_registry: codecs of the pooled all-to-all / reduce-scatter.
    """

    _state_attribute = "embedding_bags"

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | str | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, QuantEmbeddingBagCollection):
            raise TypeError(f"module must be a QuantEmbeddingBagCollection, got {type(module).__name__}")
        if not isinstance(env, ShardingEnv) or env.process_group is None:
            raise ValueError(
                f"{type(self).__name__} shards over the ranks of a process group: pass "
                f"env=ShardingEnv.from_process_group(pg), got {env!r}"
            )
        check_quant_plan(table_name_to_parameter_sharding, QUANT_SHARDING_TYPES, "tables")
        if device is None:  # the module's storage device (a QuantEBC has no ``device`` attribute)
            device = next((b.device for b in module.buffers()), torch.device("cpu"))
        self._device = torch.device(device)
        self._configs = module.embedding_bag_configs()
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
            c.name: tuple(getattr(module.embedding_bags[c.name], n, None) for n in BUFFER_NAMES) for c in self._configs
        }
        self._shardings = nn.ModuleList(
            QUANT_POOLED_SHARDINGS[kind](
                group, env, self._device, EmbeddingComputeKernel.QUANT.value, None, self.qcomm_codecs_registry,
                pooled=True, bounds_check=module.bounds_check, backend=module.backend, source=source,
            )
            for kind, group in group_by_sharding_type(self._tables).items()
        )  # fmt: skip
        self._names = [n for t in self._tables for n in t.embedding_names]  # output keys, as the unsharded module's
        dims = {n: t.config.embedding_dim for t in self._tables for n in t.embedding_names}
        self._dims = [dims[n] for n in self._names]
        order = _column_order([b for s in self._shardings for b in s.output_columns.blocks], self._names, dims)
        self._column_order = None if order is None else torch.tensor(order, device=self._device)
        self._features = list(dict.fromkeys(f for c in self._configs for f in c.feature_names))
        self._limits = feature_row_limits(self._configs)
        self._bounds_check = module.bounds_check
        self._is_weighted = module.is_weighted()
        self._output_dtype = module.output_dtype()
        self._env = env
        self._register_state_dict_hook(drop_internal_keys)  # the all-to-alls' buffers are not state
        self.register_load_state_dict_post_hook(ignore_internal_keys)

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext()

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        missing = [f for f in self._features if f not in features.index_per_key()]
        if missing:
            raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError(f"{type(self).__name__} is weighted (is_weighted=True) but features has no weights")
        if features.variable_stride_per_key():
            raise ValueError(f"{type(self).__name__} takes one batch size for all features, got a variable batch")
        if self._bounds_check == BoundsCheckMode.FATAL and self._limits:
            check_index_bounds(features, self._limits)

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        # a rank rejecting its batch joins the checks the others' all-to-alls run (the float EBC's protocol)
        with input_dist_checks(list(self._shardings), f"{type(self).__name__}.input_dist"):
            self._check_features(features)
            ctx.sharding_contexts = [ShardingContext() for _ in self._shardings]
            for context in ctx.sharding_contexts:
                context.extra["inverse_indices"] = None
            return run_input_dists(list(self._shardings), features, ctx.sharding_contexts)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            contexts = ctx.sharding_contexts
            return [s.compute(kjt, c) for s, kjt, c in zip(self._shardings, dist_input, contexts, strict=True)]

    def output_dist(self, ctx: EmbeddingBagCollectionContext, output: list[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        with torch.no_grad():
            contexts = ctx.sharding_contexts
            awaitables = [s.output_dist(o, c) for s, o, c in zip(self._shardings, output, contexts, strict=True)]
        inner = EmbeddingBagCollectionAwaitable(awaitables, self._column_order, self._names, self._dims)
        return _Cast(inner, self._output_dtype)

    def embedding_bag_configs(self) -> list:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted


__all__ = ["QUANT_POOLED_SHARDINGS", "QuantPooledLookup", "ShardedQuantEmbeddingBagCollectionPG"]
