"""The distributed job's hand-written plans (``sharding=tw|rw|cw|twrw|dp``), built without a process group: a
column-wise plan that cannot give every rank an equal block is refused with the job's own words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train.dist_job_cases import tiny_config
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
from tritonrec.dist.train.builders import build_data, build_model
from tritonrec.dist.train.dist_builders import EBC_PATH, build_plan
from tritonrec.dist.train.job_config import ShardingConfig
from tritonrec.dist.types import ShardingEnv


def _plan(tmp_path: Path, kind: str, world: int, dim: int):  # type: ignore[no-untyped-def]
    cfg = tiny_config(tmp_path, sharding=ShardingConfig(kind=kind))
    cfg.model.embedding_dim, cfg.model.dense_arch_layer_sizes = dim, [8, dim]
    model = build_model(cfg.model, build_data(cfg.data), cfg.optim, "cpu")
    return build_plan(model, cfg, EmbeddingBagCollectionSharder(), torch.device("cpu"), ShardingEnv(world, 0, None))


@pytest.mark.parametrize(("world", "dim"), [(2, 4), (3, 6), (4, 8)])
def test_column_wise_plan_gives_every_rank_a_block(tmp_path: Path, world: int, dim: int) -> None:
    plan = _plan(tmp_path, "cw", world, dim).plan[EBC_PATH]
    for sharding in plan.values():
        assert sharding.sharding_type == "column_wise" and sharding.ranks == list(range(world))


def test_column_wise_plan_refuses_a_dim_the_world_does_not_divide(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"sharding=cw .* embedding_dim \[4\] is not divisible by 3: use a world size"):
        _plan(tmp_path, "cw", 3, 4)
