"""Pipelined training equals TrainPipelineBase bit for bit (loss of every step, every weight and the fused
optimizer state after 20 steps) for TW and RW on 2 gloo ranks: TrainPipelineSparseDist with and without the host
batch thread, StagedTrainPipeline, and a staged pipeline with a user stage. Each pipelined run really prefetched:
batch k+1's input dist started before batch k's lookup, which the base pipeline never does. A model with a second
collection (fed the batch, or a KJT computed in the forward) trains exactly too, and so does a sequence model on a
sharded EmbeddingCollection and a feature-processed EBC (collection_cases.py). Rank-side code: pipeline_cases.py.
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
        # the real collections' input dists run on a side group: the step's agreement is read during the forward
        assert got["defers"], f"rank {rank}: the ranks agreed before the forward"


def test_staged_skipping_a_batch_then_a_new_iterator_equals_base_bit_for_bit() -> None:
    """A stage returning None for batch 3 skips it (the input dists stay in step with the forwards), and a new
    iterator after the end refills the pipeline: 9 + 5 steps, as the base pipeline on the same batches."""
    for rank, results in enumerate(suite_results("exact")):
        got = results["tw-staged_skip_new_iterator"]
        assert len(got["losses"]) == 14, f"rank {rank}: {len(got['losses'])} steps"
        assert got["losses"] == got["base_losses"], f"rank {rank}: losses differ from the base pipeline"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"


@pytest.mark.parametrize("kind", ["tw", "rw"])
def test_base_pipeline_does_not_prefetch_input_dist(kind: str) -> None:
    for results in suite_results("exact"):
        assert results[f"{kind}-base"] == {"prefetched": False, "steps": STEPS}


def test_ranks_train_different_batches() -> None:
    """The comparison is not vacuous: each rank sees its own data, and losses move."""
    ranks = suite_results("exact")
    assert ranks[0]["tw-sparse_dist"]["losses"] != ranks[1]["tw-sparse_dist"]["losses"]
    assert len(set(ranks[0]["tw-sparse_dist"]["losses"])) > STEPS // 2


@pytest.mark.parametrize(("run", "deferred"), [("two_collections-computed", False), ("two_collections-batch", True)])
def test_a_collection_fed_a_computed_input_trains_exactly_and_stops_the_deferral(run: str, deferred: bool) -> None:
    """ebc2 fed a KJT computed in the forward runs its own input dist there, on the input-dist group ebc1's launch
    ahead uses: the pipeline pipelines ebc1 only and agrees before the forward; fed the batch's KJT, both are
    pipelined and the agreement runs during the forward. Either way training equals the base pipeline."""
    pipelined = ["ebc1"] if run.endswith("computed") else ["ebc1", "ebc2"]
    for rank, results in enumerate(suite_results("exact")):
        got = results[run]
        assert len(got["losses"]) == 8 and got["losses"] == got["base_losses"], f"rank {rank}: losses differ"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"
        assert got["pipelined"] == pipelined and got["deferred"] is deferred, f"rank {rank}: {got}"


COLLECTION_RUNS = [
    f"{c}-{k}-{p}" for c in ("ec", "fp_fused", "fp_dense") for k in ("tw", "rw") for p in ("sparse_dist", "staged")
] + ["ebc_weighted-mixed-sparse_dist", "ebc_weighted-mixed-staged"]
INT32_RUNS = [f"ebc_int32-{k}-{p}" for k in ("tw", "rw") for p in ("sparse_dist", "staged")]
PIPELINED = {"ec": "ec", "fp": "fp", "ebc": "model.sparse_arch.embedding_bag_collection"}


@pytest.mark.parametrize("run", COLLECTION_RUNS + INT32_RUNS)
def test_other_collections_pipelined_equal_base_bit_for_bit(run: str) -> None:
    """A sharded EmbeddingCollection (a sequence model), a feature-processed EBC (position weights; fused and dense
    tables) and a weighted EBC on a mixed plan (TW, RW, CW, DP) under the pipelines: prefetched, and exact."""
    for rank, results in enumerate(suite_results("collections")):
        got = results[run]
        assert len(got["losses"]) == 10, f"rank {rank}: {len(got['losses'])} steps"
        assert got["losses"] == got["base_losses"], f"rank {rank}: losses differ from the base pipeline"
        assert got["differ"] == [], f"rank {rank}: weights or optimizer state differ: {got['differ']}"
        assert got["pipelined"] == [PIPELINED[run.split("-")[0].split("_")[0]]], f"rank {rank}: {got['pipelined']}"


@pytest.mark.parametrize("run", INT32_RUNS)
def test_int32_ids_train_as_int64_ids(run: str) -> None:
    for rank, results in enumerate(suite_results("collections")):
        got = results[run]
        assert got["base_losses"] == got["int64_losses"], f"rank {rank}: int32 ids trained differently"
