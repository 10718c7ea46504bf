"""Tower sharding on 4 gloo ranks as 2 hosts of 2 ranks (``LOCAL_WORLD_SIZE=2``): each tower's tables are sharded
over its host's two ranks and its interaction is replicated on them under DDP over the host group (torchrec's
hierarchical DDP). Hand-written plans (towers in order and swapped) and the planner's plan train equal to the
single-process model on the global batch, and the gathered state dict is the reference's. One spawn; rank-side code:
tower_sharding_host_cases.py (the model: tower_sharding_cases.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import results_of, run_suites, spawn_ranks
from tests.model_parallel.test_tower_sharding import DENSE_KEYS, TOLERANCE, TOWER_KEYS, TOWER_TABLES_OF

pytestmark = pytest.mark.dist

WORLD = 4
SPAWN_TIMEOUT_S = 300.0


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.model_parallel import tower_sharding_host_cases

    torch.set_num_threads(1)
    suites: dict[str, Any] = {name: (case, (WORLD,)) for name, case in tower_sharding_host_cases.CASES.items()}
    return run_suites(suites, rank, world)


@functools.cache
def _spawned() -> list[dict[str, Any]]:
    """One spawn for this module and test_tower_sharding_hosts_checkpoint.py (its checkpoint and pipeline suites)."""
    from tests.model_parallel.tower_sharding_checkpoint_cases import make_checkpoint_root

    make_checkpoint_root()
    return spawn_ranks(_run, WORLD, timeout=SPAWN_TIMEOUT_S)


def results(case: str) -> list[Any]:
    """Per rank, what rank-side case ``case`` returned (the module's spawn runs once per session)."""
    return results_of(_spawned(), case, WORLD)


def _host_of_tower(case: str, tower: int) -> int:
    return {"in_order": tower, "swapped": 1 - tower}[case]


@pytest.mark.parametrize("case", ["in_order", "swapped", "planner"])
def test_two_hosts_of_two_train_like_the_single_process_model(case: str) -> None:
    per_rank = results(case)
    for rank, got in enumerate(per_rank):
        assert got["loss"] <= TOLERANCE, f"rank {rank}: the loss differs by {got['loss']}"
        assert got["params"] <= TOLERANCE, f"rank {rank}: interaction / dense parameters differ by {got['params']}"
    assert per_rank[0]["keys_equal"], "the ranks' state-dict keys together are not the unsharded model's"
    assert per_rank[0]["state_dict"] <= TOLERANCE, f"the gathered state differs by {per_rank[0]['state_dict']}"
    assert per_rank[0]["moved"] > 1e-4, "some weight did not train: the comparison would not test the sharded update"


@pytest.mark.parametrize("case", ["in_order", "swapped"])
def test_each_tower_lives_on_both_ranks_of_its_host_only(case: str) -> None:
    for rank, got in enumerate(results(case)):
        tower = next(t for t in range(2) if _host_of_tower(case, t) == rank // 2)
        assert got["interactions"] == [k for k in TOWER_KEYS[tower] if ".interaction." in k], rank
        assert got["local_keys"] == sorted(DENSE_KEYS + TOWER_KEYS[tower]), rank
        # both tables of the host's tower have a shard on this rank (row-wise / column-wise inside the host)
        planned = got["planned"]
        assert all(rank in planned[t] for t in TOWER_TABLES_OF[tower]), planned


def test_planner_keeps_each_tower_on_one_host() -> None:
    per_rank = results("planner")
    planned = per_rank[0]["planned"]
    assert all(r["planned"] == planned for r in per_rank), "the ranks got different plans"
    hosts = [{rank // 2 for table in tables for rank in planned[table]} for tables in TOWER_TABLES_OF]
    assert all(len(h) == 1 for h in hosts), planned
    assert hosts[0] != hosts[1], f"both towers on one host: {planned}"
