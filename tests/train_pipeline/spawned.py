"""One 2-rank spawn runs every rank-side suite of this folder; the test modules read the cached results (the
pattern of tests/distributed/spawned.py). Ranks run the torch twins with one intra-op thread each.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

from tests.distributed.spawned import spawn_ranks

SPAWN_TIMEOUT_S = 300.0
WORLD = 2


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.train_pipeline import pipeline_cases

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    # the error cases run last: a rank that failed may leave a collective unmatched on the main group
    for name, suite in (("exact", pipeline_cases.exact_cases), ("end", pipeline_cases.end_cases),
                        ("errors", pipeline_cases.error_cases)):  # fmt: skip
        try:
            results[name] = suite(rank, world)
        except Exception:  # reported per suite
            results[name] = {"error": traceback.format_exc()}
    return results


@functools.cache
def _all_results() -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, WORLD, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str) -> list[Any]:
    """Per rank, what ``suite`` returned (the spawn runs once per session)."""
    per_rank = [results[suite] for results in _all_results()]
    for rank, result in enumerate(per_rank):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"suite {suite!r} raised on rank {rank}:\n{result['error']}")
    return per_rank
