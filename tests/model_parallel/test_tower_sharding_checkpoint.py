"""Checkpoints of a tower-sharded model on 2 gloo ranks, one per host (rank-side code:
tower_sharding_checkpoint_cases.py; it runs in test_tower_sharding.py's spawn). A save after 2 steps, loaded by a
fresh DMP under the same plan and under the towers swapped between the hosts, continues training exactly as the
saved DMP did; ``gather_unsharded_state_dict`` assembles tables living on different host groups and interactions
living on one host each; the full unsharded state dict loads into a tower-sharded DMP."""

from __future__ import annotations

import pytest

from tests.model_parallel.test_tower_sharding import results
from tests.model_parallel.tower_sharding_checkpoint_cases import SAVED_AT

pytestmark = pytest.mark.dist


def test_gather_unsharded_state_dict_sees_every_towers_tables_and_interaction() -> None:
    got = results("checkpoint")
    assert got[0]["gather"] == 0.0, f"differs from the shard-by-shard gather by {got[0]['gather']} (inf: other keys)"
    assert got[1]["gather"] is None, "rank 1 is not the destination and must get None"


def test_checkpoint_read_as_plain_tensors_is_the_gathered_state() -> None:
    assert results("checkpoint")[0]["unsharded_file"] == 0.0


@pytest.mark.parametrize("plan", ["same_plan", "swapped_plan"])
def test_resume_continues_training_exactly(plan: str) -> None:
    for rank, got in enumerate(results("checkpoint")):
        resumed = got[plan]
        assert resumed["step"] == SAVED_AT, rank
        assert resumed["loss"] == 0.0, f"rank {rank}: the resumed losses differ by {resumed['loss']}"
        if rank == 0:
            assert resumed["differed_before"] > 1e-3, "the fresh model already had the saved weights"
            assert resumed["state"] == 0.0, f"the resumed state differs by {resumed['state']} (inf: other keys)"


def test_full_unsharded_state_dict_loads_into_the_tower_sharded_model() -> None:
    assert results("checkpoint")[0]["load_state_dict"] == 0.0
