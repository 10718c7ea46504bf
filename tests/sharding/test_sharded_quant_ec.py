"""ShardedQuantEmbeddingCollection on 2 gloo ranks (one spawn for this module; rank-side code: quant_ec_cases.py):
for table-wise, row-wise, uneven row-wise, column-wise and mixed plans and INT8 / INT4 / mixed INT8-FP16-INT4-INT2
tables, each rank's output equals the unsharded QuantEC's on that rank's batch bit for bit, and the dequantized
tables indexed by the ids; ``need_indices`` and an fp16 ``output_dtype``; DMP's default sharders and planner; the
state dict round trip (unsharded -> sharded -> unsharded, and sharded -> sharded); refused plans, by name."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.spawned import spawn_ranks
from tests.sharding.quant_ec_cases import data_types, plans, quant_ec, run_suite

SPAWN_TIMEOUT_S = 240.0
TABLE_ORDER = ["f0", "f1@t0", "f2", "f3", "f1@t3"]  # one sharding type: module (table) order
# sharding types in first-appearance order (row-wise t0; table-wise t1, t3; column-wise t2), tables in module order
MIXED_ORDER = ["f0", "f1@t0", "f2", "f1@t3", "f3"]


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # two ranks on a small machine: see tests/sharding/spawned.py
    return run_suite(rank, world)


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, 2, timeout=SPAWN_TIMEOUT_S)


FORWARD_CASES = [f"{p}-{t}" for p in plans() for t in data_types()] + ["need_indices-fp16"]


@pytest.mark.dist
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_sharded_quant_ec_matches_unsharded(case: str) -> None:
    for rank, results in enumerate(_results()):
        got = results["forward"][case]
        assert got["values_equal"], f"rank {rank}: rows differ from the unsharded QuantEC's (must be bit-exact)"
        assert got["reference_equal"], f"rank {rank}: rows differ from the dequantized tables indexed by the ids"
        assert got["lengths_equal"] and got["weights_equal"], f"rank {rank}: lengths or need_indices weights differ"
        assert sorted(got["keys"]) == sorted(got["expected_keys"]), f"rank {rank}: keys {got['keys']}"
        order = MIXED_ORDER if case.startswith(("mixed", "need_indices")) else TABLE_ORDER
        assert got["keys"] == order, f"rank {rank}: key order {got['keys']}"
        assert got["dtype"] == ("torch.float16" if case == "need_indices-fp16" else "torch.float32")


@pytest.mark.dist
def test_dmp_default_sharders_shard_a_quant_ec() -> None:
    for rank, results in enumerate(_results()):
        got = results["dmp"]
        assert got["sharded"] and got["kernels"] == ["quant"], f"rank {rank}: {got}"
        assert got["values_equal"] and got["reference_equal"] and got["lengths_equal"], f"rank {rank}: {got}"


@pytest.mark.dist
@pytest.mark.parametrize("plan", list(plans()))
def test_state_dict_round_trip(plan: str) -> None:
    for rank, results in enumerate(_results()):
        got = results["state"][plan]
        assert got["keys"], f"rank {rank}: state-dict keys differ from the unsharded module's"
        assert got["differs_before"], f"rank {rank}: the two modules already agreed (the load test cannot fail)"
        assert got["from_unsharded"], f"rank {rank}: loading the unsharded state dict did not reach the lookups"
        assert got["bytes_back"], f"rank {rank}: the gathered shards are not the unsharded module's bytes"
        assert got["unsharded_back"], f"rank {rank}: an unsharded module loading them differs"
        assert got["same_plan"], f"rank {rank}: a same-plan sharded state dict did not load"
        assert got["gathered"] is True, f"rank {rank}: gather_unsharded_state_dict: {got['gathered']}"


@pytest.mark.dist
def test_misaligned_int2_column_block_is_refused() -> None:
    for rank, results in enumerate(_results()):
        got = results["refusals"]["int2_odd_block"]
        assert "table 't0': an INT2 column block must start on a multiple of 4 columns" in got, f"rank {rank}: {got}"


@pytest.mark.dist
def test_sharded_over_a_sub_group_saves_and_loads_its_state_dict() -> None:
    got = _results()[1]["subgroup"]  # the placements name global rank 1, not group rank 0
    assert "error" not in got, got.get("error")
    assert got["round_trip"], "a sub-group's sharded state dict did not load into a second sharded module"


# ------------------------------------------------------------------------------ refusals before any collective
def _good_plan(module) -> dict:
    from tritonrec.dist import construct_module_sharding_plan, table_wise
    from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder

    plan = {t: table_wise(rank=0) for t in ("t0", "t1", "t2", "t3")}
    return construct_module_sharding_plan(module, plan, QuantEmbeddingCollectionSharder(), 2, 2, "cpu")


@pytest.mark.parametrize("kind", ["data_parallel", "table_row_wise", "table_column_wise", "grid_shard"])
def test_unsupported_sharding_types_are_refused_by_name(kind: str) -> None:
    from tritonrec.dist import ParameterSharding
    from tritonrec.dist.quant_embedding import ShardedQuantEmbeddingCollection

    module = quant_ec(data_types()["int8"], seed=1)
    plan = _good_plan(module)
    plan["t2"] = ParameterSharding(kind, "quant", ranks=[0])
    with pytest.raises(ValueError, match=rf"table 't2': sharding type {kind} is not supported for quantized sequence"):
        ShardedQuantEmbeddingCollection(module, plan, _fake_pg_env())


def test_planner_offers_only_supported_types() -> None:
    from tritonrec.dist import construct_module_sharding_plan, data_parallel
    from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder

    module = quant_ec(data_types()["int8"], seed=1)
    with pytest.raises(ValueError, match=r"table 't0': QuantEmbeddingCollectionSharder does not support data_par"):
        plan = {t: data_parallel() for t in ("t0", "t1", "t2", "t3")}
        construct_module_sharding_plan(module, plan, QuantEmbeddingCollectionSharder(), 2, 2, "cpu")


def test_bad_arguments_are_refused() -> None:
    from tritonrec.dist import ParameterSharding, ShardingEnv
    from tritonrec.dist.quant_embedding import ShardedQuantEmbeddingCollection

    module = quant_ec(data_types()["int8"], seed=1)
    plan = _good_plan(module)
    with pytest.raises(TypeError, match=r"module must be a QuantEmbeddingCollection, got Linear"):
        ShardedQuantEmbeddingCollection(torch.nn.Linear(1, 1), plan, _fake_pg_env())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pass env=ShardingEnv.from_process_group\(pg\)"):
        ShardedQuantEmbeddingCollection(module, plan, ShardingEnv.from_local(2, 0))
    plan["t1"] = ParameterSharding("table_wise", "dense", ranks=[0], sharding_spec=plan["t1"].sharding_spec)
    with pytest.raises(
        ValueError, match=r"table 't1': compute_kernel must be 'quant' for a quantized table, got 'dense'"
    ):
        ShardedQuantEmbeddingCollection(module, plan, _fake_pg_env())


def _fake_pg_env():
    """A ShardingEnv that names a process group: the refusals above come before any use of it."""
    from tritonrec.dist import ShardingEnv

    env = ShardingEnv.from_local(2, 0)
    env.process_group = object()  # type: ignore[assignment]
    return env
