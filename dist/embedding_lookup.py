"""Grouped local lookups: the shards one rank holds for one sharding, table-batched by storage dtype and fused
optimizer (tables with different optimizers, from ``apply_optimizer_in_backward``, get groups of their own).

A :class:`GroupedEmbeddingLookup` receives the KJT its sharding's input dist delivers (keys = its feature list, in
order; a key may repeat when several local shards read one feature) and returns the pooled ``[B, sum(D)]`` or
sequence ``[N, D]`` rows of its shards, one kernel launch per group. The kernels never see ranks: each shard is
a ``rows x cols`` table whose indices the input dist already made local.

Compute kernels: ``dense`` (gradients reach the shard parameters), ``fused`` (the optimizer runs inside the
backward). Data-parallel lookups all-reduce inside the backward, and rowwise Adagrad on column shards exchanges row
sums of squares there (:mod:`tritonrec.dist.grad_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.column_adagrad import ColumnShardAdagradUpdate, ColumnShardKey
from tritonrec.dist.dp_fused_update import DataParallelFusedUpdate
from tritonrec.dist.fused_spans import FusedTables
from tritonrec.dist.grad_sync import all_reduced_params, sink_views
from tritonrec.dist.types import EmbeddingComputeKernel
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    FusedOptimizerState,
    OptimType,
    TableBatchedLayout,
    TableSpec,
    create_fused_optimizer_state,
    pooled_embedding_lookup,
    sequence_embedding_lookup,
)
from tritonrec.kernels.embedding.storage import empty_table_storage
from tritonrec.modules.table_batched import TableGroup, is_packed, repack

if TYPE_CHECKING:
    from tritonrec.dist.sharding.common import LocalShard


@dataclass
class FusedConfig:
    """A fused optimizer of a sharded module's tables: rule, hyperparameters (one live dict shared by every group of
    every lookup with this config, exposed as one of ``fused_optimizer.param_groups``) and stochastic rounding of
    fp16/bf16 tables."""

    optim: OptimType
    kwargs: dict[str, Any] = field(default_factory=dict)
    stochastic_rounding: bool = True
    hyperparams: dict[str, Any] | None = None

    def create_state(self, layout: TableBatchedLayout, device: torch.device, seed: int) -> FusedOptimizerState:
        state = create_fused_optimizer_state(layout, self.optim, device, self.stochastic_rounding, seed, **self.kwargs)
        if self.hyperparams is None:
            self.hyperparams = state.hyperparams
        state.hyperparams = self.hyperparams
        return state


class ShardWeight(nn.Module):
    """Holds one local shard's ``weight`` (a view of its group's flat buffer)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


FusedConfigs = FusedConfig | Mapping[str, FusedConfig | None] | None
"""The fused optimizer of a lookup's tables: one for all, or per table name (None: the table has none)."""


def fused_of(fused: FusedConfigs, table: str) -> FusedConfig | None:
    """Table ``table``'s config in ``fused``."""
    return fused.get(table) if isinstance(fused, Mapping) else fused


@dataclass
class LookupGroup:
    """Local shards of one storage dtype and fused config: a :class:`TableGroup` plus the span of the lookup's
    features it reads."""

    table_group: TableGroup
    shards: list[LocalShard]
    features: tuple[int, int]
    state: FusedOptimizerState | None = None

    @property
    def layout(self) -> TableBatchedLayout:
        return self.table_group.layout


class GroupedEmbeddingLookup(nn.Module):
    """This rank's shards of one sharding (see module docstring).

    Args:
        shards: the local shards, each (dtype, fused config) contiguous
            (:func:`~tritonrec.dist.sharding.common.order_for_lookup`).
        compute_kernel: ``"dense"`` or ``"fused"``.
        device: where the shards live.
        fused: the fused optimizer, of all tables or per table name (``compute_kernel="fused"``).
        seed_base: stochastic-rounding seed of the first group (groups count up from it).
        bounds_check / backend: as for the unsharded modules.
    """

    def __init__(
        self,
        shards: list[LocalShard],
        compute_kernel: str,
        device: torch.device,
        fused: FusedConfigs,
        seed_base: int = 0,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        if compute_kernel not in (EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value):
            raise ValueError(f"compute_kernel must be 'dense' or 'fused' for a float lookup, got {compute_kernel!r}")
        if compute_kernel == EmbeddingComputeKernel.FUSED.value:
            missing = sorted({s.table.name for s in shards if fused_of(fused, s.table.name) is None})
            if fused is None or missing:
                raise ValueError(
                    f"the fused compute kernel needs fused_params with an optimizer, tables {missing} have none"
                )
        self.compute_kernel = compute_kernel
        self.bounds_check = bounds_check
        self.backend: Backend = backend
        self.shards = list(shards)
        self.features = [f for s in self.shards for f in s.features]
        self.groups: list[LookupGroup] = []
        self._fused = fused
        self._handler: Callable[[Any], None] | None = None
        self._handled: list[int] = []  # the groups whose gradients go to ``_handler``
        self._dp_group: dist.ProcessGroup | None = None
        start_feature = 0
        for k, run in enumerate(_lookup_runs(self.shards, fused)):
            specs = [TableSpec(s.spec.rows, s.spec.cols, s.pooling, s.table.name) for s in run]
            feature_tables = [t for t, s in enumerate(run) for _ in s.features]
            names = [n for s in run for n in s.embedding_names]  # slot labels (errors); routing is positional
            layout = TableBatchedLayout(specs, feature_tables, names)
            flat = empty_table_storage(layout.num_weights, run[0].dtype, device)
            requires_grad = compute_kernel == EmbeddingComputeKernel.DENSE.value
            modules = [
                ShardWeight(nn.Parameter(layout.table_view(flat, t), requires_grad=requires_grad))
                for t in range(len(run))
            ]
            group = TableGroup(list(range(len(run))), layout, flat, modules)
            config = fused_of(fused, run[0].table.name)
            state = None
            if config is not None and not requires_grad:
                state = config.create_state(layout, device, seed_base + k)
            self.groups.append(LookupGroup(group, list(run), (start_feature, start_feature + len(names)), state))
            start_feature += len(names)

    # ------------------------------------------------------------------------------------------- synchronisation
    def all_reduce_gradients(self, pg: dist.ProcessGroup) -> None:
        """Data parallel: all-reduce every gradient over ``pg`` inside the backward (see grad_sync)."""
        if self.compute_kernel == EmbeddingComputeKernel.FUSED.value:
            self._handled = list(range(len(self.groups)))
            self._handler = DataParallelFusedUpdate(pg, self._fused_tables()) if self.groups else None
        else:
            self._dp_group = pg

    def exchange_column_squares(
        self, pg: dist.ProcessGroup, shards_per_rank: list[list[ColumnShardKey]], full_dims: dict[str, int]
    ) -> None:
        """Rowwise Adagrad on column shards: exchange row sums of squares inside the backward (see grad_sync). Only
        the rowwise Adagrad groups take part (``shards_per_rank`` is filtered to their tables, which keeps each
        rank's lookup order); the other groups' tables update in the kernels' backward."""
        if self.compute_kernel != EmbeddingComputeKernel.FUSED.value:
            return
        states = [g.state for g in self.groups]
        handled = [i for i, s in enumerate(states) if s is not None and s.optim == OptimType.EXACT_ROWWISE_ADAGRAD]
        if handled:

            def rowwise(key: ColumnShardKey) -> bool:
                config = fused_of(self._fused, key.table)
                return config is not None and config.optim == OptimType.EXACT_ROWWISE_ADAGRAD

            keys = [[key for key in shards if rowwise(key)] for shards in shards_per_rank]
            self._handled = handled
            self._handler = ColumnShardAdagradUpdate(pg, self._fused_tables(), keys, full_dims)

    def _fused_tables(self) -> list[FusedTables]:
        """The fused tables of the groups in ``_handled``."""
        groups = [self.groups[i] for i in self._handled]
        return [FusedTables(g.layout, g.table_group.weights, g.state) for g in groups]  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------------------------- parameters
    def shard_modules(self) -> list[tuple[LocalShard, ShardWeight]]:
        return [(s, m) for g in self.groups for s, m in zip(g.shards, g.table_group.modules, strict=True)]

    def ensure_packed(self) -> bool:
        """Re-pack groups whose parameters no longer alias their flat buffer (after ``.to()`` or an assignment)."""
        repacked = False
        for group in self.groups:
            if not is_packed(group.table_group):
                repack(group.table_group)
                repacked = True
        return repacked

    def move_state(self, device: torch.device) -> None:
        for group in self.groups:
            state = group.state
            if state is not None:
                for name in ("momentum1", "momentum2", "step"):
                    tensor = getattr(state, name)
                    if tensor is not None and tensor.device != device:
                        setattr(state, name, tensor.to(device))

    # ------------------------------------------------------------------------------------------------- forward
    def _table_weights(self) -> tuple[list[list[torch.Tensor] | None], bool]:
        """Per group, what to pass as ``table_weights`` (None: fused in the kernel), and whether sparse."""
        out_groups: list[list[torch.Tensor] | None] = [None] * len(self.groups)
        if self._handler is not None:
            layouts = [self.groups[i].layout for i in self._handled]
            flats = [self.groups[i].table_group.weights for i in self._handled]
            for i, views in zip(self._handled, sink_views(self._handler, layouts, flats), strict=True):
                out_groups[i] = views
            return out_groups, True
        if self.compute_kernel == EmbeddingComputeKernel.FUSED.value:
            return out_groups, False
        params = [p for g in self.groups for p in g.table_group.params]
        if self._dp_group is not None:
            params = all_reduced_params(params, self._dp_group)
        out, k = [], 0
        for g in self.groups:
            out.append(params[k : k + g.layout.num_tables])
            k += g.layout.num_tables
        return out, False

    def _empty(self, rows: int, device: torch.device) -> torch.Tensor:
        # a rank without shards still sends (empty) columns through the output dist, whose backward is a collective
        # every rank must join: the placeholder requires grad so that backward runs here too
        return torch.zeros(rows, 0, device=device, requires_grad=torch.is_grad_enabled())

    def forward_pooled(self, features: KeyedJaggedTensor, bag_divisors: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` (keys = this lookup's feature list, fixed stride B) -> ``[B, sum of feature dims]``."""
        batch = features.stride()
        active = [g for g in self.groups if g.features[1] > g.features[0]]
        if not active:
            return self._empty(batch, features.device())
        weights_per_group, sparse = self._table_weights()
        value_offsets = features.offset_per_key()
        offsets, values, psw = features.offsets(), features.values(), features.weights_or_none()
        outputs = []
        for i, group in enumerate(self.groups):
            a, b = group.features
            if b == a:
                continue
            v0, v1 = value_offsets[a], value_offsets[b]
            group_offsets = offsets[a * batch : b * batch + 1]
            if a:
                group_offsets = group_offsets - group_offsets[0]
            outputs.append(
                pooled_embedding_lookup(
                    group.table_group.weights,
                    group.layout,
                    values[v0:v1],
                    group_offsets,
                    None if psw is None else psw[v0:v1],
                    None if bag_divisors is None else bag_divisors[a * batch : b * batch],
                    table_weights=weights_per_group[i],
                    sparse_grad=sparse and weights_per_group[i] is not None,
                    fused=group.state if weights_per_group[i] is None else None,
                    bounds_check=self.bounds_check,
                    backend=self.backend,
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def forward_sequence(self, features: KeyedJaggedTensor) -> list[torch.Tensor]:
        """``features`` -> per feature of the lookup's list, its rows ``[N_f, D_f]``."""
        weights_per_group, sparse = self._table_weights()
        value_offsets = features.offset_per_key()
        values = features.values()
        out: list[torch.Tensor] = []
        for i, group in enumerate(self.groups):
            a, b = group.features
            if b == a:
                continue
            starts = [value_offsets[f] - value_offsets[a] for f in range(a, b + 1)]
            flat = sequence_embedding_lookup(
                group.table_group.weights,
                group.layout,
                values[value_offsets[a] : value_offsets[b]],
                starts,
                table_weights=weights_per_group[i],
                sparse_grad=sparse and weights_per_group[i] is not None,
                fused=group.state if weights_per_group[i] is None else None,
                bounds_check=self.bounds_check,
                backend=self.backend,
            )
            dims = group.layout.feature_dims
            sizes = [(starts[f + 1] - starts[f]) * d for f, d in enumerate(dims)]
            out.extend(part.view(-1, d) for part, d in zip(torch.split(flat, sizes), dims, strict=True))
        return out


def _lookup_runs(shards: list[LocalShard], fused: FusedConfigs) -> list[list[LocalShard]]:
    """Consecutive shards of one dtype and fused config (the caller ordered them so each pair is one run)."""

    def key(shard: LocalShard) -> tuple[torch.dtype, int]:
        return shard.dtype, id(fused_of(fused, shard.table.name))

    runs: list[list[LocalShard]] = []
    for shard in shards:
        if runs and key(runs[-1][0]) == key(shard):
            runs[-1].append(shard)
        else:
            if any(key(r[0]) == key(shard) for r in runs):
                raise ValueError("local shards must be grouped by dtype and fused config (order_for_lookup)")
            runs.append([shard])
    return runs


def pad_variable_batch(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A variable-stride KJT as a fixed-stride one: every key padded with empty bags to the largest stride (the
    kernels take one batch size); a key's real bags stay first, so its rows are ``[:stride of the key]``."""
    strides = features.stride_per_key()
    batch = max(strides, default=0)
    lengths = features.lengths()
    padded = torch.zeros(len(strides), batch, dtype=lengths.dtype, device=lengths.device)
    mask = torch.arange(batch, device=lengths.device)[None, :] < torch.tensor(strides, device=lengths.device)[:, None]
    padded[mask] = lengths
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        weights=features.weights_or_none(),
        lengths=padded.reshape(-1),
        stride=batch,
    )


__all__ = [
    "FusedConfig",
    "FusedConfigs",
    "GroupedEmbeddingLookup",
    "LookupGroup",
    "ShardWeight",
    "fused_of",
    "pad_variable_batch",
]
