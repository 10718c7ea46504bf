"""One ``run_ranks`` spawn per world size runs every rank-side suite of this folder; the test modules read the
cached results. Spawning costs seconds (each rank imports torch), the cases themselves milliseconds, so this keeps the
whole folder to two spawns plus the timeout test (which must leave its process group broken).

A suite that raises is recorded as ``{"error": traceback}`` instead of failing the spawn, so the other suites'
tests still report.

The ranks run the kernels' torch twins, not the Triton interpreter the rest of the suite uses: the comm layer has no
kernels of its own, the kernels it calls (permutes, codecs) are checked against their twins in their own tests, and
interpreting them in every rank would multiply this folder's time several-fold on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from dist_utils import run_ranks

from tests.distributed.bad_input_cases import run_bad_input_cases
from tests.distributed.codec_cases import run_codec_cases
from tests.distributed.comm_cases import build_op_cases, request_semantics, run_case
from tests.distributed.consistency_cases import run_consistency_cases
from tests.distributed.data_cases import run_data_cases
from tests.distributed.loader_cases import run_loader_cases
from tests.distributed.pg_cases import run_pg_cases

SPAWN_TIMEOUT_S = 240.0


def run_op_cases(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    results = {case.name: run_case(case, rank, world, dist.group.WORLD, "ints", None) for case in build_op_cases(world)}
    results["request_semantics"] = request_semantics(rank, world)
    return results


# suite name -> (rank-side function, world sizes it runs on)
Suites = dict[str, tuple[Callable[[int, int], Any], tuple[int, ...]]]

SUITES: Suites = {
    "ops": (run_op_cases, (2, 4)),
    "data": (run_data_cases, (2, 4)),
    "codecs": (run_codec_cases, (2,)),
    "bad_input": (run_bad_input_cases, (2,)),
    "pg": (run_pg_cases, (4,)),
    "loader": (run_loader_cases, (2, 4)),
    "consistency": (run_consistency_cases, (2,)),  # last: its refused calls must not disturb the others
}


def run_suites(suites: Suites, rank: int, world: int) -> dict[str, Any]:
    """On this rank, every suite listed for ``world``, in order: ``{name: result}``, or ``{"error": traceback}`` for
    a suite that raised (the later suites still run; a collective it left unmatched would show as their timeout)."""
    results: dict[str, Any] = {}
    for name, (suite, worlds) in suites.items():
        if world in worlds:
            try:
                results[name] = suite(rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
    return results


def results_of(per_rank_results: list[dict[str, Any]], suite: str, world: int) -> list[Any]:
    """Per rank, what ``suite`` returned; a suite that raised on any rank fails here with that rank's traceback."""
    per_rank = [results[suite] for results in per_rank_results]
    for rank, result in enumerate(per_rank):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"suite {suite!r} raised on rank {rank} of {world}:\n{result['error']}")
    return per_rank


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    return run_suites(SUITES, rank, world)


@contextlib.contextmanager
def _torch_twins_in_children() -> Iterator[None]:
    """Spawned ranks inherit the environment: without TRITON_INTERPRET=1 they dispatch to the torch twins."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_ranks`` with the ranks on the torch twins (see the module docstring)."""
    with _torch_twins_in_children():
        return run_ranks(fn, world, *args, **kwargs)


@functools.cache
def _all_results(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, world, timeout=SPAWN_TIMEOUT_S)


def suite_results(suite: str, world: int) -> list[Any]:
    """Per rank, what ``suite`` returned on ``world`` ranks (the spawn runs once per world size per session)."""
    return results_of(_all_results(world), suite, world)
