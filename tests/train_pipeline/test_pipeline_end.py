"""End of data and failures on 2 gloo ranks: every rank stops at the same step (5 batches each; 6 on rank 0 and 4 on
rank 1), execute_all_batches drains the pipeline (or stops 2 batches early without it, before the forward, and a new
iterator trains on), the eval pipeline runs every batch with the unpipelined model's outputs, and a data loader or
stage that raises on one rank makes every rank raise (the failing one its own error, the others PipelineStageError
naming it) instead of hanging, also when it is an input dist launched ahead (which leaves the model's own process
group in step), with or without a second collection running its own input dist in the forward; after such a failure
the same model trains on. Rank-side code: pipeline_cases.py, pipeline_error_cases.py.
"""

from __future__ import annotations

import pytest

from tests.train_pipeline.spawned import suite_results

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(("case", "steps"), [("drain", 5), ("uneven", 4)])
def test_every_rank_stops_at_the_same_step(case: str, steps: int) -> None:
    for rank, results in enumerate(suite_results("end")):
        got = results[case]
        assert len(got["base"]) == steps, f"rank {rank}: base ran {len(got['base'])} steps"
        assert got["sparse_dist"] == got["base"], f"rank {rank}: sparse_dist losses differ from base"
        assert got["differ"] == [], f"rank {rank}: weights differ: {got['differ']}"
        assert got["staged"] == steps, f"rank {rank}: staged ran {got['staged']} steps"
        assert got["eval_steps"] == steps, f"rank {rank}: eval ran {got['eval_steps']} batches"
        assert got["eval_equal"], f"rank {rank}: eval pipeline outputs differ from the model's"


@pytest.mark.parametrize(("case", "steps"), [("drain", 5), ("uneven", 4)])
def test_without_execute_all_batches_the_last_two_batches_are_dropped(case: str, steps: int) -> None:
    for results in suite_results("end"):
        assert results[case]["no_drain"] == results[case]["base"][: steps - 2]


@pytest.mark.parametrize(("case", "steps"), [("drain", 5), ("uneven", 4)])
def test_without_execute_all_batches_the_stop_comes_before_the_forward_and_a_new_iterator_trains_on(
    case: str, steps: int
) -> None:
    """As torchrec: StopIteration before the forward of the batch in line (deferring the agreement to after the
    forward ran one forward too many and left the pipeline broken), again on the next call, and a new iterator trains
    the 2 batches in flight, then its own, like the base pipeline on the same sequence."""
    for rank, results in enumerate(suite_results("end")):
        got = results[case]["no_drain_resume"]
        assert got["forwards"] == steps - 2, f"rank {rank}: {got['forwards']} forwards for {steps - 2} steps"
        assert got["again"] == "StopIteration", f"rank {rank}: the next call raised {got['again']}"
        assert got["equal"], f"rank {rank}: losses after the new iterator differ from the base pipeline's"
        assert got["differ"] == [], f"rank {rank}: weights differ: {got['differ']}"


@pytest.mark.parametrize(("pipeline", "failing_rank", "error", "stage"), [
    ("base", 1, "ValueError", "next_batch"),
    ("sparse_dist", 1, "ValueError", "next_batch"),
    ("staged", 0, "RuntimeError", "process"),
    ("input_dist", 1, "ValueError", "start_sparse_data_dist"),
    # a second collection runs its own input dist in the forward: the ranks must agree before it
    ("two_collections", 1, "ValueError", "start_sparse_data_dist"),
])  # fmt: skip
def test_a_failure_on_one_rank_raises_on_every_rank(pipeline: str, failing_rank: int, error: str, stage: str) -> None:
    for rank, results in enumerate(suite_results("errors")):
        got = results[pipeline]
        if rank == failing_rank:
            assert got["type"] == error, got
        else:
            assert got["type"] == "PipelineStageError", got
            assert f"'{stage}' failed on rank(s) [{failing_rank}]" in got["message"], got["message"]
            # the failing rank's own error, exchanged at the agreement: this rank's log shows the root cause
            assert f"rank {failing_rank} raised {error}: " in got["message"], got["message"]


def test_an_input_dist_rejected_within_its_checked_calls_raises_on_every_rank_without_a_collective() -> None:
    """Rank 1 rejects batch 4 inside its input dist, before the all-to-all whose metadata check rank 0 runs: rank 1
    joins that check with its error (the collection opens the checks around its own input checks), so rank 0
    raises naming rank 1's error instead of waiting for it."""
    failed, other = (results["input_dist_checked"] for results in reversed(suite_results("errors")))
    assert failed["type"] == "ValueError" and "missing keys ['f3']" in failed["message"], failed
    assert other["type"] == "ValueError", other
    assert "rank 1 rejected its input (ValueError: features is missing keys ['f3']" in other["message"], other


def test_after_a_failed_input_dist_the_model_group_still_pairs_collectives() -> None:
    """Input dists run on a group of their own (dist/side_groups.py): rank 0 launched batch 12's, rank 1 failed
    before launching it, and an all-reduce on the model's group afterwards still adds both ranks' values (on the
    model's group, rank 0's unmatched input dist made that all-reduce time out)."""
    assert [results["probe"] for results in suite_results("errors")] == [3.0, 3.0]


def test_after_a_failed_input_dist_a_new_model_trains_as_before() -> None:
    """Rank 0's unmatched input dist (batch 12, sparse_dist; then the same in a staged pipeline whose input-dist
    stage is a lambda) stays on the input-dist group the ranks renew when they agree on the failure: a model built
    afterwards in the same processes trains with losses equal to a clean run's before any failure, and a model built
    before it has moved to the new group."""
    results = suite_results("errors")
    failed, other = (r["staged_input_dist"] for r in reversed(results))
    assert failed["type"] == "ValueError" and "missing keys ['f3']" in failed["message"], failed
    assert other["type"] == "PipelineStageError" and "start_sparse_data_dist" in other["message"], other
    assert [r["after_input_dist"] for r in results] == [True, True]
    assert [r["after_staged_input_dist"] for r in results] == [True, True]
    # the same with the step's agreement deferred into the forward (the util's method as the stage)
    failed, other = (r["staged_input_dist_deferred"] for r in reversed(results))
    assert failed["type"] == "ValueError" and "missing keys ['f3']" in failed["message"], failed
    assert other["type"] == "PipelineStageError" and "start_sparse_data_dist" in other["message"], other
    assert [r["after_staged_deferred"] for r in results] == [True, True]
    # a sharding built before the failures now sends on the renewed group, which pairs collectives
    assert [(r["kept_sharding_follows"], r["kept_group_sum"]) for r in results] == [(True, 3.0), (True, 3.0)]


@pytest.mark.parametrize("failure", ["data", "input_dist"])
@pytest.mark.parametrize("how", ["reset", "new_pipeline"])
def test_the_failed_pipelines_model_trains_on_after_a_failure(failure: str, how: str) -> None:
    """After rank 1's loader raised (batch 4) or its input dist did (batch 12), the same model trains on, through
    the same pipeline after ``reset()`` or a new one: losses and every weight equal TrainPipelineBase on a fresh model
    given the batches whose ``progress`` returned (11 and 2), then the new ones: a failed step applies no update."""
    for rank, results in enumerate(suite_results("errors")):
        got = results["recovery"][failure]
        assert got[f"{how}_error"] == ("ValueError" if rank == 1 else "PipelineStageError"), got
        assert got[f"{how}_done"] == {"data": 2, "input_dist": 11}[failure], got
        assert got[f"{how}_equal"], f"rank {rank}: losses after the failure differ from the reference"
        assert got[f"{how}_differ"] == [], f"rank {rank}: weights differ: {got[f'{how}_differ']}"


def test_pipeline_stage_error_survives_pickling() -> None:
    """A spawned rank's error reaches the launching process pickled: the stage, the failed ranks and the message
    must come back (the default pickled only the message, and the error did not unpickle at all)."""
    import pickle

    from tritonrec.dist.train_pipeline.agreement import PipelineStageError

    causes = {1: "ValueError: bad row"}
    error = pickle.loads(pickle.dumps(PipelineStageError("input_dist", [1, 3], 0, causes)))
    assert isinstance(error, PipelineStageError)
    assert (error.stage, error.failed_ranks, error.rank, error.causes) == ("input_dist", [1, 3], 0, causes)
    assert "failed on rank(s) [1, 3]; rank 1 raised ValueError: bad row; rank 0 stops" in str(error)
