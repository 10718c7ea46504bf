"""TrainPipelineSemiSync on 2 gloo ranks (rank-side code: semi_sync_cases.py; one spawn for this module).

Before ``start_batch`` it trains exactly as TrainPipelineSparseDist (losses and every weight, bit for bit); after,
as a plain single-process loop whose lookups read the tables one update behind (TW, RW, and with stashed dense
gradients); the data's end drains or stops 2 batches early, uneven ends stop every rank together, and a lookup
that raises on one rank raises on every rank.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

pytestmark = pytest.mark.dist

WORLD = 2
TOL = 1e-5  # the reference sums in another order: float32 rounding over 10 steps


def _run_suites(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.train_pipeline import semi_sync_cases

    torch.set_num_threads(1)
    suites = {
        "sync": (semi_sync_cases.sync_cases, (WORLD,)),
        "reference": (semi_sync_cases.reference_cases, (WORLD,)),
        "end": (semi_sync_cases.end_cases, (WORLD,)),
        "lookup_failure": (semi_sync_cases.lookup_failure_cases, (WORLD,)),  # last: leaves an output dist unmatched
    }
    return run_suites(suites, rank, world)


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn_ranks(_run_suites, WORLD, timeout=240.0)


def suite(name: str) -> list[Any]:
    return results_of(_results(), name, WORLD)


@pytest.mark.parametrize("kind", ["tw", "rw"])
def test_before_start_batch_equals_sparse_dist_bit_for_bit(kind: str) -> None:
    for rank, results in enumerate(suite("sync")):
        got = results[kind]
        assert len(got["base"]) == 10, f"rank {rank}: {len(got['base'])} steps"
        assert got["late"] == got["base"], f"rank {rank}: losses differ from TrainPipelineSparseDist"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"
        assert got["pipelined"] == ["model.sparse_arch.embedding_bag_collection"], f"rank {rank}: {got['pipelined']}"


@pytest.mark.parametrize("kind", ["tw", "rw"])
def test_semi_sync_departs_from_sparse_dist_after_start_batch(kind: str) -> None:
    """Batches 0-4 read up-to-date tables (batch 4's lookup is the last synchronous one), batch 5 on do not."""
    for rank, results in enumerate(suite("sync")):
        got = results[kind]
        assert got["semi_4"][:5] == got["base"][:5], f"rank {rank}: the synchronous steps differ"
        assert all(a != b for a, b in zip(got["semi_4"][5:], got["base"][5:], strict=True)), f"rank {rank}"
        assert got["differ_4"], f"rank {rank}: the stale run ended with the same weights"


@pytest.mark.parametrize("case", ["tw", "rw", "tw_stash"])
def test_after_start_batch_equals_the_stale_reference_loop(case: str) -> None:
    for rank, results in enumerate(suite("reference")):
        got = results[case]
        assert got["steps"] == 10 and got["pipelined"] == ["ebc"], f"rank {rank}: {got}"
        assert got["diff"]["losses"] < TOL, f"rank {rank}: losses off the reference by {got['diff']}"
        assert got["diff"]["dense"] < TOL, f"rank {rank}: dense parameters off by {got['diff']}"
        if rank == 0:  # the tables are gathered on rank 0
            assert got["diff"]["tables"] < TOL, f"tables off the reference by {got['diff']}"
        # the comparison can fail: a reference without staleness is far from the run
        assert got["vs_fresh"]["losses"] > 100 * TOL, f"rank {rank}: staleness did not change the losses"


@pytest.mark.parametrize(("case", "steps"), [("drain", 5), ("uneven", 4)])
def test_the_end_of_data_drains_or_stops_two_early_on_every_rank_together(case: str, steps: int) -> None:
    for rank, results in enumerate(suite("end")):
        got = results[case]
        assert got["steps"] == steps, f"rank {rank}: {got['steps']} steps"
        assert got["diff"] < TOL, f"rank {rank}: losses off the reference by {got['diff']}"
        assert got["no_drain"] == steps - 2, f"rank {rank}: {got['no_drain']} steps without execute_all_batches"


def test_without_execute_all_batches_a_new_iterator_trains_the_batches_left_in_flight() -> None:
    for rank, results in enumerate(suite("end")):
        got = results["resume"]
        assert got["again"] == "StopIteration", f"rank {rank}: the same iterator again raised {got['again']}"
        assert got["steps"] == 6, f"rank {rank}: {got['steps']} steps (3 + 3 expected)"
        assert got["diff"] < TOL, f"rank {rank}: losses off the reference on the joined stream by {got['diff']}"


def test_a_lookup_failing_on_one_rank_raises_on_every_rank() -> None:
    ranks = suite("lookup_failure")
    assert ranks[1]["type"] == "ValueError" and "lookup broke" in ranks[1]["message"], ranks[1]
    assert ranks[0]["type"] == "PipelineStageError", ranks[0]
    assert "start_embedding_lookup" in ranks[0]["message"] and "lookup broke" in ranks[0]["message"], ranks[0]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 9, ranks
