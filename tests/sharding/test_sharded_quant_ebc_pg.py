"""The quantized EBC sharded over 2 gloo ranks (``ShardedQuantEmbeddingBagCollectionPG``, which the sharder builds
for an env with a process group; one spawn for this module, rank-side code: quant_ebc_pg_cases.py): for table-wise,
row-wise, uneven row-wise, column-wise and mixed plans, INT8 / INT4 / mixed INT8-FP16-INT4 and INT2-FP16-INT8
tables, weighted or not, each rank's pooled output equals the unsharded QuantEBC's on that rank's batch (bit for bit
table- and column-wise, up to the order of partial sums row-wise); an fp16 ``output_dtype``; DMP's default
sharders; the state dict round trip; refused plans, by name (before any collective)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.spawned import spawn_ranks
from tests.sharding.quant_ebc_pg_cases import EXACT_PLANS, data_types, plans, quant_ebc, run_suite

SPAWN_TIMEOUT_S = 240.0
KEYS = ["f0", "f1@t0", "f2", "f3", "f1@t3"]  # the unsharded module's


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # two ranks on a small machine: see tests/sharding/spawned.py
    return run_suite(rank, world)


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, 2, timeout=SPAWN_TIMEOUT_S)


FORWARD_CASES = [f"{p}-{t}{w}" for p in plans() for t in data_types() for w in ("", "-weighted")] + ["mixed-fp16"]


@pytest.mark.dist
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_sharded_quant_ebc_over_a_group_matches_unsharded(case: str) -> None:
    for rank, results in enumerate(_results()):
        got = results["forward"][case]
        assert got["keys"] == KEYS == got["expected_keys"], f"rank {rank}: keys {got['keys']}"
        assert got["dtype"] == ("torch.float16" if case == "mixed-fp16" else "torch.float32"), f"rank {rank}"
        if case.startswith(EXACT_PLANS):
            assert got["equal"], f"rank {rank}: differs from the unsharded QuantEBC by {got['max_diff']} (bit-exact)"
        else:  # partial sums added across ranks (fp16 output: one rounding of a close fp32 sum)
            tolerance = 1e-2 if case == "mixed-fp16" else 1e-5
            assert 0 <= got["max_diff"] <= tolerance, f"rank {rank}: differs by {got['max_diff']}"


@pytest.mark.dist
def test_dmp_default_sharders_shard_a_quant_ebc_over_a_group() -> None:
    for rank, results in enumerate(_results()):
        got = results["dmp"]
        assert got["sharded"] and got["kernels"] == ["quant"], f"rank {rank}: {got}"
        assert got["keys"] == KEYS and 0 <= got["max_diff"] <= 1e-5, f"rank {rank}: {got}"


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


# ------------------------------------------------------------------------------ refusals before any collective
def _fake_pg_env():
    """A ShardingEnv that names a process group: the refusals below come before any use of it."""
    from tritonrec.dist import ShardingEnv

    env = ShardingEnv.from_local(2, 0)
    env.process_group = object()  # type: ignore[assignment]
    return env


def _plan(module, plan: dict) -> dict:
    from tritonrec.dist import construct_module_sharding_plan
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    return construct_module_sharding_plan(module, plan, QuantEmbeddingBagCollectionSharder(), 2, 2, "cpu")


def _table_wise_plan(module) -> dict:
    from tritonrec.dist import table_wise

    return _plan(module, {t: table_wise(rank=0) for t in ("t0", "t1", "t2", "t3")})


@pytest.mark.parametrize("kind", ["data_parallel", "table_row_wise", "table_column_wise", "grid_shard"])
def test_unsupported_sharding_types_are_refused_by_name(kind: str) -> None:
    from tritonrec.dist import ParameterSharding
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    module = quant_ebc(data_types()["int8"], seed=1)
    plan = _table_wise_plan(module)
    plan["t2"] = ParameterSharding(kind, "quant", ranks=[0])
    with pytest.raises(ValueError, match=rf"table 't2': sharding type {kind} is not supported for quantized tables"):
        QuantEmbeddingBagCollectionSharder().shard(module, plan, _fake_pg_env())


def test_misaligned_int2_column_block_is_refused_on_every_rank() -> None:
    from tritonrec.dist import column_wise, table_wise
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from tritonrec.modules import DataType

    module = quant_ebc({t: DataType.INT2 for t in ("t0", "t1", "t2", "t3")}, seed=1)
    plan = _plan(module, {"t0": column_wise(ranks=[0, 1, 0, 1]), **{t: table_wise(rank=1) for t in ("t1", "t2", "t3")}})
    with pytest.raises(ValueError, match=r"table 't0': an INT2 column block must start on a multiple of 4 columns"):
        QuantEmbeddingBagCollectionSharder().shard(module, plan, _fake_pg_env())


def test_bad_arguments_are_refused() -> None:
    from tritonrec.dist import ParameterSharding, ShardingEnv
    from tritonrec.dist.quant_embeddingbag_pg import ShardedQuantEmbeddingBagCollectionPG

    module = quant_ebc(data_types()["int8"], seed=1)
    plan = _table_wise_plan(module)
    with pytest.raises(TypeError, match=r"module must be a QuantEmbeddingBagCollection, got Linear"):
        ShardedQuantEmbeddingBagCollectionPG(torch.nn.Linear(1, 1), plan, _fake_pg_env())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pass env=ShardingEnv.from_process_group\(pg\)"):
        ShardedQuantEmbeddingBagCollectionPG(module, plan, ShardingEnv.from_local(2, 0))
    plan["t1"] = ParameterSharding("table_wise", "dense", ranks=[0], sharding_spec=plan["t1"].sharding_spec)
    with pytest.raises(
        ValueError, match=r"table 't1': compute_kernel must be 'quant' for a quantized table, got 'dense'"
    ):
        ShardedQuantEmbeddingBagCollectionPG(module, plan, _fake_pg_env())


def test_from_local_env_still_builds_the_single_process_form() -> None:
    from tritonrec.dist import ShardingEnv
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder, ShardedQuantEmbeddingBagCollection

    module = quant_ebc(data_types()["int8"], seed=1)
    env = ShardingEnv.from_local(2, 0)
    sharded = QuantEmbeddingBagCollectionSharder().shard(module, _table_wise_plan(module), env, torch.device("cpu"))
    assert type(sharded) is ShardedQuantEmbeddingBagCollection
