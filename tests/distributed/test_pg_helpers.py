"""Process-group helpers: torchrun topology from the environment (in-process), node groups and leader calls on 4
gloo ranks laid out as 2 nodes x 2 ranks (pg_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.spawned import suite_results
from tritonrec.dist.comm import get_group_rank, get_local_rank, get_local_size, get_num_groups, is_leader

pytestmark = pytest.mark.dist


def test_topology_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    assert get_local_size(world_size=16) == 16  # no variables: one node
    assert get_local_rank(world_size=16, rank=5) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert get_local_size(world_size=16) == 4
    assert get_local_rank(world_size=16, rank=5) == 1  # no LOCAL_RANK: rank % local size
    assert get_group_rank(world_size=16, rank=5) == 1
    assert get_num_groups(world_size=16) == 4
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_local_rank(world_size=16, rank=5) == 3  # the launcher's word wins
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("MPI_LOCALNRANKS", "8")
    assert get_local_size(world_size=16) == 8
    assert is_leader(None) and not is_leader(None, leader_rank=1)


def test_node_groups_and_leader_calls_on_four_ranks() -> None:
    results = suite_results("pg", 4)
    for rank, r in enumerate(results):
        node, local = divmod(rank, 2)
        assert (r["local_size"], r["local_rank"], r["group_rank"], r["num_groups"]) == (2, local, node, 2), r
        assert r["intra_ranks"] == [2 * node, 2 * node + 1], r
        assert r["cross_ranks"] == [local, local + 2], r
        assert r["cached"], "a second call must return the same groups"
        assert r["timeouts"] == [True, True], "intra / cross groups keep the world's timeout (60 s here)"
        assert r["intra_sum"] == float(4 * node + 1), "all_reduce over the intra-node group"
        assert r["is_leader"] == (rank == 0)
        assert r["is_leader_of_intra_rank_1"] == (local == 1)
        assert r["broadcast"] == "invoke computed on global rank 2"
        assert r["broadcast_in_subgroup"] == f"cross computed on global rank {local + 2}"
        assert r["decorated"] == "leader computed on global rank 3"
