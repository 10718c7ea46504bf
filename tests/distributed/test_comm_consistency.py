"""Ranks that disagree on a collective's metadata get a ValueError on every rank, naming the collective, the field
and each rank's value, before any data moves: both the disagreements a backend cannot see (equal byte counts, which
used to mix data silently) and those it can (which used to abort the processes inside gloo). Rank-side code:
consistency_cases.py; the spawn: spawned.py."""

from __future__ import annotations

import pytest

from tests.distributed.consistency_cases import ABORTING_CASES, SILENT_CASES, WORLD
from tests.distributed.spawned import suite_results

pytestmark = pytest.mark.dist

# case -> fragments every rank's message must hold
EXPECTED: dict[str, tuple[str, ...]] = {
    "pooled/dims_and_batch": (
        "alltoall_pooled: ranks disagree",
        "batch_size_per_rank: rank 0 = [2, 4], rank 1 = [2, 2]",
        "dim_sum_per_rank: rank 0 = [2, 4], rank 1 = [4, 4]",
    ),
    "kjt/splits": ("KJTAllToAll: ranks disagree", "splits: rank 0 = [1, 2], rank 1 = [2, 1]"),
    "kjt/keys": ("KJTAllToAll: ranks disagree", "keys: rank 0 = ['a', 'b', 'c'], rank 1 = ['b', 'a', 'c']"),
    "pooled/batch_sizes": ("alltoall_pooled", "batch_size_per_rank: rank 0 = [2, 2], rank 1 = [3, 1]"),
    "alltoallv/out_split": ("alltoallv", "out_split: rank 0 = [1, 1], rank 1 = [1, 2]"),
    "sequence/splits": (
        "alltoall_sequence",
        "rank 0 sends 2 rows to rank 1 (its output_splits[1]) but rank 1 expects 1 (its input_splits[0])",
    ),
    "reduce_scatter_v/splits": ("reduce_scatter_v_pooled", "input_splits: rank 0 = [2, 2], rank 1 = [3, 1]"),
    "reduce_scatter_module/branch": (
        "ranks call different collectives",
        "rank 0: PooledEmbeddingsReduceScatter / reduce_scatter_base_pooled",
        "rank 1: PooledEmbeddingsReduceScatter / reduce_scatter_v_pooled",
    ),
    "variable_batch/batch_sizes": (
        "variable_batch_alltoall_pooled",
        "rank 0 sends 4 values to rank 1",
        "rank 1 expects 2",
    ),
}


@pytest.mark.parametrize("case", [*SILENT_CASES, *ABORTING_CASES])
def test_disagreeing_metadata_raises_on_every_rank(case: str) -> None:
    outcomes = [results[case] for results in suite_results("consistency", WORLD)]
    if case == "one_rank_rejects_its_input":
        (error0, message0), (error1, message1) = outcomes
        assert error0 == "ValueError" and "a2a_pooled_embs_tensor has 5 rows" in message0, message0
        assert error1 == "ValueError", f"rank 1: {error1}: {message1}"
        assert "rank 0 rejected its input" in message1 and "a2a_pooled_embs_tensor has 5 rows" in message1, message1
        return
    for rank, (error, message) in enumerate(outcomes):
        assert error == "ValueError", f"rank {rank} raised {error}: {message}"
        for fragment in EXPECTED[case]:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"
    assert outcomes[0][1] == outcomes[1][1], "every rank reports the same disagreement"


def test_group_is_healthy_after_the_refused_calls() -> None:
    per_rank = [results["healthy_after_refusals"] for results in suite_results("consistency", WORLD)]
    assert per_rank == [[0.0, 11.0], [2.0, 13.0]]


def test_first_calls_of_a_module_are_checked_then_none_unless_asked() -> None:
    for counts in suite_results("consistency", WORLD):
        error, message = counts["check_counts"]["default_first_call"]
        assert error == "ValueError" and "dim_sum_per_rank: rank 0 = [1, 1], rank 1 = [1, 2]" in message, message
        assert counts["check_counts"]["None"] == 8  # default: the first 8 calls of the instance
        assert counts["check_counts"]["1"] == 18  # TRITONREC_DIST_CHECKS=1: every call
        assert counts["check_counts"]["0"] == 18  # TRITONREC_DIST_CHECKS=0: none
        assert counts["check_counts"]["calls"] == 31
        error, message = counts["check_counts"]["bad_value"]
        assert error == "ValueError" and "TRITONREC_DIST_CHECKS must be '0' or '1'" in message, message
