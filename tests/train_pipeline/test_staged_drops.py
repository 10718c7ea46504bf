"""StagedTrainPipeline when the ranks drop different batches (a filter stage on each rank's own data), on 2 gloo
ranks: a batch any rank drops is dropped on every rank, so both ranks hand out the same batches, and training equals
TrainPipelineBase on the batches every rank kept, bit for bit (losses, weights, fused optimizer state).

Before the rule, only the dropping rank skipped the batch: with the drop before the input-dist stage one rank waited
in the step's agreement and the other in the input dist's all-to-all until killed; after it, the output dist's
all-to-all hit the collective timeout; and the same drop on every rank after the input dist started left its
context queued, so each later batch trained on the previous one's sparse features, silently.
Rank-side code: staged_drop_cases.py; one spawn for the module."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import spawn_ranks
from tests.train_pipeline.staged_drop_cases import CASES, COUNT, dropped_by_any, run_drop_cases

pytestmark = pytest.mark.dist

WORLD = 2


@functools.cache
def _spawned() -> tuple[list[dict[str, Any]] | None, str]:
    """The ranks' results, or why the spawn failed: kept either way, so a hung spawn costs its timeout once, not
    once per test."""
    try:
        return spawn_ranks(run_drop_cases, WORLD, timeout=180.0, pg_timeout_s=60.0), ""
    except (AssertionError, TimeoutError) as error:
        return None, f"{type(error).__name__}: {error}"


def _results() -> list[dict[str, Any]]:
    results, error = _spawned()
    if results is None:
        pytest.fail(f"the 2-rank spawn failed: {error}")
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_dropped_on_any_rank_is_dropped_on_every_rank_and_training_is_exact(case: str) -> None:
    kept = [k for k in range(COUNT) if k not in dropped_by_any(case)]
    for rank, results in enumerate(_results()):
        got = results[case]
        assert "error" not in got, f"rank {rank} raised:\n{got.get('error')}"
        assert got["trained"] == kept, f"rank {rank} trained batches {got['trained']}, want {kept}"
        assert got["losses"] == got["base_losses"], f"rank {rank}: losses differ from the base pipeline"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"
        assert got["in_flight"] == 0, f"rank {rank}: {got['in_flight']} input dists left in flight"


def test_a_flush_with_different_drops_ends_at_the_same_step_on_every_rank() -> None:
    """The flush requested after 3 steps empties the pipeline before the refill, on both ranks: of the batches in
    flight (3 to 6), 3 and 5 train, 4 and 6 (dropped by rank 0 and rank 1) do not."""
    assert [results["flush"]["flushes"] for results in _results()] == [[5], [5]]
