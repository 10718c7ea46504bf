"""Rank-side case: a DLRM-like model whose sparse part is an :class:`EmbeddingTowerCollection` of two towers, under
DistributedModelParallel, against the same model trained in one process on the global batch.

DMP shards the embedding bag collection inside each tower (tower 0's tables row-wise; tower 1's one table-wise on
rank 1, one column-wise) and keeps the interactions and the other dense layers data-parallel. Each step draws one
global batch (the DLRM cases' tables, features and batches); rank ``r`` trains on its equal slice, the reference on
all of it; tables update in the backward (fused rowwise Adagrad), dense layers with SGD + momentum.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.model_parallel.dlrm_cases import (
    DENSE_IN,
    DIM,
    SPARSE_LR,
    TABLES,
    dense_optimizer,
    max_diff,
    train_against_reference,
)
from tritonrec.data import KeyedJaggedTensor, KeyedTensor

STEPS = 4
TOWER_TABLES = [["t0", "t1"], ["t2", "t3"]]
TOWER_PATHS = [f"tower_arch.towers.{i}.embedding" for i in range(len(TOWER_TABLES))]


class _PooledLinear(nn.Module):
    """A tower's interaction: ``relu(Linear(pooled [B, 2 * DIM]))`` -> ``[B, DIM]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * DIM, DIM)

    def forward(self, pooled: KeyedTensor) -> torch.Tensor:
        return torch.relu(self.linear(pooled.values()))


class TowerDLRM(nn.Module):
    """``over(cat(dense_arch(dense), towers(features)))``: ``[B, DENSE_IN]``, KJT -> ``[B, 1]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        from tritonrec.modules import EmbeddingBagConfig, EmbeddingTower, EmbeddingTowerCollection
        from tritonrec.modules import FusedEmbeddingBagCollection as FusedEBC

        rows = dict(TABLES)
        towers = []
        for names in TOWER_TABLES:
            tables = [EmbeddingBagConfig(num_embeddings=rows[n], embedding_dim=DIM, name=n, feature_names=[f"f_{n}"])
                      for n in names]  # fmt: skip
            ebc = FusedEBC(
                tables, "EXACT_ROWWISE_ADAGRAD", {"lr": SPARSE_LR}, backend="torch", stochastic_rounding=False
            )
            towers.append(EmbeddingTower(ebc, _PooledLinear()))
        self.dense_arch = nn.Sequential(nn.Linear(DENSE_IN, DIM), nn.ReLU())
        self.tower_arch = EmbeddingTowerCollection(towers)
        self.over_arch = nn.Linear(DIM * (1 + len(towers)), 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over_arch(torch.cat([self.dense_arch(dense), self.tower_arch(features)], dim=1))


def _plan(model: nn.Module, world: int) -> Any:
    from tritonrec.dist import (
        EmbeddingBagCollectionSharder,
        ShardingPlan,
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    generators = [{"t0": row_wise(), "t1": row_wise()}, {"t2": table_wise(rank=1), "t3": column_wise(ranks=[0, 1])}]
    return ShardingPlan(
        {
            path: construct_module_sharding_plan(
                model.get_submodule(path), gens, EmbeddingBagCollectionSharder(), world, world, "cpu"
            )
            for path, gens in zip(TOWER_PATHS, generators, strict=True)
        }
    )


def _loss(model: nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(-1), labels)


def run_suite(rank: int, world: int) -> dict[str, Any]:
    """``STEPS`` steps of DMP vs the single-process model: loss, which modules were sharded, and (rank 0) the
    gathered state dict against the reference's."""

    from tritonrec.dist import DistributedModelParallel, ShardedModule
    from tritonrec.dist.sharded_state import gather_unsharded_state_dict

    torch.manual_seed(3)
    model = TowerDLRM()
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    dmp = DistributedModelParallel(model, plan=_plan(model, world))
    for path in TOWER_PATHS:
        for sharding in dmp.module.get_submodule(path).shardings:
            sharding.lookup.backend = "torch"
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    loss_diff = train_against_reference(dmp, reference, dmp_dense, ref_dense, rank, world, STEPS, _loss)
    result: dict[str, Any] = {
        "loss": loss_diff,
        "sharded": [path for path in TOWER_PATHS if isinstance(dmp.module.get_submodule(path), ShardedModule)],
        "types": [
            sorted({p.sharding_type for p in dmp.plan.get_plan_for_module(path).values()}) for path in TOWER_PATHS
        ],
    }
    gathered = gather_unsharded_state_dict(dmp)
    if gathered is not None:
        expected = reference.state_dict()
        result["state_dict_keys"] = sorted(gathered) == sorted(expected)
        result["state_dict"] = max(max_diff(gathered[k], v) for k, v in expected.items() if k in gathered)
        # training moved every table (the comparison above is not of untouched weights)
        result["moved"] = min(max_diff(gathered[k], v) for k, v in initial.items() if "embedding_bags" in k)
    return result
