"""Loading a full tensor of another table size into a sharded collection raises on every rank, naming the table and
both shapes, as the unsharded module's ``load_state_dict`` does (2 gloo ranks, one spawn for the module).

Before, each rank only checked that its own block could be cut from the tensor: a ``[5, 8]`` tensor for a row-wise
``[7, 8]`` table loaded on rank 0 (rows 0-3 fit) while rank 1 raised, and a ``[9, 8]`` tensor loaded truncated on
every rank of a table-wise or data-parallel table ("All keys matched successfully"). The fused optimizer's state
loader (``load_fused_optimizer_state_dict``) had the same gap, and a rank holding no shard of a table did not check
it at all.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from dist_utils import run_ranks

pytestmark = pytest.mark.dist

ROWS, DIM = 7, 8
PLANS = ("row_wise", "table_wise", "data_parallel", "column_wise")


def _sharded(kind: str, world: int) -> Any:
    import torch.distributed as dist

    from tritonrec.dist import (
        EmbeddingBagCollectionSharder,
        ShardingEnv,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["a"]),
        EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t1", feature_names=["b"]),
    ]
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    t1 = {
        "row_wise": row_wise(),
        "table_wise": table_wise(rank=1),
        "data_parallel": data_parallel("fused"),
        "column_wise": column_wise(ranks=[0, 1]),
    }[kind]
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": t1}, sharder, world, world, "cpu")
    return sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD))


def _load(module: Any, what: str, rows: int) -> str:
    """Load a ``rows``-row t1 (``what``: ``"weight"`` through ``load_state_dict``, ``"state"`` the fused state)."""
    import torch

    from tritonrec.dist.sharded_state import load_fused_optimizer_state_dict

    try:
        if what == "weight":
            weights = {
                "embedding_bags.t0.weight": torch.zeros(10, 4),
                "embedding_bags.t1.weight": torch.ones(rows, DIM),
            }
            result = module.load_state_dict(weights)
        else:
            state = {"t0": {"momentum1": torch.zeros(10)}, "t1": {"momentum1": torch.ones(rows)}}
            result = load_fused_optimizer_state_dict(module, state)
    except (RuntimeError, ValueError) as err:
        return f"raised: {err}"
    return f"loaded: {result}"


def _rank_cases(rank: int, world: int) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for kind in PLANS:
        module = _sharded(kind, world)
        out[kind] = {
            f"{what}_{rows}": _load(module, what, rows) for rows in (5, 9, ROWS) for what in ("weight", "state")
        }
    return out


@functools.cache
def _results() -> list[dict[str, dict[str, str]]]:
    return run_ranks(_rank_cases, 2, timeout=240.0)


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("rows", [5, 9])
def test_weight_of_another_table_size_raises_on_every_rank(kind: str, rows: int) -> None:
    for rank, results in enumerate(_results()):
        got = results[kind][f"weight_{rows}"]
        assert got.startswith("raised") and f"has shape ({rows}, {DIM}), the table's is ({ROWS}, {DIM})" in got, (
            f"rank {rank}, {kind}: {got}"
        )
        assert "embedding_bags.t1.weight" in got


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("rows", [5, 9])
def test_fused_state_of_another_table_size_raises_on_every_rank(kind: str, rows: int) -> None:
    for rank, results in enumerate(_results()):
        got = results[kind][f"state_{rows}"]
        assert got.startswith("raised") and f"t1.momentum1: the loaded tensor has shape ({rows},)" in got, (
            f"rank {rank}, {kind}: {got}"
        )


@pytest.mark.parametrize("kind", PLANS)
def test_right_size_still_loads(kind: str) -> None:
    for rank, results in enumerate(_results()):
        assert results[kind][f"weight_{ROWS}"] == "loaded: <All keys matched successfully>", f"rank {rank}, {kind}"
        assert results[kind][f"state_{ROWS}"] == "loaded: None", f"rank {rank}, {kind}"
