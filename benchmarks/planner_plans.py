"""The plans ``bench_planner`` compares and the model they shard: ``Tables`` (one EmbeddingBagCollection), our
planner's plan, every plan of a grid search, plain table-wise, and torchrec's planner's plan translated to ours - all
on the fused kernel (rowwise Adagrad, learning rate ``LR``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

GRID_TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel"]
LR = 0.01

__all__ = [
    "GRID_TYPES",
    "LR",
    "Tables",
    "describe",
    "grid_plans",
    "our_plan",
    "sharder",
    "table_wise_plan",
    "torchrec_plan",
    "translate",
]


class Tables(nn.Module):
    """The benchmarked model: one EmbeddingBagCollection (``ebc``)."""

    def __init__(self, specs: list[tuple[int, int, float]], device: str = "meta") -> None:
        super().__init__()
        from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

        configs = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
                   for i, (r, d, _) in enumerate(specs)]  # fmt: skip
        self.ebc = EmbeddingBagCollection(configs, device=device)

    def forward(self, features: Any) -> Any:
        return self.ebc(features)


def sharder() -> Any:
    from tritonrec.dist import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(fused_params={"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": LR})


def describe(plan: Any) -> str:
    """``t0:TW@1 t1:RW ...`` of a plan."""
    short = {"table_wise": "TW", "row_wise": "RW", "column_wise": "CW", "data_parallel": "DP",
             "table_row_wise": "TWRW", "table_column_wise": "TWCW", "grid_shard": "GRID"}  # fmt: skip
    parts = []
    for name, p in plan.plan["ebc"].items():
        where = f"@{p.ranks[0]}" if p.sharding_type == "table_wise" else ""
        where = f"x{len(p.ranks)}" if p.sharding_type in ("column_wise", "table_column_wise") else where
        parts.append(f"{name}:{short[p.sharding_type]}{where}")
    return " ".join(parts)


def _fused_only(plan: Any) -> Any:
    for module_plan in plan.plan.values():
        for sharding in module_plan.values():
            sharding.compute_kernel = "fused"
    return plan


def our_plan(specs: list, batch: int, calibration: str | None) -> tuple[Any, float]:
    from tritonrec.dist.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[f], compute_kernels=["fused"])
                   for i, (_, _, f) in enumerate(specs)}  # fmt: skip
    planner = EmbeddingShardingPlanner(Topology(2, "cpu", calibration=calibration), batch, constraints=constraints,
                                       stats=[])  # fmt: skip
    plan = planner.plan(Tables(specs), [sharder()])
    return plan, planner.last_candidate.estimated_step_s  # type: ignore[union-attr]


def grid_plans(specs: list, batch: int, calibration: str | None) -> list[tuple[Any, float]]:
    from tritonrec.dist.planner import EmbeddingShardingPlanner, GridSearchProposer, ParameterConstraints, Topology

    constraints = {f"t{i}": ParameterConstraints(sharding_types=GRID_TYPES, compute_kernels=["fused"],
                                                 pooling_factors=[f]) for i, (_, _, f) in enumerate(specs)}  # fmt: skip
    planner = EmbeddingShardingPlanner(Topology(2, "cpu", calibration=calibration), batch, constraints=constraints,
                                       stats=[])  # fmt: skip
    found = planner.candidate_plans(Tables(specs), [sharder()], GridSearchProposer(10_000))
    return [(c.plan, c.estimated_step_s) for c in found]


def table_wise_plan(specs: list) -> Any:
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_wise

    gens = {f"t{i}": table_wise(rank=i % 2) for i in range(len(specs))}
    return _fused_only(ShardingPlan({"ebc": construct_module_sharding_plan(Tables(specs).ebc, gens, sharder(), 2, 2,
                                                                           "cpu")}))  # fmt: skip


def torchrec_plan(specs: list, batch: int) -> tuple[Any, str]:
    """torchrec's planner's plan, translated to ours, and a note (what it offered on CPU, or why it failed)."""
    logging.disable(logging.WARNING)  # torchrec's planner warns about its own topology construction
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    except Exception as err:  # not installed: no anchor
        return None, f"torchrec not importable: {type(err).__name__}"
    try:
        configs = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
                   for i, (r, d, _) in enumerate(specs)]  # fmt: skip
        ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
        their_sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}
        )
        offered = their_sharder.sharding_types("cpu")
        constraints = {f"t{i}": ParameterConstraints(pooling_factors=[f]) for i, (_, _, f) in enumerate(specs)}
        topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch, constraints=constraints)
        their = planner.plan(ebc, [their_sharder])
    except Exception as err:  # a planner refusing the workload is a result
        return None, f"torchrec planner failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    finally:
        logging.disable(logging.NOTSET)
    return translate(their, specs), f"torchrec offers {offered} on cpu (row-wise refused)"


def translate(their: Any, specs: list) -> Any:
    """A torchrec plan of the EBC as our plan of ``Tables`` (same types and ranks; every table on the fused kernel)."""
    from tritonrec.dist import (
        ShardingPlan,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )

    gens = {}
    for name, p in next(iter(their.plan.values())).items():
        kind = p.sharding_type
        gens[name] = {
            "table_wise": lambda p=p: table_wise(rank=p.ranks[0]),
            "row_wise": lambda p=p: row_wise(),
            "column_wise": lambda p=p: column_wise(ranks=list(p.ranks)),
            "table_column_wise": lambda p=p: table_column_wise(ranks=list(p.ranks)),
            "table_row_wise": lambda p=p: table_row_wise(host_index=0),
            "data_parallel": lambda p=p: data_parallel(),
        }[kind]()
    module_plan = construct_module_sharding_plan(Tables(specs).ebc, gens, sharder(), 2, 2, "cpu")
    return _fused_only(ShardingPlan({"ebc": module_plan}))
