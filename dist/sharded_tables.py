"""What the sharded collections (pooled and sequence) share: building the shardings from a plan, initialising this
rank's shards, the per-table parameter containers, the fused optimizer over the local shards, device moves, and the
awaitables that chain every sharding's input dist.

Parameters: ``<container>.<table>.weight`` is this rank's (first) shard of the table, a view of its lookup's flat
buffer; a rank holding several shards of one table (column-wise on repeated ranks) also has ``weight_1``, ... A rank
without a shard of a table has no parameter for it (its state-dict entry is still there: see
:mod:`tritonrec.dist.sharded_state`).

Initialisation never reads an unsharded weight on the ``meta`` device: a real weight is sliced (so the sharded module
starts equal to the unsharded one), a meta weight is replaced by the table config's ``init_fn`` applied to each local
shard, so only this rank's shards are ever materialised.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.embedding_lookup import ShardWeight
from tritonrec.dist.fused_params import LookupOptions, parse_fused_params, table_fused_configs
from tritonrec.dist.in_backward import in_backward_fused_params
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharded_fused_optimizer import NoLocalShardsOptimizer, ShardedEmbeddingFusedOptimizer
from tritonrec.dist.sharded_state import (
    copy_into_shards,
    drop_internal_keys,
    fused_tables,
    ignore_internal_keys,
    save_table,
    table_shape,
)
from tritonrec.dist.sharding import EmbeddingSharding, LocalShard, ShardedTable, build_shardings, sharded_tables
from tritonrec.dist.sharding.common import ShardingContext
from tritonrec.dist.types import EmbeddingComputeKernel, ParameterSharding, ShardingEnv
from tritonrec.modules.embedding_configs import BaseEmbeddingConfig


class TableShards(nn.Module):
    """This rank's shards of one table (see module docstring); its state-dict entry ``weight`` is the whole table
    (:mod:`tritonrec.dist.sharded_state`)."""

    def __init__(
        self, table: ShardedTable, local: list[tuple[LocalShard, ShardWeight]], pg: Any, device: torch.device
    ) -> None:
        super().__init__()
        self.table = table
        self.local = local
        self._pg = pg
        self._device = device
        for k, (_, module) in enumerate(local):
            self.register_parameter(shard_param_name(k), module.weight)

    def _local_pairs(self, detach: bool) -> list[tuple[Any, torch.Tensor]]:
        return [(shard.spec, m.weight.detach() if detach else m.weight) for shard, m in self.local]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        device = self.local[0][1].weight.device if self.local else self._device
        destination[prefix + "weight"] = save_table(self.table, self._local_pairs(not keep_vars), self._pg, device)

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            copy_into_shards(key, state_dict[key], self._local_pairs(True), shape=table_shape(self.table))
        except (ValueError, TypeError) as err:
            error_msgs.append(str(err))


def shard_param_name(k: int) -> str:
    return "weight" if k == 0 else f"weight_{k}"


def _check_env(env: object) -> ShardingEnv:
    if not isinstance(env, ShardingEnv):
        raise TypeError(f"env must be a ShardingEnv, got {type(env).__name__}")
    return env


def default_device(weight: torch.Tensor, device: torch.device | str | None) -> torch.device:
    """``device`` if given, else the unsharded weights' device, else (meta weights) CUDA when present, else CPU."""
    if device is not None:
        return torch.device(device)
    if weight.device.type != "meta":
        return weight.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ShardedTablesMixin:
    """Builds and owns the shardings of a sharded collection (mixed into the ShardedModule subclasses)."""

    _shardings: nn.ModuleList
    _tables: list[ShardedTable]
    _options: LookupOptions

    @property
    def input_dist_on_own_group(self) -> bool:
        return len(self._shardings) > 0 and all(s.input_dist_on_own_group for s in self._shardings)

    def _build(
        self,
        module: nn.Module,
        configs: list[BaseEmbeddingConfig],
        source_weights: dict[str, torch.Tensor],
        plan: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None,
        device: torch.device | str | None,
        codecs_registry: dict[str, QuantizedCommCodecs] | None,
        pooled: bool,
        container: str,
    ) -> None:
        env = _check_env(env)
        self._env = env
        self._options = parse_fused_params(fused_params, module)
        # a table's optimizer set by torch's apply_optimizer_in_backward (torchrec's recipe) replaces fused_params' rule
        per_table = in_backward_fused_params(fused_params, source_weights)
        self._options.table_fused = table_fused_configs(per_table, module, self._options.fused)
        if self._options.weights_precision is not None:
            configs = [dataclasses.replace(c, data_type=self._options.weights_precision) for c in configs]
        self._configs = configs
        tables = sharded_tables(configs, plan, env.world_size)
        for table in tables:
            kernel = table.sharding.compute_kernel
            if kernel == EmbeddingComputeKernel.FUSED.value and self._options.fused_of(table.name) is None:
                raise ValueError(
                    f"table {table.name!r}: the fused compute kernel needs an optimizer: pass "
                    "fused_params={'optimizer': ...} to the sharder (or shard a Fused* module)"
                )
            # a fused collection's table, or one apply_optimizer_in_backward gave an optimizer: the dense kernel
            # would drop that optimizer silently and hand the shards to the dense one
            if kernel == EmbeddingComputeKernel.DENSE.value and hasattr(
                source_weights.get(table.name), "_in_backward_optimizers"
            ):
                raise ValueError(
                    f"table {table.name!r} is updated inside the backward (an optimizer applied in backward, or a "
                    "fused collection's own), which the dense compute kernel would drop (its shards would train with "
                    "the dense optimizer instead): use compute_kernel='fused'"
                )
            if kernel == EmbeddingComputeKernel.QUANT.value:
                raise ValueError(f"table {table.name!r}: the quant compute kernel is for QuantEmbeddingBagCollection")
        self._tables = tables
        first = next(iter(source_weights.values()))
        self._device = default_device(first, device)
        shardings = build_shardings(tables, env, self._device, self._options, codecs_registry, pooled)
        self._shardings = nn.ModuleList(shardings)
        local: dict[str, list[tuple[LocalShard, ShardWeight]]] = {t.name: [] for t in tables}
        for sharding in shardings:
            for shard, weight in sharding.lookup.shard_modules():
                local[shard.table.name].append((shard, weight))
        for shards in local.values():
            shards.sort(key=lambda item: item[0].shard_index)
        with torch.no_grad():
            for table in tables:
                for shard, weight in local[table.name]:
                    _init_shard(weight.weight, shard, source_weights[table.name])
        tables_module = {t.name: TableShards(t, local[t.name], env.process_group, self._device) for t in tables}
        setattr(self, container, nn.ModuleDict(tables_module))
        self._container = container
        self._local = local
        self._build_fused_optimizer()
        self._register_state_dict_hook(drop_internal_keys)  # type: ignore[attr-defined]
        self.register_load_state_dict_post_hook(ignore_internal_keys)  # type: ignore[attr-defined]

    # ----------------------------------------------------------------------------------------- what state sees
    def sharded_tables(self) -> list[ShardedTable]:
        """Every table with its placement, in module order."""
        return self._tables

    def embedding_tables(self) -> dict[str, list[tuple[LocalShard, ShardWeight]]]:
        """Table -> this rank's shards of it (shard order) with their weights."""
        return self._local

    @property
    def process_group(self) -> Any:
        return self._env.process_group

    @property
    def state_device(self) -> torch.device:
        return self._device

    @property
    def lookup_options(self) -> LookupOptions:
        return self._options

    def _build_fused_optimizer(self) -> None:
        slots, states, groups = [], [], []
        for sharding in self._shardings:
            for group in sharding.lookup.groups:
                if group.state is None:
                    continue
                states.append(group.state)
                groups.append(group.table_group)
        for name, shards in self._local.items():
            for k, (_, weight) in enumerate(shards):
                for group in groups:
                    if weight in group.modules:
                        slots.append(
                            (f"{self._container}.{name}.{shard_param_name(k)}", group, group.modules.index(weight))
                        )
        # one param group per distinct fused optimizer of the fused tables (the same on every rank, shards or not)
        configs = self._options.fused_configs(t.name for t in fused_tables(self))
        hyperparams = [c.hyperparams for c in configs]
        if not hyperparams:
            hyperparams = [self._options.fused.hyperparams if self._options.fused is not None else {}]
        self._fused_optim: torch.optim.Optimizer
        if slots:  # both save whole tables as ShardedTensors (DCP re-shards them): see sharded_fused_optimizer
            self._fused_optim = ShardedEmbeddingFusedOptimizer(self, slots, states, groups, hyperparams)
        else:
            self._fused_optim = NoLocalShardsOptimizer(self, hyperparams)

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer:
        """The fused optimizer of this rank's shards (state per local shard; one param group per distinct fused
        optimizer of the tables, each the live hyperparameter dict of its tables; its ``state_dict`` holds whole
        tables as ShardedTensors)."""
        return self._fused_optim

    def _after_apply(self) -> None:
        """After a device move: re-pack the lookups' flat buffers, move the fused state along, re-point the fused
        optimizer's state views."""
        for sharding in self._shardings:
            sharding.lookup.ensure_packed()
            if sharding.lookup.groups:
                sharding.lookup.move_state(sharding.lookup.groups[0].table_group.weights.device)
        if isinstance(self._fused_optim, ShardedEmbeddingFusedOptimizer):
            self._fused_optim.rebuild_state_views()

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Every parameter of a sharded collection: sharded tables' shards and data-parallel replicas alike (the
        module all-reduces the replicas' gradients itself, so data parallelism must leave them alone)."""
        for name, _ in self.named_parameters(prefix=prefix):  # type: ignore[attr-defined]
            yield name


def _init_shard(target: torch.Tensor, shard: LocalShard, source: torch.Tensor) -> None:
    spec = shard.spec
    if target.numel() == 0:
        return
    if source.device.type != "meta":
        block = source.detach()[
            spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols
        ]
        target.copy_(block)
        return
    initialised = shard.table.config.init_fn(target)  # type: ignore[misc]
    if initialised is not None and initialised is not target:
        target.copy_(initialised)


class ListAwaitable(Awaitable[list[Any]]):
    """Waits a list of awaitables, in order."""

    def __init__(self, awaitables: list[Awaitable[Any]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> list[Any]:
        return [a.wait() for a in self._awaitables]


class InputDistAwaitable(Awaitable[Awaitable[list[KeyedJaggedTensor]]]):
    """Every sharding's input dist: waiting it finishes the first rounds (split sizes) and launches the second ones."""

    def __init__(self, awaitables: list[Awaitable[Awaitable[KeyedJaggedTensor]]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> Awaitable[list[KeyedJaggedTensor]]:
        return ListAwaitable([a.wait() for a in self._awaitables])


@contextlib.contextmanager
def input_dist_checks(shardings: Sequence[EmbeddingSharding], name: str) -> Iterator[None]:
    """Open every sharding's KJT all-to-all metadata check around a collection's own input checks. When this rank
    rejects its batch (a missing key, an id out of range), it still joins the checks the other ranks run for the
    same call, so they raise with it instead of waiting for a rank that never comes (within the checked calls).

    Opened last to first, so that a rank unwinding an error exchanges them first to last, the order in which the
    other ranks' all-to-alls exchange them. ``name`` names the collection's step in the checks' messages."""
    checked = [sharding for sharding in shardings if sharding.distributes_input]
    if not checked and shardings:
        # every table data-parallel: no all-to-all would carry a rejection to the peers, so one sharding's check
        # runs on its own (an all-gather of an "input ok" flag, in the checked calls only)
        checked = [shardings[0]]
    with contextlib.ExitStack() as stack:
        for sharding in reversed(checked):
            stack.enter_context(sharding.input_dist_check.call(sharding.input_dist_pg, name))
        yield


def run_input_dists(
    shardings: list[EmbeddingSharding], features: KeyedJaggedTensor, contexts: list[ShardingContext]
) -> InputDistAwaitable:
    return InputDistAwaitable([s.input_dist(features, c) for s, c in zip(shardings, contexts, strict=True)])


__all__ = [
    "InputDistAwaitable",
    "ListAwaitable",
    "NoLocalShardsOptimizer",
    "ShardedTablesMixin",
    "TableShards",
    "default_device",
    "input_dist_checks",
    "run_input_dists",
    "shard_param_name",
]
