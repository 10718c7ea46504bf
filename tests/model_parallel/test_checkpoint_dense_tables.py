"""Checkpoints of plain collections on the dense kernel trained by a dense optimizer (rank-side code:
dense_table_checkpoint_cases.py): the optimizer state of the table shards is saved per table as ShardedTensors, so
training resumes exactly under the same plan and, to rounding, under another; and in one process from the file."""

from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest

from tests.distributed.spawned import spawn_ranks
from tests.model_parallel.dense_table_checkpoint_cases import dense_table_checkpoints

pytestmark = pytest.mark.dist


@functools.cache
def _results() -> tuple[str, list[dict]]:
    root = tempfile.mkdtemp(prefix="dense_tables_")
    return root, spawn_ranks(dense_table_checkpoints, 2, root, timeout=180)


def test_a_rank_with_two_blocks_of_a_table_holds_two_parameters() -> None:
    _, results = _results()
    assert results[0]["shards"] == ["ebc.embedding_bags.t1.weight", "ebc.embedding_bags.t1.weight_1"]
    assert results[1]["shards"] == []


def test_resuming_under_the_same_plan_is_exact() -> None:
    for rank, result in enumerate(_results()[1]):
        assert result["resumed_a"] == result["uninterrupted"], rank


def test_resuming_under_another_plan_matches_to_rounding() -> None:
    for rank, result in enumerate(_results()[1]):
        np.testing.assert_allclose(result["resumed_b"], result["uninterrupted"], rtol=1e-5, err_msg=f"rank {rank}")


def test_an_unsharded_model_in_one_process_resumes_from_it() -> None:
    """No process group: the tables' Adam state comes back whole from the per-table ShardedTensors, and training on
    both ranks' batches (the mean of their losses, as DMP averages) continues both ranks' losses."""
    import torch

    from tests.model_parallel.dense_table_checkpoint_cases import RESUMED, SAVED_AT, batch, unsharded
    from tritonrec.dist.checkpoint import load_checkpoint

    root, results = _results()
    model = unsharded()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    load_checkpoint(f"{root}/dense_tables", model, {"dense": optimizer})
    losses: list[list[float]] = [[], []]
    for step in range(SAVED_AT, SAVED_AT + RESUMED):
        optimizer.zero_grad()
        per_rank = [model(batch(rank, step)) for rank in (0, 1)]
        ((per_rank[0] + per_rank[1]) / 2).backward()
        optimizer.step()
        for rank in (0, 1):
            losses[rank].append(float(per_rank[rank].detach()))
    for rank in (0, 1):
        np.testing.assert_allclose(losses[rank], results[rank]["uninterrupted"], rtol=1e-5, err_msg=f"rank {rank}")
