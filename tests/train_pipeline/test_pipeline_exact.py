"""Pipelined training equals TrainPipelineBase bit for bit (loss of every step, every weight and the fused
optimizer state after 20 steps) for TW and RW on 2 gloo ranks: TrainPipelineSparseDist with and without the host
batch thread, StagedTrainPipeline, and a staged pipeline with a user stage. Each pipelined run really prefetched:
batch k+1's input dist started before batch k's lookup, which the base pipeline never does. Rank-side code:
pipeline_cases.py.
"""

from __future__ import annotations

import pytest

from tests.train_pipeline.pipeline_cases import STEPS
from tests.train_pipeline.spawned import suite_results

pytestmark = pytest.mark.dist

RUNS = [f"{kind}-{name}" for kind in ("tw", "rw") for name in ("sparse_dist", "sparse_dist_no_thread", "staged")]


@pytest.mark.parametrize("run", [*RUNS, "tw-staged_extra_stage"])
def test_pipelined_training_equals_base_bit_for_bit(run: str) -> None:
    for rank, results in enumerate(suite_results("exact")):
        got = results[run]
        assert len(got["losses"]) == STEPS, f"rank {rank}: {len(got['losses'])} steps"
        assert got["losses"] == got["base_losses"], f"rank {rank}: losses differ from the base pipeline"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"
        assert got["pipelined"] == ["model.sparse_arch.embedding_bag_collection"], f"rank {rank}: {got['pipelined']}"
        assert got["prefetched"], f"rank {rank}: batch k+1's input dist did not start before batch k's lookup"


@pytest.mark.parametrize("kind", ["tw", "rw"])
def test_base_pipeline_does_not_prefetch_input_dist(kind: str) -> None:
    for results in suite_results("exact"):
        assert results[f"{kind}-base"] == {"prefetched": False, "steps": STEPS}


def test_ranks_train_different_batches() -> None:
    """The comparison is not vacuous: each rank sees its own data, and losses move."""
    ranks = suite_results("exact")
    assert ranks[0]["tw-sparse_dist"]["losses"] != ranks[1]["tw-sparse_dist"]["losses"]
    assert len(set(ranks[0]["tw-sparse_dist"]["losses"])) > STEPS // 2
