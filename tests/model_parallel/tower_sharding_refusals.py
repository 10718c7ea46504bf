"""Rank-side refusals of the tower sharders (one rank per host, as set by ``tower_sharding_cases``): every bad plan,
module, environment or input raises on both ranks alike before any collective, with an error naming the argument,
the tower and the table. Each case returns ``[exception type name, message]`` (``None`` when nothing was raised)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.model_parallel.tower_sharding_cases import TOWERS_PATH, TowerModel, _wrap


def _refused(fn: Callable[[], Any]) -> list[str] | None:
    try:
        fn()
    except Exception as err:  # the test checks the type by name
        return [type(err).__name__, str(err)]
    return None


def _plan(towers: nn.Module, gens: dict[str, Any], world: int) -> Any:
    from tritonrec.dist import construct_module_sharding_plan
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder

    return construct_module_sharding_plan(towers, gens, EmbeddingTowerCollectionSharder(), 1, world, "cpu")


def _shard(towers: nn.Module, plan: dict[str, Any], env: Any = None) -> Any:
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder

    env = ShardingEnv.from_process_group(dist.group.WORLD) if env is None else env
    return EmbeddingTowerCollectionSharder().shard(towers, plan, env, torch.device("cpu"))


def run_refusals(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import (
        ShardingPlan,
        column_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )
    from tritonrec.modules import EmbeddingTower, EmbeddingTowerCollection

    torch.manual_seed(3)
    model = TowerModel()
    towers = model.get_submodule(TOWERS_PATH)
    good = {"t0": table_row_wise(0), "t1": table_row_wise(0), "t2": table_column_wise([1]), "t3": table_row_wise(1)}
    out: dict[str, Any] = {}
    # a tower's tables on two hosts, through DMP with a plan construct_module_sharding_plan accepted
    split = _plan(towers, {**good, "t1": table_row_wise(1)}, world)
    out["split_tower"] = _refused(lambda: _wrap(copy.deepcopy(model), ShardingPlan({TOWERS_PATH: split})))
    # a sharding type the tower sharders do not offer: refused by construct_module_sharding_plan...
    out["table_wise_generator"] = _refused(lambda: _plan(towers, {**good, "t0": table_wise(rank=0)}, world))
    # ... and by the sharded module when a hand-written plan carries it
    relabelled = _plan(towers, good, world)
    relabelled["t0"] = copy.copy(relabelled["t0"])
    relabelled["t0"].sharding_type = "table_wise"
    out["table_wise_plan"] = _refused(lambda: _shard(towers, relabelled))
    # one table's column blocks on both hosts (a column-wise layout relabelled table-column-wise)
    from tritonrec.dist import EmbeddingBagCollectionSharder, construct_module_sharding_plan

    ec = towers.towers[1].embedding
    spread = construct_module_sharding_plan(
        towers.towers[0].embedding, {"t0": column_wise(ranks=[0, 1]), "t1": table_row_wise(0)},
        EmbeddingBagCollectionSharder(), 1, world, "cpu",
    )  # fmt: skip
    spread_plan = {**_plan(towers, good, world), "t0": spread["t0"]}
    spread_plan["t0"].sharding_type = "table_column_wise"
    out["table_spans_hosts"] = _refused(lambda: _shard(towers, spread_plan))
    plan = _plan(towers, good, world)
    out["unknown_table"] = _refused(lambda: _shard(towers, {**plan, "t9": plan["t0"]}))
    out["missing_table"] = _refused(lambda: _shard(towers, {k: v for k, v in plan.items() if k != "t3"}))
    out["module_type"] = _refused(lambda: _shard(towers.towers[0], plan))
    bad_tower = EmbeddingTowerCollection([towers.towers[0], EmbeddingTower(nn.Linear(2, 2), nn.Identity())])
    out["embedding_type"] = _refused(lambda: _shard(bad_tower, plan))
    twin = EmbeddingTowerCollection([towers.towers[0], EmbeddingTower(copy.deepcopy(ec), nn.Identity()),
                                     EmbeddingTower(copy.deepcopy(ec), nn.Identity())])  # fmt: skip
    out["duplicate_tables"] = _refused(lambda: _shard(twin, plan))
    out["env_type"] = _refused(lambda: _shard(towers, plan, env="world"))
    # bad inputs, on a module that shards fine
    sharded = _shard(copy.deepcopy(towers), plan)
    from tests.model_parallel.dlrm_cases import BATCH_PER_RANK, batch_slice, global_batch

    _, kjt, _ = batch_slice(global_batch(0, BATCH_PER_RANK), 0, BATCH_PER_RANK)
    out["features_type"] = _refused(lambda: sharded(kjt.values()))
    out["missing_key"] = _refused(lambda: sharded(kjt.permute([0, 1, 2])))
    out["forward_ok"] = list(sharded(kjt).wait().shape)
    return out
