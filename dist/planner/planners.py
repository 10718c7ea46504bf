"""``EmbeddingShardingPlanner``: enumerate every way to shard every table, reserve storage, let the proposers pick
one option per table, place each proposal on the ranks, rate it with the perf model, keep the fastest; turn it into
a :class:`~tritonrec.dist.types.ShardingPlan` built by the same generators as hand-written plans.

``plan(module, sharders)`` plans in this process (prints the stats table on rank 0); ``collective_plan(module,
sharders, pg)`` plans on rank 0 and broadcasts, so every rank gets the identical plan (or the identical error);
``candidate_plans(module, sharders, proposer)`` returns every distinct placed plan with its estimate (with a
:class:`GridSearchProposer`: the exhaustive search a planner-quality benchmark measures against).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.planner.enumerators import EmbeddingEnumerator, check_sharders
from tritonrec.dist.planner.partitioners import GreedyPerfPartitioner
from tritonrec.dist.planner.perf_models import EmbeddingPerfModel
from tritonrec.dist.planner.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from tritonrec.dist.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from tritonrec.dist.planner.stats import EmbeddingStats, format_bytes
from tritonrec.dist.planner.storage_reservations import HeuristicalStorageReservation
from tritonrec.dist.planner.types import (
    BATCH_SIZE,
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Storage,
    Topology,
)
from tritonrec.dist.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from tritonrec.dist.types import ModuleSharder, ShardingPlan, ShardingType
from tritonrec.kernels.checks import check_int


def _nothing_proposed_error(proposers: list[Any]) -> PlannerError:
    """No proposer proposed anything: name the grid searches that skipped themselves (too many combinations)."""
    skipped = [p for p in proposers if isinstance(p, GridSearchProposer) and p.num_combinations > p.max_proposals]
    if skipped:
        grid = skipped[0]
        return PlannerError(
            f"no plan was proposed: the grid search has {grid.num_combinations} combinations, over its "
            f"max_proposals={grid.max_proposals}; pass proposer=GridSearchProposer(max_proposals=...) with a larger "
            "cap, or another proposer (GreedyProposer, UniformProposer)",
            PlannerErrorType.PARTITION,
        )
    names = ", ".join(type(p).__name__ for p in proposers)
    return PlannerError(f"no plan was proposed: the proposers ({names}) proposed nothing", PlannerErrorType.PARTITION)


__all__ = ["CandidatePlan", "EmbeddingShardingPlanner", "to_sharding_plan"]

# grid search first when the space is small: it finds the model's optimum; the greedy proposers cover larger spaces
DEFAULT_GRID_PROPOSALS = 1000


@dataclass
class CandidatePlan:
    """One placed plan: the plan, its estimated step time (seconds) and per-rank storage (bytes)."""

    plan: ShardingPlan
    estimated_step_s: float
    storage_per_rank: list[Storage]
    options: list[ShardingOption]

    def sharding_types(self) -> dict[str, str]:
        """Table -> its sharding type."""
        return {option.fqn: option.sharding_type for option in self.options}


def _generator(option: ShardingOption, local_size: int) -> ParameterShardingGenerator:
    ranks = [shard.rank for shard in option.shards]
    kernel, kind = option.compute_kernel, ShardingType(option.sharding_type)
    if kind == ShardingType.DATA_PARALLEL:
        return data_parallel(kernel)
    if kind == ShardingType.TABLE_WISE:
        return table_wise(ranks[0], compute_kernel=kernel)  # type: ignore[arg-type]
    if kind == ShardingType.ROW_WISE:
        return row_wise(compute_kernel=kernel)
    if kind == ShardingType.COLUMN_WISE:
        return column_wise(ranks, compute_kernel=kernel)  # type: ignore[arg-type]
    if kind == ShardingType.TABLE_COLUMN_WISE:
        return table_column_wise(ranks, kernel)  # type: ignore[arg-type]
    if kind == ShardingType.TABLE_ROW_WISE:
        return table_row_wise(ranks[0] // local_size, kernel)  # type: ignore[operator]
    hosts = [ranks[i] // local_size for i in range(0, len(ranks), local_size)]  # type: ignore[operator]
    return grid_shard(hosts, kernel)


def to_sharding_plan(options: list[ShardingOption], topology: Topology) -> ShardingPlan:
    """The :class:`ShardingPlan` of placed options (every table of a module must be among them)."""
    by_module: dict[str, list[ShardingOption]] = {}
    for option in options:
        by_module.setdefault(option.path, []).append(option)
    plan = ShardingPlan()
    for path, module_options in by_module.items():
        module, sharder = module_options[0].module[1], module_options[0].sharder
        generators = {o.name: _generator(o, topology.local_world_size) for o in module_options}
        module_plan = construct_module_sharding_plan(
            module, generators, sharder, topology.local_world_size, topology.world_size, topology.compute_device
        )
        for option in module_options:
            module_plan[option.name].stochastic_rounding = option.stochastic_rounding
            module_plan[option.name].bounds_check_mode = option.bounds_check_mode
        plan.plan[path] = module_plan
    return plan


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class EmbeddingShardingPlanner:
    """Chooses a sharding plan (torchrec's arguments; every one optional).

    Args:
        topology: the machines (default: the default process group's world size, cuda if available).
        batch_size: samples per rank per step (default 512).
        enumerator: lists and estimates the options (default :class:`EmbeddingEnumerator` with the perf and
            storage estimators).
        storage_reservation: default :class:`HeuristicalStorageReservation` (15 % of each rank + dense part).
        proposer: one proposer or a list (default: grid search when at most 1000 combinations, two greedy orders,
            uniform).
        partitioner: default :class:`GreedyPerfPartitioner`.
        performance_model: default :class:`EmbeddingPerfModel`.
        stats: one stats printer or a list (default :class:`EmbeddingStats` printing to stdout; ``[]`` for none).
        constraints: table name -> :class:`ParameterConstraints`.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: EmbeddingEnumerator | None = None,
        storage_reservation: HeuristicalStorageReservation | None = None,
        proposer: Any = None,
        partitioner: GreedyPerfPartitioner | None = None,
        performance_model: EmbeddingPerfModel | None = None,
        stats: Any = None,
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        if topology is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            topology = Topology(world, "cuda" if torch.cuda.is_available() else "cpu")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        self._topology = topology
        self._batch_size = BATCH_SIZE if batch_size is None else check_int(batch_size, "batch_size", 1)
        self._constraints = constraints
        self._enumerator = enumerator or EmbeddingEnumerator(
            topology,
            self._batch_size,
            constraints,
            estimator=[EmbeddingPerfEstimator(topology, constraints), EmbeddingStorageEstimator(topology, constraints)],
        )
        self._storage_reservation = storage_reservation or HeuristicalStorageReservation()
        if proposer is None:
            proposer = [
                GridSearchProposer(DEFAULT_GRID_PROPOSALS),
                GreedyProposer(),
                GreedyProposer(use_depth=False),
                UniformProposer(),
            ]
        self._proposers = list(proposer) if isinstance(proposer, (list, tuple)) else [proposer]
        self._partitioner = partitioner or GreedyPerfPartitioner()
        self._perf_model = performance_model or EmbeddingPerfModel(topology)
        if stats is None:
            stats = [EmbeddingStats()]
        self._stats = list(stats) if isinstance(stats, (list, tuple)) else [stats]
        self.last_candidate: CandidatePlan | None = None

    @property
    def topology(self) -> Topology:
        return self._topology

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[Any]]) -> ShardingPlan:
        """The fastest plan found for every table ``sharders`` cover in ``module`` (an empty plan when none).
        Raises :class:`PlannerError` naming the table, the need and the capacity when no plan fits."""
        start = time.perf_counter()
        candidates, counts, reservation = self._explore(module, sharders, self._proposers, keep_all=False)
        if counts is None:  # nothing to shard
            return ShardingPlan()
        best = candidates[0]
        self.last_candidate = best
        if _this_rank() == 0:
            for stats in self._stats:
                stats.log(
                    best.options,
                    self._topology,
                    self._batch_size,
                    self._perf_model,
                    reservation,
                    counts[0],
                    counts[1],
                    time.perf_counter() - start,
                )
        return best.plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[Any]],
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plan on rank 0 of ``pg`` (default: the world) and broadcast: every rank returns the same plan, or raises
        the same error."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("collective_plan needs an initialised torch.distributed process group; use plan()")
        group = pg if pg is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world != self._topology.world_size:
            raise ValueError(f"the process group has {world} ranks but the topology has {self._topology.world_size}")
        payload: list[Any] = [None]
        failure: BaseException | None = None
        if dist.get_rank(group) == 0:
            try:
                payload = [self.plan(module, sharders)]
            except Exception as err:  # sent to the other ranks too, which must not wait for a plan forever
                failure = err
                known = isinstance(err, (PlannerError, ValueError, TypeError))
                payload = [err if known else RuntimeError(f"planning failed on rank 0: {type(err).__name__}: {err}")]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        if failure is not None:
            raise failure
        if isinstance(payload[0], Exception):
            raise payload[0]
        return payload[0]

    def candidate_plans(
        self, module: nn.Module, sharders: list[ModuleSharder[Any]], proposer: Any = None
    ) -> list[CandidatePlan]:
        """Every distinct placed plan the proposer(s) lead to (default: grid search up to 10,000 combinations),
        fastest first by the perf model."""
        proposers = proposer if proposer is not None else GridSearchProposer()
        proposers = list(proposers) if isinstance(proposers, (list, tuple)) else [proposers]
        candidates, _, _ = self._explore(module, sharders, proposers, keep_all=True)
        return candidates

    def _explore(
        self, module: nn.Module, sharders: list[ModuleSharder[Any]], proposers: list[Any], keep_all: bool
    ) -> tuple[list[CandidatePlan], tuple[int, int] | None, Any]:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        sharders = check_sharders(sharders)
        search_space = self._enumerator.enumerate(module, sharders)
        if not search_space:
            return [], None, None
        constraint = self._storage_reservation.reserve(
            self._topology, self._batch_size, module, sharders, self._constraints
        )
        reservation = getattr(self._storage_reservation, "last_reservation", None)
        found: dict[tuple[Any, ...], tuple[float, list[ShardingOption]]] = {}
        tried: dict[tuple[int, ...], tuple[bool, list[ShardingOption] | None, float | None]] = {}
        best_rating, last_error, proposals = math.inf, None, 0
        for proposer in proposers:
            proposer.load(search_space, self._enumerator)
        for proposer in proposers:
            proposal = proposer.propose()
            while proposal:
                key = tuple(sorted(id(option) for option in proposal))
                if key not in tried:
                    proposals += 1
                    try:
                        placed = self._partitioner.partition(proposal, constraint)
                        rating = self._perf_model.rate(placed)
                        tried[key] = (True, placed, rating)
                        signature = tuple(
                            (
                                o.fqn,
                                o.sharding_type,
                                o.compute_kernel,
                                o.num_column_shards,
                                tuple(s.rank for s in o.shards),
                            )
                            for o in placed
                        )
                        if keep_all or rating < best_rating:
                            found[signature] = (rating, placed)
                            best_rating = min(best_rating, rating)
                    except PlannerError as err:
                        last_error, tried[key] = err, (False, None, None)
                proposer.feedback(*tried[key], constraint)
                proposal = proposer.propose()
        if not found and proposals == 0:
            raise _nothing_proposed_error(proposers)
        if not found:
            raise self._no_plan_error(search_space, constraint, last_error)
        ordered = sorted(found.values(), key=lambda item: item[0])
        if not keep_all:
            ordered = ordered[:1]
        candidates = [self._candidate(options, rating) for rating, options in ordered]
        return candidates, (proposals, sum(ok for ok, _, _ in tried.values())), reservation

    def _candidate(self, options: list[ShardingOption], rating: float) -> CandidatePlan:
        storage = [Storage() for _ in range(self._topology.world_size)]
        for option in options:
            for shard in option.shards:
                storage[shard.rank] = storage[shard.rank] + (shard.storage or Storage())  # type: ignore[index]
        return CandidatePlan(to_sharding_plan(options, self._topology), rating, storage, options)

    def _no_plan_error(
        self, search_space: list[ShardingOption], constraint: Topology, last_error: PlannerError | None
    ) -> PlannerError:
        """The most specific reason: a table too big for any rank, tables too big for all ranks together, or the
        last placement failure."""
        kind = self._topology.storage_kind
        capacity = self._topology.hbm_cap if kind == "hbm" else self._topology.ddr_cap
        free = max(d.storage.kind(kind) for d in constraint.devices)
        total_free = sum(max(0, d.storage.kind(kind)) for d in constraint.devices)
        where = f"(capacity {format_bytes(capacity)} per rank minus {format_bytes(capacity - free)} reserved)"
        smallest_shard: dict[str, tuple[int, ShardingOption]] = {}
        smallest_total: dict[str, int] = {}
        for option in search_space:
            largest = max((s.storage or Storage()).kind(kind) for s in option.shards)
            if option.fqn not in smallest_shard or largest < smallest_shard[option.fqn][0]:
                smallest_shard[option.fqn] = (largest, option)
            total = option.total_storage.kind(kind)
            smallest_total[option.fqn] = min(total, smallest_total.get(option.fqn, total))
        need, option = max(smallest_shard.values(), key=lambda item: item[0])
        if need > free:
            return PlannerError(
                f"table {option.name!r} does not fit: its most compact option ({option.sharding_type}, "
                f"{option.compute_kernel}) needs {need} bytes ({format_bytes(need)}) of {kind} on one rank, but a "
                f"rank has {free} bytes ({format_bytes(free)}) for tables {where}",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        need_total = sum(smallest_total.values())
        if need_total > total_free:
            biggest = max(smallest_total, key=lambda name: smallest_total[name])
            return PlannerError(
                f"the tables need at least {need_total} bytes ({format_bytes(need_total)}) of {kind} in total - the "
                f"largest, table {biggest!r}, {smallest_total[biggest]} bytes - but the {self._topology.world_size} "
                f"ranks have {total_free} bytes ({format_bytes(total_free)}) for tables {where}",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        detail = f": {last_error}" if last_error is not None else ""
        return PlannerError(f"no proposal could be placed on the ranks{detail}", PlannerErrorType.PARTITION)
