"""Sharded state on 2 gloo ranks: the state dict has the unsharded module's keys (ShardedTensors with global offsets;
data-parallel tables as plain tensors), loads an unsharded module's full state dict (each rank keeps its slice), is
gathered back to the unsharded state dict on one rank, and torch.distributed.checkpoint saves a trained module (weights
and fused rowwise Adagrad / Adam state) under one plan and loads it into a module under another plan, after which one
more identical step keeps both equal; the same from uneven column blocks (``column_wise(size_per_rank=...)``) and
uneven row blocks (``row_wise(sizes_placement=...)``, a rank holding no rows of a table).
Rank-side code: state_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("plan", ["mixed", "uneven", "uneven_rows"])
def test_state_dict_keys_load_unsharded_and_gather(plan: str) -> None:
    for rank, results in enumerate(suite_results("state", 2)):
        got = results["keys_and_load" if plan == "mixed" else f"keys_and_load_{plan}"]
        assert got["keys"], f"rank {rank}: state-dict keys differ from the unsharded module's"
        sharded = ("t0", "t1", "t3") if plan == "mixed" else ("t0", "t1", "t2", "t3")
        if plan == "mixed":
            assert got["types"]["embedding_bags.t2.weight"] == "Tensor"  # data parallel: the replica
        assert {got["types"][f"embedding_bags.{t}.weight"] for t in sharded} == {"ShardedTensor"}
        assert got["load_result"] == [[], []], f"rank {rank}: {got['load_result']}"
        assert got["sharded_tensor_local"]
        if rank == 0:
            assert got["gathered_keys"] and got["gathered"] == 0.0, got


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "uneven_adagrad", "uneven_rows_adam"])
def test_checkpoint_reshards_weights_and_optimizer_state(optimizer: str) -> None:
    for rank, results in enumerate(suite_results("state", 2)):
        got = results[f"dcp_{optimizer}"]
        assert got["weights"] == 0.0, f"rank {rank}: loaded weights differ by {got['weights']}"
        assert got["outputs"] <= 1e-6, f"rank {rank}: outputs after the load differ by {got['outputs']}"
        assert got["after_step"] <= 1e-6, f"rank {rank}: a step after the load differs by {got['after_step']}"
