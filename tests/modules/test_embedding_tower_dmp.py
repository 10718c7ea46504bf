"""A DLRM-like model built from an EmbeddingTowerCollection trains under DistributedModelParallel (2 gloo ranks) like
the single-process model on the global batch: DMP shards the embedding bag collection inside each tower (row-wise;
table-wise and column-wise), and after 4 steps the losses and the gathered state dict (tables and dense layers)
agree within 1e-5. One spawn for the module; rank-side code: tower_dmp_cases.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import results_of, run_suites, spawn_ranks

pytestmark = pytest.mark.dist

TOLERANCE = 1e-5
SPAWN_TIMEOUT_S = 240.0


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tests.modules import tower_dmp_cases

    torch.set_num_threads(1)
    return run_suites({"towers": (tower_dmp_cases.run_suite, (2,))}, rank, world)


@functools.cache
def _results() -> list[Any]:
    return results_of(spawn_ranks(_run, 2, timeout=SPAWN_TIMEOUT_S), "towers", 2)


def test_dmp_shards_the_collections_inside_the_towers() -> None:
    for rank, got in enumerate(_results()):
        assert got["sharded"] == ["tower_arch.towers.0.embedding", "tower_arch.towers.1.embedding"], rank
        assert got["types"] == [["row_wise"], ["column_wise", "table_wise"]], rank


def test_tower_model_trains_like_the_single_process_model() -> None:
    results = _results()
    for rank, got in enumerate(results):
        assert got["loss"] <= TOLERANCE, f"rank {rank}: the loss differs by {got['loss']}"
    assert results[0]["state_dict_keys"], "the gathered state dict has other keys than the unsharded model's"
    assert results[0]["state_dict"] <= TOLERANCE, f"the gathered weights differ by {results[0]['state_dict']}"
    assert results[0]["moved"] > 1e-3, "some table did not train: the comparison would not test the sharded update"
