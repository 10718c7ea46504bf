"""Gradient accumulation on 2 gloo ranks (rank-side code: accumulation_cases.py): the sparse-dist pipeline under
GradientAccumulationWrapper skips DDP's sync inside each window and still trains as a loop that syncs every
micro-batch; a partial last window and uneven ends leave the dense replicas bit-identical across ranks."""

from __future__ import annotations

import pytest

from tests.train_pipeline.spawned import suite_results


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case", "count", "steps", "synced"),
    # windows of 3: the first micro-batch and each window's last sync; warmup 3 of windows of 4: the first 3 too
    [("partial_window", 7, [3], [1, 3, 6]), ("warmup", 8, [2], [1, 2, 3, 4, 8])],
)
def test_accumulated_training_equals_the_synced_loop(case: str, count: int, steps: list[int], synced: list) -> None:
    for rank, results in enumerate(suite_results("accumulation")):
        got = results[case]
        assert got["count"] == count and got["steps"] == steps, f"rank {rank}: {got}"
        assert got["synced"] == synced, f"rank {rank}: DDP all-reduced in micro-batches {got['synced']}"
        assert got["loss"] < 1e-6 and got["weights"] < 1e-6, f"rank {rank}: {got}"
        assert got["replicas_equal"], f"rank {rank}: the dense replicas drifted apart"


@pytest.mark.dist
def test_uneven_ends_step_the_partial_window_on_synced_gradients() -> None:
    for rank, results in enumerate(suite_results("accumulation")):
        got = results["uneven"]
        assert got["count"] == 5 and got["steps"] == [2], f"rank {rank}: {got}"
        assert got["replicas_equal"], f"rank {rank}: the dense replicas drifted apart"


@pytest.mark.dist
def test_the_flush_all_reduces_only_what_ddp_synchronises() -> None:
    """Table-wise shards on the dense kernel are no DDP parameters: the partial window's flush leaves them alone."""
    for rank, results in enumerate(suite_results("accumulation")):
        got = results["dense_tables"]
        assert got["loss"] < 1e-6 and got["weights"] < 1e-6, f"rank {rank}: {got}"
        assert got["replicas_equal"], f"rank {rank}: the dense replicas drifted apart"


@pytest.mark.dist
def test_the_flush_all_reduces_a_parameter_one_rank_did_not_use() -> None:
    for rank, results in enumerate(suite_results("accumulation")):
        assert results["unused_on_one_rank"]["replicas_equal"], f"rank {rank}: the replicas drifted apart"


@pytest.mark.dist
def test_the_flush_all_reduces_a_sparse_gradient() -> None:
    for rank, results in enumerate(suite_results("accumulation")):
        got = results["sparse_gradient"]
        assert got["replicas_equal"] and got["weights"] < 1e-6, f"rank {rank}: {got}"
