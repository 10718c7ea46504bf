"""Checkpoints of a tower-sharded model on 2 gloo ranks, one per host (rank-side code:
tower_sharding_checkpoint_cases.py; it runs in test_tower_sharding.py's spawn), for the collection sharder and for
``EmbeddingTowerSharder`` sharding each tower on its own. A save after 2 steps, loaded by a fresh DMP under the same
plan and under the towers swapped between the hosts, continues training exactly as the saved DMP did;
``gather_unsharded_state_dict`` assembles tables living on different host groups and interactions living on one host
each; the full unsharded state dict loads into a tower-sharded DMP. The ``check_*`` helpers are shared with the
2-hosts-of-2 checkpoints (test_tower_sharding_hosts_checkpoint.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.model_parallel.test_tower_sharding import results
from tests.model_parallel.tower_sharding_checkpoint_cases import SAVED_AT

pytestmark = pytest.mark.dist

# suite -> what shards the towers
SUITES = ["checkpoint", "tower_sharder_checkpoint"]


def check_gather(got: list[Any]) -> None:
    assert got[0]["gather"] == 0.0, f"differs from the shard-by-shard gather by {got[0]['gather']} (inf: other keys)"
    assert all(r["gather"] is None for r in got[1:]), "only rank 0 is the destination: the others must get None"


def check_unsharded_file(got: list[Any]) -> None:
    assert got[0]["unsharded_file"] == 0.0, f"the file read as plain tensors differs by {got[0]['unsharded_file']}"


def check_resume(got: list[Any], plan: str) -> None:
    for rank, result in enumerate(got):
        resumed = result[plan]
        assert resumed["step"] == SAVED_AT, rank
        assert resumed["loss"] == 0.0, f"rank {rank}: the resumed losses differ by {resumed['loss']}"
        if rank == 0:
            assert resumed["differed_before"] > 1e-3, "the fresh model already had the saved weights"
            assert resumed["state"] == 0.0, f"the resumed state differs by {resumed['state']} (inf: other keys)"


def check_load_state_dict(got: list[Any]) -> None:
    assert got[0]["load_state_dict"] == 0.0, f"the loaded state differs by {got[0]['load_state_dict']}"


@pytest.mark.parametrize("suite", SUITES)
def test_gather_unsharded_state_dict_sees_every_towers_tables_and_interaction(suite: str) -> None:
    check_gather(results(suite))


@pytest.mark.parametrize("suite", SUITES)
def test_checkpoint_read_as_plain_tensors_is_the_gathered_state(suite: str) -> None:
    check_unsharded_file(results(suite))


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("plan", ["same_plan", "swapped_plan"])
def test_resume_continues_training_exactly(suite: str, plan: str) -> None:
    check_resume(results(suite), plan)


@pytest.mark.parametrize("suite", SUITES)
def test_full_unsharded_state_dict_loads_into_the_tower_sharded_model(suite: str) -> None:
    check_load_state_dict(results(suite))
