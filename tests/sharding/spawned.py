"""One spawn per world size runs every rank-side suite of this folder; the test modules read the cached results
(the pattern of tests/distributed/spawned.py: spawning costs seconds, the cases milliseconds).

Ranks run the kernels' torch twins with one intra-op thread each: on a small shared machine, two ranks each
spinning a thread pool make every tiny op take milliseconds. The 4-rank spawn simulates 2 nodes x 2 local ranks
(``LOCAL_WORLD_SIZE=2``), which table-row-wise and grid sharding need.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

SPAWN_TIMEOUT_S = 480.0
LOCAL_WORLD_SIZE = {2: 2, 4: 2}


def _suites() -> dict[str, tuple[Callable[[int, int], Any], tuple[int, ...]]]:
    from tests.sharding import (
        dp_zero_cases,
        ebc_cases,
        ec_cases,
        fp_cases,
        misc_cases,
        shared_cases,
        state_cases,
        wire_cases,
    )

    return {
        "ebc": (ebc_cases.run_suite, (2, 4)),
        "ec": (ec_cases.run_suite, (2,)),
        "misc": (misc_cases.run_suite, (2,)),
        "wire": (wire_cases.run_suite, (2,)),
        "fp": (fp_cases.run_suite, (2,)),
        "state": (state_cases.run_suite, (2,)),
        "shared": (shared_cases.run_suite, (2,)),
        "dp_zero": (dp_zero_cases.run_suite, (2,)),
    }


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD_SIZE[world])
    import torch

    torch.set_num_threads(1)
    return run_suites(_suites(), rank, world)


@functools.cache
def _all_results(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, world, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str, world: int) -> list[Any]:
    """Per rank, what ``suite`` returned on ``world`` ranks (the spawn runs once per world size per session)."""
    return results_of(_all_results(world), suite, world)
