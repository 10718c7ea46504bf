"""One 2-rank spawn runs every rank-side suite of this folder; the test modules read the cached results (the
pattern of tests/distributed/spawned.py). Ranks run the torch twins with one intra-op thread each.
"""

from __future__ import annotations

import functools
from typing import Any

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

SPAWN_TIMEOUT_S = 300.0
WORLD = 2


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.train_pipeline import accumulation_cases, collection_cases, pipeline_cases, pipeline_error_cases

    torch.set_num_threads(1)
    # the error cases run last: a rank that failed may leave a collective unmatched on the main group
    suites = {
        "exact": (pipeline_cases.exact_cases, (WORLD,)),
        "end": (pipeline_cases.end_cases, (WORLD,)),
        "collections": (collection_cases.collection_cases, (WORLD,)),
        "accumulation": (accumulation_cases.accumulation_cases, (WORLD,)),
        "errors": (pipeline_error_cases.error_cases, (WORLD,)),
    }
    return run_suites(suites, rank, world)


@functools.cache
def _all_results() -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, WORLD, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str) -> list[Any]:
    """Per rank, what ``suite`` returned (the spawn runs once per session)."""
    return results_of(_all_results(), suite, WORLD)
