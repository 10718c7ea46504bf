"""``dmp.fused_optimizer.state_dict()`` holds whole tables as ShardedTensors, so plain ``torch.distributed.checkpoint``
saves and loads it exactly - under the same plan and across a re-shard (rank-side code: fused_state_cases.py). With
plain per-rank tensors DCP kept one rank's momentum and loaded it on every rank (silently with equal shard sizes,
a size error otherwise). ``load_state_dict`` without DCP takes the same plan's state, an unsharded model's, and
refuses another plan's on every rank (a rank that went on would wait for the others' per-row state)."""

from __future__ import annotations

import pytest

from tests.model_parallel.fused_state_cases import CASES, case_name
from tests.model_parallel.spawned import suite_results

pytestmark = pytest.mark.dist
WORLD = 2


@pytest.mark.parametrize(("optim", "saved", "loaded"), CASES, ids=[case_name(*c) for c in CASES])
def test_dcp_round_trip_of_the_fused_optimizer_state_dict_is_exact(optim: str, saved: str, loaded: str) -> None:
    results = [r[case_name(optim, saved, loaded)] for r in suite_results("fused_state", WORLD)]
    # a rank may hold no per-row state (column-wise: the first column block's holder saves it)
    assert {t for got in results for t in got["types"]} == {"ShardedTensor"}, [got["types"] for got in results]
    for rank, got in enumerate(results):
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        assert got["mismatches"] == [], f"rank {rank}: loaded state differs from the saved in {got['mismatches']}"
        assert got["lr"] == 0.1, f"rank {rank}: the saved param_groups were not loaded (lr {got['lr']})"


def test_load_state_dict_takes_the_same_plan_and_an_unsharded_state_and_refuses_a_bad_one() -> None:
    for rank, got in enumerate(r["direct"] for r in suite_results("fused_state", WORLD)):
        assert got["same_plan"] == [], f"rank {rank}: {got['same_plan']}"
        assert got["from_unsharded"] == [], f"rank {rank}: {got['from_unsharded']}"
        assert got["from_unsharded_lr"] == 0.1
        assert got["to_unsharded"] == [] and got["back_to_sharded"] == [], f"rank {rank}: {got}"
        assert got["snapshot_moved"] and got["snapshot_restored"] == [], f"rank {rank}: state_dict() is not a copy"
        assert got["bad_shape"] == "state embedding_bags.t0.weight.momentum1 has shape (3, 8), expected (40, 8)"
        assert got["bad_wrote"] == [], f"rank {rank}: a refused load wrote {got['bad_wrote']}"
    other_plan = [r["direct"]["other_plan"] for r in suite_results("fused_state", WORLD)]
    prefix = "optimizer 'sparse_arch.embedding_bag_collection': "
    assert other_plan[0].startswith(prefix + "embedding_bags.t0.weight.momentum1: the ShardedTensor's local shards")
    assert "load a checkpoint of another sharding with torch.distributed.checkpoint" in other_plan[0]
    assert other_plan[1] == prefix + "fused optimizer load_state_dict: another rank refused the state (see its error)"
