"""One spawn per world size runs every rank-side suite of this folder; the test modules read the cached results
(the pattern of tests/distributed/spawned.py: spawning costs seconds, the cases milliseconds).

Ranks run the kernels' torch twins with one intra-op thread each: on a small shared machine, two ranks each
spinning a thread pool make every tiny op take milliseconds. The 4-rank spawn simulates 2 nodes x 2 local ranks
(``LOCAL_WORLD_SIZE=2``), which table-row-wise and grid sharding need.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

from tests.distributed.spawned import spawn_ranks

SPAWN_TIMEOUT_S = 480.0
LOCAL_WORLD_SIZE = {2: 2, 4: 2}


def _suites() -> dict[str, tuple[Callable[[int, int], Any], tuple[int, ...]]]:
    from tests.sharding import ebc_cases, ec_cases, fp_cases, misc_cases, state_cases, wire_cases

    return {
        "ebc": (ebc_cases.run_suite, (2, 4)),
        "ec": (ec_cases.run_suite, (2,)),
        "misc": (misc_cases.run_suite, (2,)),
        "wire": (wire_cases.run_suite, (2,)),
        "fp": (fp_cases.run_suite, (2,)),
        "state": (state_cases.run_suite, (2,)),
    }


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD_SIZE[world])
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, (suite, worlds) in _suites().items():
        if world in worlds:
            try:
                results[name] = suite(rank, world)
            except Exception:  # reported per suite; a collective mismatch after this would show as a timeout
                results[name] = {"error": traceback.format_exc()}
    return results


@functools.cache
def _all_results(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, world, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str, world: int) -> list[Any]:
    """Per rank, what ``suite`` returned on ``world`` ranks (the spawn runs once per world size per session)."""
    per_rank = [results[suite] for results in _all_results(world)]
    for rank, result in enumerate(per_rank):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"suite {suite!r} raised on rank {rank} of {world}:\n{result['error']}")
    return per_rank
