"""Proposers pick one :class:`ShardingOption` per table (torchrec's protocol): ``load(search_space)``, then
``propose()`` -> a list of options or ``None`` when done, and ``feedback(partitionable, plan, perf_rating,
storage_constraint)`` after the planner tried to place the proposal.

* :class:`GreedyProposer`: each table's fastest option first; then, one step at a time, the table whose current
  option needs the most storage moves to its next-fastest option (trading speed for room).
* :class:`UniformProposer`: one proposal per sharding type, every table sharded that way (its fastest kernel).
* :class:`GridSearchProposer`: every combination, when there are at most ``max_proposals`` (the exhaustive search
  the planner-quality benchmark measures against).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

from tritonrec.dist.planner.types import Perf, ShardingOption, Topology
from tritonrec.kernels.checks import check_int, check_optional_int

logger = logging.getLogger(__name__)

MAX_PROPOSALS = 10_000

__all__ = ["MAX_PROPOSALS", "GreedyProposer", "GridSearchProposer", "UniformProposer", "option_score"]


def option_score(option: ShardingOption, use_depth: bool = True) -> float:
    """An option's estimated cost: its slowest shard (``use_depth``) or the sum over its shards."""
    totals = [(shard.perf or Perf()).total for shard in option.shards]
    return max(totals) if use_depth else sum(totals)


def _by_table(search_space: list[ShardingOption]) -> dict[str, list[ShardingOption]]:
    grouped: dict[str, list[ShardingOption]] = {}
    for option in search_space:
        grouped.setdefault(option.fqn, []).append(option)
    return grouped


class GreedyProposer:
    """See module docstring. ``threshold``: stop after that many proposals in a row without a better rating."""

    def __init__(self, use_depth: bool = True, threshold: int | None = None) -> None:
        threshold = check_optional_int(threshold, "threshold", 1)
        self._use_depth = use_depth
        self._threshold = threshold
        self._options: dict[str, list[ShardingOption]] = {}
        self._current: dict[str, int] = {}
        self._best_rating = math.inf
        self._inferior = 0

    def load(self, search_space: list[ShardingOption], enumerator: Any = None) -> None:
        self._options = _by_table(search_space)
        for options in self._options.values():
            options.sort(key=lambda o: option_score(o, self._use_depth))
        self._current = {fqn: 0 for fqn in self._options}
        self._best_rating, self._inferior = math.inf, 0

    def propose(self) -> list[ShardingOption] | None:
        if not self._current:
            return None
        return [self._options[fqn][i] for fqn, i in self._current.items()]

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if self._threshold is not None and perf_rating is not None:
            self._inferior += 1
            if perf_rating < self._best_rating:
                self._best_rating, self._inferior = perf_rating, 0
            if self._inferior > self._threshold:
                self._current = {}
                return
        largest_fqn, largest = None, (-1, -1, -1, -1)
        for fqn, options in self._options.items():
            index = self._current[fqn]
            if index + 1 < len(options):
                shards = [s.storage for s in options[index].shards if s.storage is not None]
                hbm, ddr = [s.hbm for s in shards] or [0], [s.ddr for s in shards] or [0]
                size = (max(hbm), sum(hbm), max(ddr), sum(ddr))
                if size > largest:
                    largest_fqn, largest = fqn, size
        if largest_fqn is None:
            self._current = {}
        else:
            self._current[largest_fqn] += 1


class UniformProposer:
    """See module docstring (sharding types some table lacks are skipped)."""

    def __init__(self, use_depth: bool = True) -> None:
        self._use_depth = use_depth
        self._proposals: list[list[ShardingOption]] = []
        self._index = 0

    def load(self, search_space: list[ShardingOption], enumerator: Any = None) -> None:
        tables = list(_by_table(search_space))
        by_type: dict[str, dict[str, list[ShardingOption]]] = {}
        for option in search_space:
            by_type.setdefault(option.sharding_type, {}).setdefault(option.fqn, []).append(option)
        self._proposals = [
            [min(per_table[fqn], key=lambda o: option_score(o, self._use_depth)) for fqn in tables]
            for per_table in by_type.values()
            if set(per_table) == set(tables)
        ]
        self._index = 0

    def propose(self) -> list[ShardingOption] | None:
        return self._proposals[self._index] if self._index < len(self._proposals) else None

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        self._index += 1


class GridSearchProposer:
    """See module docstring; proposes nothing (and logs why) when the product of the per-table option counts
    exceeds ``max_proposals``."""

    def __init__(self, max_proposals: int = MAX_PROPOSALS) -> None:
        max_proposals = check_int(max_proposals, "max_proposals", 1)
        self._max_proposals = max_proposals
        self._options: list[list[ShardingOption]] = []
        self._combinations: Any = iter(())
        self._next: tuple[int, ...] | None = None
        self.num_combinations = 0

    def load(self, search_space: list[ShardingOption], enumerator: Any = None) -> None:
        self._options = list(_by_table(search_space).values())
        for options in self._options:
            options.sort(key=option_score)
        self.num_combinations = math.prod(len(options) for options in self._options)
        if self.num_combinations > self._max_proposals:
            # DEBUG: the planner's other proposers usually plan anyway; when none proposes, its error says this
            logger.debug(
                "grid search skipped: %d combinations exceed max_proposals=%d",
                self.num_combinations,
                self._max_proposals,
            )
            self._combinations = iter(())
        else:
            self._combinations = itertools.product(*(range(len(options)) for options in self._options))
        self._next = next(self._combinations, None)

    @property
    def max_proposals(self) -> int:
        return self._max_proposals

    def propose(self) -> list[ShardingOption] | None:
        if self._next is None:
            return None
        return [options[i] for options, i in zip(self._options, self._next, strict=True)]

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        self._next = next(self._combinations, None)
