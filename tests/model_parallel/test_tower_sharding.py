"""Tower sharding (``EmbeddingTowerCollectionSharder`` / ``EmbeddingTowerSharder``) on 2 gloo ranks, one rank per
host: each whole tower (tables and interaction) on one rank. The model (an EBC tower and an EC tower + dense layers)
trains like the single-process model on the global batch; each tower's interaction exists on exactly one rank; the
state dict has torchrec's keys, gathers to the reference's values and loads into the unsharded model; bad plans,
modules and inputs are refused by name. One spawn for the module; rank-side code: tower_sharding_cases.py and
tower_sharding_refusals.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

pytestmark = pytest.mark.dist

TOLERANCE = 1e-5
SPAWN_TIMEOUT_S = 240.0
TOWER_KEYS = [
    ["tower_arch.towers.0.embedding.embedding_bags.t0.weight", "tower_arch.towers.0.embedding.embedding_bags.t1.weight",
     "tower_arch.towers.0.interaction.linear.bias", "tower_arch.towers.0.interaction.linear.weight"],
    ["tower_arch.towers.1.embedding.embeddings.t2.weight", "tower_arch.towers.1.embedding.embeddings.t3.weight",
     "tower_arch.towers.1.interaction.linear.bias", "tower_arch.towers.1.interaction.linear.weight"],
]  # fmt: skip
TOWER_TABLES_OF = [["t0", "t1"], ["t2", "t3"]]
DENSE_KEYS = ["dense_arch.0.bias", "dense_arch.0.weight", "over_arch.bias", "over_arch.weight"]


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.model_parallel import (
        tower_sharding_cases,
        tower_sharding_checkpoint_cases,
        tower_sharding_pipeline_cases,
        tower_sharding_refusals,
    )

    torch.set_num_threads(1)
    suites: dict[str, Any] = {name: (case, (2,)) for name, case in tower_sharding_cases.CASES.items()}
    suites["refusals"] = (tower_sharding_refusals.run_refusals, (2,))
    suites["checkpoint"] = (tower_sharding_checkpoint_cases.run_checkpoint, (2,))
    suites["tower_sharder_checkpoint"] = (
        lambda rank, world: tower_sharding_checkpoint_cases.run_checkpoint(
            rank, world, 1, tower_sharding_cases.tower_plan, "tower"
        ),
        (2,),
    )
    suites["pipeline"] = (tower_sharding_pipeline_cases.run_pipeline, (2,))
    return run_suites(suites, rank, world)


@functools.cache
def _spawned() -> list[dict[str, Any]]:
    """One spawn for this module and test_tower_sharding_checkpoint.py (which reads its ``checkpoint`` suite); the
    ranks save their checkpoints under a temporary directory they inherit through the environment."""
    from tests.model_parallel.tower_sharding_checkpoint_cases import make_checkpoint_root

    make_checkpoint_root()
    return spawn_ranks(_run, 2, timeout=SPAWN_TIMEOUT_S)


def results(case: str) -> list[Any]:
    """Per rank, what rank-side case ``case`` returned (the module's spawn runs once per session)."""
    return results_of(_spawned(), case, 2)


def _results(case: str) -> list[Any]:
    return results_of(_spawned(), case, 2)


@pytest.mark.parametrize("case", ["in_order", "swapped"])
def test_collection_trains_like_the_single_process_model(case: str) -> None:
    """``swapped``: tower 0 on rank 1, tower 1 on rank 0, so the output all-to-all delivers the towers' columns in
    the opposite order, which the sharded collection must put back."""
    for rank, got in enumerate(_results(case)):
        assert got["loss"] <= TOLERANCE, f"rank {rank}: the loss differs by {got['loss']}"
        assert got["params"] <= TOLERANCE, f"rank {rank}: interaction / dense parameters differ by {got['params']}"


@pytest.mark.parametrize("case", ["in_order", "swapped"])
def test_each_interaction_lives_on_its_towers_rank_only(case: str) -> None:
    for rank, got in enumerate(_results(case)):
        tower = rank if case == "in_order" else 1 - rank
        assert got["interactions"] == [k for k in TOWER_KEYS[tower] if ".interaction." in k], rank
        assert got["local_keys"] == sorted(DENSE_KEYS + TOWER_KEYS[tower]), rank


@pytest.mark.parametrize("case", ["in_order", "swapped"])
def test_state_dict_gathers_to_the_reference_and_loads_unsharded(case: str) -> None:
    got = _results(case)[0]
    assert got["keys_equal"], "the ranks' state-dict keys together are not the unsharded model's"
    assert got["state_dict"] <= TOLERANCE, f"the gathered state differs from the reference's by {got['state_dict']}"
    assert got["moved"] > 1e-4, "some weight did not train: the comparison would not test the sharded update"
    assert got["loaded"] <= TOLERANCE, f"the unsharded model loaded from the gathered state is off by {got['loaded']}"


def test_tower_sharder_shards_each_tower_on_its_own() -> None:
    for rank, got in enumerate(_results("tower_sharder")):
        assert got["sharded"] == [True, True], rank
        assert got["interactions"] == [k for k in TOWER_KEYS[rank] if ".interaction." in k], rank
        assert got["local_keys"] == sorted(DENSE_KEYS + TOWER_KEYS[rank]), rank
        assert got["loss"] <= TOLERANCE, f"rank {rank}: the loss differs by {got['loss']}"


def test_planner_plan_keeps_each_tower_on_one_rank_and_trains_like_the_single_process_model() -> None:
    """2 ranks, one per host: the planner's plan puts each tower's tables on one host (what the tower sharders
    need), and the model trains equal to the unsharded one under it."""
    results = _results("planner")
    planned = results[0]["planned"]
    assert all(r["planned"] == planned for r in results), "the ranks got different plans"
    for tower in (TOWER_TABLES_OF[0], TOWER_TABLES_OF[1]):
        assert len({rank for table in tower for rank in planned[table]}) == 1, planned
    for rank, got in enumerate(results):
        assert got["loss"] <= TOLERANCE, f"rank {rank}: the loss differs by {got['loss']}"
        assert got["params"] <= TOLERANCE, f"rank {rank}: interaction / dense parameters differ by {got['params']}"
    assert results[0]["keys_equal"] and results[0]["state_dict"] <= TOLERANCE, results[0]["state_dict"]


REFUSALS = {
    "split_tower": ("ValueError", ["towers[0]", "'t1'", "different hosts"]),
    "table_wise_generator": ("ValueError", ["'t0'", "table_wise", "EmbeddingTowerCollectionSharder"]),
    "table_wise_plan": ("ValueError", ["towers[0]", "'t0'", "table_wise", "table_row_wise"]),
    "table_spans_hosts": ("ValueError", ["towers[0]", "'t0'", "[0, 1]", "span hosts"]),
    "unknown_table": ("ValueError", ["'t9'"]),
    "missing_table": ("ValueError", ["towers[1]", "'t3'"]),
    "module_type": ("TypeError", ["module", "EmbeddingTowerCollection"]),
    "embedding_type": ("TypeError", ["module.towers[1].embedding", "Linear"]),
    "duplicate_tables": ("ValueError", ["'t2'", "towers[1]", "towers[2]"]),
    "env_type": ("TypeError", ["env"]),
    "features_type": ("TypeError", ["features", "Tensor"]),
    "missing_key": ("ValueError", ["features", "'f_t3'"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_plans_modules_and_inputs_are_refused_by_name(case: str) -> None:
    kind, words = REFUSALS[case]
    for rank, got in enumerate(_results("refusals")):
        assert got[case] is not None, f"rank {rank}: {case} was not refused"
        assert got[case][0] == kind, f"rank {rank}: {case} raised {got[case]}"
        for word in words:
            assert word in got[case][1], f"rank {rank}: {case}'s message does not name {word}: {got[case][1]}"
        assert got["forward_ok"] == [4, 16], "the refusals' good module did not run after them"
