"""The base of every sharding: which local shards each rank holds, the grouped lookup over this rank's, and the
three steps a sharded module chains (``input_dist`` -> ``compute`` -> ``output_dist``), each returning an awaitable.

A sharding is built once per (sharding type, compute kernel) of a module. Every rank builds the same sharding objects
from the same plan, so each knows every rank's feature list; that is what sizes the collectives.

Output contract: ``output_dist`` gives this rank's ``[B_me, output_columns.width]`` pooled embeddings (or, for
sequence shardings, ``[N_me, D]`` rows), whatever the input's batch layout (fixed or variable stride per feature).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, NoWait
from tritonrec.dist.column_adagrad import ColumnShardKey
from tritonrec.dist.comm_consistency import MetadataCheck
from tritonrec.dist.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
from tritonrec.dist.embedding_lookup import FusedConfigs, GroupedEmbeddingLookup, fused_of
from tritonrec.dist.qcomm_protocol import CommOp, QuantizedCommCodecs
from tritonrec.dist.sharding.common import (
    COLUMN_SPLIT_TYPES,
    LocalShard,
    OutputColumns,
    ShardedTable,
    ShardingContext,
    order_for_lookup,
    select_features,
)
from tritonrec.dist.side_groups import INPUT_DIST, current_group, same_ranks_group
from tritonrec.dist.types import ShardingEnv
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import BoundsCheckMode


class EmbeddingSharding(nn.Module, abc.ABC):
    """One sharding of a module's tables (all of one sharding type and compute kernel).

    Args:
        tables: the tables, in module order.
        env: the process group (``env.process_group`` must be set: training).
        device: where this rank's shards live.
        compute_kernel: ``"dense"`` or ``"fused"``.
        fused: the fused optimizer config (fused kernel), of all tables or per table name.
        codecs_registry: comm op name -> codecs for the output dist's wire.
        pooled: pooled (EBC) or sequence (EC) outputs.
        seed_base: stochastic-rounding seed of the lookup's first group.
    """

    sharding_type: str = ""
    supports_variable_batch: bool = False

    def __init__(
        self,
        tables: list[ShardedTable],
        env: ShardingEnv,
        device: torch.device,
        compute_kernel: str,
        fused: FusedConfigs,
        codecs_registry: dict[str, QuantizedCommCodecs] | None,
        pooled: bool = True,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
        seed_base: int = 0,
    ) -> None:
        super().__init__()
        if env.process_group is None:
            raise ValueError(f"{type(self).__name__} needs a process group: use ShardingEnv.from_process_group(pg)")
        self.tables = tables
        self.env = env
        self.pg: dist.ProcessGroup = env.process_group
        self.world_size, self.rank = env.world_size, env.rank
        self.device = device
        self.pooled = pooled
        self.codecs_registry = dict(codecs_registry or {})
        # tables with different fused configs get lookup groups of their own: a config's position among the
        # sharding's tables (module order) orders them alike on every rank
        configs: list[int] = []
        config_rank = {}
        for table in tables:
            key = id(fused_of(fused, table.name))
            if key not in configs:
                configs.append(key)
            config_rank[table.name] = configs.index(key)
        self.shards_per_rank = [self.order_shards(self.local_shards(r), config_rank) for r in range(self.world_size)]
        self.lookup = self.build_lookup(
            self.shards_per_rank[self.rank], compute_kernel, device, fused, seed_base, bounds_check, backend
        )
        self._select_cache: dict[Any, list[int]] = {}
        # One KJTAllToAll per (splits, stagger), kept across batches: its MetadataCheck counts calls, so only the
        # first calls pay the cross-rank consistency check (a fresh module per batch would check every batch).
        # A plain dict, not submodules: the modules hold no state worth saving.
        self._kjt_all_to_all: dict[tuple[tuple[int, ...], int], KJTAllToAll] = {}
        # input dists on a group of their own (side_groups): the pipelines launch them ahead of other batches' work
        self._input_dist_pg = same_ranks_group(self.pg, INPUT_DIST)
        # one metadata check for this sharding's KJT all-to-alls, which the collection opens around its own input
        # checks (input_dist_checks): a rank whose batch it rejects still joins the check the others run
        self._input_dist_check = MetadataCheck()
        if not pooled:
            widths = {s.spec.cols for shards in self.shards_per_rank for s in shards}
            if len(widths) > 1:
                raise ValueError(
                    f"{self.sharding_type} sequence sharding sends one row width: tables "
                    f"{sorted({t.name for t in tables})} give shards of widths {sorted(widths)} (tables of one "
                    "sharding need equal dims, and column-wise tables equal block widths: uneven "
                    "column_wise(size_per_rank=...) blocks suit pooled tables only)"
                )
            self.row_width = widths.pop() if widths else 0
        if self.sharding_type in COLUMN_SPLIT_TYPES:
            keys = [
                [ColumnShardKey(s.table.name, s.shard_index, r, s.spec.row_offset, s.spec.col_offset) for s in shards]
                for r, shards in enumerate(self.shards_per_rank)
            ]
            full_dims = {t.name: t.config.embedding_dim for t in tables}
            self.lookup.exchange_column_squares(self.pg, keys, full_dims)

    # ------------------------------------------------------------------------------------------------ placement
    @abc.abstractmethod
    def local_shards(self, rank: int) -> list[LocalShard]:
        """The shards rank ``rank`` looks up (any order; the base orders them by dtype for the lookup)."""

    def order_shards(self, shards: list[LocalShard], config_rank: dict[str, int]) -> list[LocalShard]:
        """A rank's shards in its lookup's input order: by storage dtype, then fused config (a lookup of other
        storage, the quantized one, orders its own)."""
        return order_for_lookup(shards, config_rank)

    def build_lookup(
        self,
        shards: list[LocalShard],
        compute_kernel: str,
        device: torch.device,
        fused: FusedConfigs,
        seed_base: int,
        bounds_check: BoundsCheckMode,
        backend: Backend,
    ) -> GroupedEmbeddingLookup:
        """This rank's lookup over ``shards`` (the float one; the quantized sequence shardings build theirs)."""
        return GroupedEmbeddingLookup(shards, compute_kernel, device, fused, seed_base, bounds_check, backend)

    @property
    @abc.abstractmethod
    def output_columns(self) -> OutputColumns:
        """The columns of this rank's output, in order (pooled)."""

    def feature_names(self) -> list[str]:
        """The module features this sharding reads (each once, in table order)."""
        return list(dict.fromkeys(f for t in self.tables for f in t.config.feature_names))

    def rank_features(self, rank: int) -> list[str]:
        """The KJT keys rank ``rank``'s lookup reads, in its input order (a feature repeats for each local table, or
        column block, that reads it)."""
        return [f for s in self.shards_per_rank[rank] for f in s.features]

    def codecs(self, op: CommOp) -> QuantizedCommCodecs | None:
        return self.codecs_registry.get(op.name)

    distributes_input = True  # its input dist is a KJT all-to-all (data-parallel's is not)

    @property
    def input_dist_on_own_group(self) -> bool:
        """Whether this sharding's input dists run on a group of their own (see :mod:`tritonrec.dist.side_groups`)."""
        return self._input_dist_pg is not self.pg

    @property
    def input_dist_pg(self) -> dist.ProcessGroup:
        """The input dists' group: the side group, or the one that replaced it after an agreed failure."""
        return current_group(self._input_dist_pg)

    @property
    def input_dist_check(self) -> MetadataCheck:
        """The metadata check of the input dists; a renewed group gets a fresh one, and fresh all-to-alls."""
        pg = self.input_dist_pg
        if pg is not self._input_dist_pg:
            self._input_dist_pg, self._input_dist_check = pg, MetadataCheck()
            self._kjt_all_to_all.clear()
        return self._input_dist_check

    # ------------------------------------------------------------------------------------------------ the steps
    @abc.abstractmethod
    def input_dist(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Launch the sparse redistribution of ``features`` (this rank's batch)."""

    def compute(self, features: KeyedJaggedTensor, ctx: ShardingContext) -> Any:
        """Local lookup of what the input dist delivered."""
        self.lookup.ensure_packed()
        if self.pooled:
            return self.lookup.forward_pooled(features)
        return self.lookup.forward_sequence(features)

    @abc.abstractmethod
    def output_dist(self, local: Any, ctx: ShardingContext) -> Awaitable[torch.Tensor]:
        """Launch the redistribution of the lookup's output back to the sample-owning ranks."""

    # -------------------------------------------------------------------------------------------------- helpers
    def select(self, features: KeyedJaggedTensor, names: list[str]) -> KeyedJaggedTensor:
        return select_features(features, names, self._select_cache)

    def all_to_all(
        self,
        features: KeyedJaggedTensor,
        splits: list[int],
        ctx: ShardingContext,
        stagger: int = 1,
        then: Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None = None,
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """``KJTAllToAll`` of ``features`` whose second round records batch sizes and splits into ``ctx``."""
        check = self.input_dist_check  # first: after a renewal it drops the all-to-alls of the old group
        key = (tuple(splits), stagger)
        module = self._kjt_all_to_all.get(key)
        if module is None:
            module = self._kjt_all_to_all[key] = KJTAllToAll(self.input_dist_pg, splits, stagger, metadata_check=check)
        splits_awaitable = module(features)
        return _RecordingSplits(splits_awaitable, ctx, then)


class _RecordingSplits(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """The first round of a KJTAllToAll; its wait records what the second round knows into the context."""

    def __init__(
        self,
        splits_awaitable: Awaitable[KJTAllToAllTensorsAwaitable],
        ctx: ShardingContext,
        then: Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None,
    ) -> None:
        super().__init__()
        self._splits = splits_awaitable
        self._ctx = ctx
        self._then = then

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        tensors = self._splits.wait()
        self._ctx.batch_size_per_rank = list(tensors.stride_per_rank or [])
        self._ctx.input_splits = list(tensors.input_splits["values"])
        self._ctx.output_splits = list(tensors.output_splits["values"])
        if self._then is not None:
            tensors.callbacks.append(self._then)
        return tensors


def sequence_rows(local: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """The lookup's per-feature rows as one ``[N_me, D]`` block for the sequence all-to-all; a rank without rows
    still sends an (empty) block that requires grad, so it joins the all-to-all's backward like every rank."""
    if local:
        return torch.cat(local)
    return torch.zeros(0, width, device=device, requires_grad=torch.is_grad_enabled())


def record_slots(ctx: ShardingContext, features: KeyedJaggedTensor, columns: list[tuple[str, int, int]]) -> None:
    """For a sequence output dist: what each key of the sent KJT becomes (embedding name, column block) and its
    values."""
    ctx.extra["slots"] = [(*c, n) for c, n in zip(columns, features.length_per_key(), strict=True)]


def no_dist(features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
    """The input dist of data parallel: nothing moves."""
    return NoWait(NoWait(features))


def shard_columns(shards: list[LocalShard]) -> OutputColumns:
    """Columns of a lookup's output over ``shards``: each shard's embeddings in feature order."""
    return OutputColumns(tuple((name, s.spec.col_offset, s.spec.cols) for s in shards for name in s.embedding_names))


def feature_dims(shards: list[LocalShard]) -> list[int]:
    return [s.spec.cols for s in shards for _ in s.features]


def columns_of(shards_per_rank: list[list[LocalShard]]) -> OutputColumns:
    """Columns of an all-to-all output: every rank's shards' embeddings, rank by rank."""
    return OutputColumns(tuple(b for shards in shards_per_rank for b in shard_columns(shards).blocks))


__all__ = [
    "EmbeddingSharding",
    "columns_of",
    "feature_dims",
    "no_dist",
    "record_slots",
    "sequence_rows",
    "shard_columns",
]
