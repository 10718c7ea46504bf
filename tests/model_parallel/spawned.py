"""One spawn per world size runs every rank-side suite of this folder; the test modules read the cached results
(the pattern of tests/distributed/spawned.py: spawning costs seconds, the cases milliseconds).

Ranks run the kernels' torch twins with one intra-op thread each. The 4-rank spawn simulates 2 nodes x 2 local ranks
(``LOCAL_WORLD_SIZE=2``) for table-row-wise sharding. Suites run in the order listed, the memory suite first (it
measures peak RSS, which the other suites would raise); the 2-rank spawn runs before the 4-rank one, whose checkpoint
suite loads what the 2-rank one saved (under :func:`checkpoint_root`).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

SPAWN_TIMEOUT_S = 480.0
LOCAL_WORLD_SIZE = {2: 2, 4: 2}


def _suites() -> dict[str, tuple[Callable[..., Any], tuple[int, ...]]]:
    from tests.model_parallel import api_cases, checkpoint_cases, dlrm_cases, fused_state_cases, in_backward_cases

    return {
        "memory": (api_cases.run_memory_suite, (2,)),
        "api": (api_cases.run_suite, (2,)),
        "dlrm": (dlrm_cases.run_suite, (2, 4)),
        "checkpoint_save": (checkpoint_cases.run_save_suite, (2,)),
        "fused_state": (fused_state_cases.run_suite, (2,)),
        "in_backward": (in_backward_cases.run_suite, (2,)),
        "checkpoint_reshard": (checkpoint_cases.run_reshard_suite, (4,)),
    }


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD_SIZE[world])
    import torch

    torch.set_num_threads(1)
    return run_suites(_suites(), rank, world)


@functools.cache
def checkpoint_root() -> str:
    """The directory the spawns' checkpoints go to (the children inherit it through the environment)."""
    from tests.model_parallel.checkpoint_cases import ROOT_ENV

    path = tempfile.mkdtemp(prefix="tritonrec-dmp-checkpoints-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[ROOT_ENV] = path
    return path


@functools.cache
def _all_results(world: int) -> list[dict[str, Any]]:
    checkpoint_root()
    if world == 4:
        _all_results(2)  # the 4-rank checkpoint suite loads what the 2-rank one saved
    return spawn_ranks(_run_suites, world, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str, world: int) -> list[Any]:
    """Per rank, what ``suite`` returned on ``world`` ranks (the spawn runs once per world size per session)."""
    return results_of(_all_results(world), suite, world)
