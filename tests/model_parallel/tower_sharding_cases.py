"""Rank-side cases of tower sharding (``EmbeddingTowerCollectionSharder`` / ``EmbeddingTowerSharder``) on 2 gloo ranks
with ONE RANK PER HOST (``LOCAL_WORLD_SIZE=1``), so a tower placed on a host is on exactly one rank.

The model: ``over(cat(dense_arch(dense), towers(features)))`` whose tower collection holds an EBC tower (tables t0, t1,
fused rowwise Adagrad, a linear interaction of the pooled embeddings) and an EC tower (tables t2, t3, fused rowwise
Adagrad, a linear interaction of each feature's summed sequence). Each step draws one global batch (the DLRM cases'
tables and batches); rank ``r`` trains on its equal slice, the single-process reference on all of it; dense layers
and interactions with SGD + momentum.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from tests.model_parallel.dlrm_cases import (
    BATCH_PER_RANK,
    DENSE_IN,
    DIM,
    SPARSE_LR,
    TABLES,
    batch_slice,
    dense_optimizer,
    global_batch,
    max_diff,
    train_against_reference,
)
from tritonrec.data import KeyedJaggedTensor, KeyedTensor

STEPS = 4
TOWER_TABLES = [["t0", "t1"], ["t2", "t3"]]
TOWERS_PATH = "tower_arch"


class PooledLinear(nn.Module):
    """EBC tower's interaction: ``relu(Linear(pooled [B, 2 * DIM]))`` -> ``[B, DIM]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * DIM, DIM)

    def forward(self, pooled: KeyedTensor) -> torch.Tensor:
        return torch.relu(self.linear(pooled.values()))


class SequenceSumLinear(nn.Module):
    """EC tower's interaction: each feature's sequence summed per sample (a plain loop), concatenated, then
    ``Linear`` -> ``[B, DIM]``."""

    def __init__(self, features: list[str]) -> None:
        super().__init__()
        self.features = features
        self.linear = nn.Linear(len(features) * DIM, DIM)

    def forward(self, sequences: dict[str, Any]) -> torch.Tensor:
        sums = []
        for name in self.features:
            jt = sequences[name]
            rows = torch.split(jt.values(), jt.lengths().tolist())
            sums.append(torch.stack([r.sum(0) if len(r) else r.new_zeros(DIM) for r in rows]))
        return self.linear(torch.cat(sums, dim=1))


class TowerModel(nn.Module):
    """``[B, DENSE_IN]``, KJT -> ``[B, 1]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        from tritonrec.modules import EmbeddingBagConfig, EmbeddingConfig, EmbeddingTower, EmbeddingTowerCollection
        from tritonrec.modules import FusedEmbeddingBagCollection as FusedEBC
        from tritonrec.modules import FusedEmbeddingCollection as FusedEC

        rows = dict(TABLES)
        adagrad = ("EXACT_ROWWISE_ADAGRAD", {"lr": SPARSE_LR})
        bags = [EmbeddingBagConfig(num_embeddings=rows[n], embedding_dim=DIM, name=n, feature_names=[f"f_{n}"])
                for n in TOWER_TABLES[0]]  # fmt: skip
        seqs = [EmbeddingConfig(num_embeddings=rows[n], embedding_dim=DIM, name=n, feature_names=[f"f_{n}"])
                for n in TOWER_TABLES[1]]  # fmt: skip
        ebc = FusedEBC(bags, *adagrad, backend="torch", stochastic_rounding=False)
        ec = FusedEC(seqs, *adagrad, backend="torch", stochastic_rounding=False)
        towers = [EmbeddingTower(ebc, PooledLinear()), EmbeddingTower(ec, SequenceSumLinear(["f_t2", "f_t3"]))]
        self.dense_arch = nn.Sequential(nn.Linear(DENSE_IN, DIM), nn.ReLU())
        self.tower_arch = EmbeddingTowerCollection(towers)
        self.over_arch = nn.Linear(3 * DIM, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over_arch(torch.cat([self.dense_arch(dense), self.tower_arch(features)], dim=1))


def loss_fn(model: nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(-1), labels)


def collection_plan(model: nn.Module, hosts: tuple[int, int], world: int, local: int = 1) -> Any:
    """Tower 0's tables table-row-wise on host ``hosts[0]``, tower 1's table-column-wise (2 column blocks) on the
    ranks of host ``hosts[1]`` (``local`` ranks per host)."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_column_wise, table_row_wise
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder

    column_ranks = [hosts[1] * local + i % local for i in range(2)]
    gens = {t: table_row_wise(host_index=hosts[0]) for t in TOWER_TABLES[0]}
    gens |= {t: table_column_wise(ranks=column_ranks) for t in TOWER_TABLES[1]}
    module = model.get_submodule(TOWERS_PATH)
    sharder = EmbeddingTowerCollectionSharder()
    return ShardingPlan({TOWERS_PATH: construct_module_sharding_plan(module, gens, sharder, local, world, "cpu")})


def planner_plan(model: nn.Module, world: int, local: int) -> Any:
    """The planner's plan (rank 0 plans, every rank gets it) for ``world`` ranks, ``local`` per host."""
    from tritonrec.dist import EmbeddingBagCollectionSharder
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder
    from tritonrec.dist.planner import EmbeddingShardingPlanner, Topology

    topology = Topology(world, "cpu", local_world_size=local)
    planner = EmbeddingShardingPlanner(topology, batch_size=BATCH_PER_RANK, stats=[])
    return planner.collective_plan(model, [EmbeddingTowerCollectionSharder(), EmbeddingBagCollectionSharder()])


def planned_ranks(plan: Any) -> dict[str, list[int]]:
    """Table -> the ranks of its shards, in the planner's plan."""
    from tritonrec.dist.embedding_tower_plan import shard_ranks

    return {table: shard_ranks(sharding) for table, sharding in plan.plan[TOWERS_PATH].items()}


def tower_plan(model: nn.Module, hosts: tuple[int, int], world: int, local: int = 1) -> Any:
    """Each tower sharded by ``EmbeddingTowerSharder`` on its own: tower 0 table-row-wise on host ``hosts[0]``,
    tower 1 table-column-wise on the ranks of host ``hosts[1]`` (``local`` ranks per host)."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_column_wise, table_row_wise
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerSharder

    column_ranks = [hosts[1] * local + i % local for i in range(2)]
    gens = [{t: table_row_wise(host_index=hosts[0]) for t in TOWER_TABLES[0]},
            {t: table_column_wise(ranks=column_ranks) for t in TOWER_TABLES[1]}]  # fmt: skip
    return ShardingPlan(
        {
            f"{TOWERS_PATH}.towers.{i}": construct_module_sharding_plan(
                model.get_submodule(f"{TOWERS_PATH}.towers.{i}"), g, EmbeddingTowerSharder(), local, world, "cpu"
            )
            for i, g in enumerate(gens)
        }
    )


def _wrap(model: nn.Module, plan: Any) -> Any:
    from tritonrec.dist import DistributedModelParallel, EmbeddingBagCollectionSharder
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder, EmbeddingTowerSharder

    sharders = [EmbeddingTowerCollectionSharder(), EmbeddingTowerSharder(), EmbeddingBagCollectionSharder()]
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)  # type: ignore[arg-type]
    for module in dmp.module.modules():  # the torch twins: this runs in spawned CPU ranks
        for sharding in getattr(module, "_shardings", []):
            sharding.lookup.backend = "torch"
    return dmp


def gather_state_dict(state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """Every rank's entries (plain tensors, ShardedTensors' local shards with their offsets) assembled on rank 0
    into full tensors; ``None`` on the other ranks. Tower-sharded tables are ShardedTensors over their host's group,
    so their shards are gathered over the world here rather than over their own group."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    mine: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            pieces = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
            mine[key] = (tuple(value.size()), pieces)
        else:
            mine[key] = value.detach().clone()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for rank_state in gathered:
        for key, value in rank_state.items():
            if isinstance(value, torch.Tensor):
                out[key] = value
                continue
            size, pieces = value
            full = out.setdefault(key, torch.zeros(size))
            for offsets, tensor in pieces:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))] = tensor
    return out


def interaction_names(dmp: Any) -> list[str]:
    return sorted(name for name, _ in dmp.named_parameters() if ".interaction." in name)


def run_training(
    rank: int, world: int, hosts: tuple[int, int] | None, steps: int = STEPS, local: int = 1
) -> dict[str, Any]:
    """``steps`` steps of DMP (tower-sharded collection; the planner's plan when ``hosts`` is None) vs the
    single-process model; state dict checks."""
    torch.manual_seed(3)
    model = TowerModel()
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    plan = planner_plan(model, world, local) if hosts is None else collection_plan(model, hosts, world, local)
    dmp = _wrap(model, plan)
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    result: dict[str, Any] = {"interactions": interaction_names(dmp), "planned": planned_ranks(plan)}
    result["loss"] = train_against_reference(dmp, reference, dmp_dense, ref_dense, rank, world, steps, loss_fn)
    # this rank's interaction and dense parameters against the reference's
    ref_params = dict(reference.named_parameters())
    result["params"] = max(
        max_diff(p, ref_params[n]) for n, p in dmp.named_parameters() if "embedding" not in n
    )  # fmt: skip
    state = dmp.state_dict()
    result["local_keys"] = sorted(state)
    gathered = gather_state_dict(state)
    if gathered is not None:
        expected = reference.state_dict()
        result["keys_equal"] = sorted(gathered) == sorted(expected)
        result["state_dict"] = max(max_diff(gathered[k], v) for k, v in expected.items() if k in gathered)
        result["moved"] = min(max_diff(gathered[k], v) for k, v in initial.items() if k.endswith(".weight"))
        fresh = TowerModel()
        fresh.load_state_dict(gathered, strict=True)
        dense, kjt, _ = batch_slice(global_batch(99, BATCH_PER_RANK), 0, BATCH_PER_RANK)
        result["loaded"] = max_diff(fresh(dense, kjt), reference(dense, kjt))
    return result


def run_tower_sharder(rank: int, world: int) -> dict[str, Any]:
    """Each tower sharded on its own by ``EmbeddingTowerSharder`` (the collection left unsharded)."""
    from tritonrec.dist import ShardedModule

    torch.manual_seed(3)
    model = TowerModel()
    reference = copy.deepcopy(model)
    dmp = _wrap(model, tower_plan(model, (0, 1), world))
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    towers = [dmp.module.get_submodule(f"{TOWERS_PATH}.towers.{i}") for i in range(2)]
    return {
        "sharded": [isinstance(t, ShardedModule) for t in towers],
        "interactions": interaction_names(dmp),
        "local_keys": sorted(dmp.state_dict()),
        "loss": train_against_reference(dmp, reference, dmp_dense, ref_dense, rank, world, 3, loss_fn),
    }


def one_rank_per_host(rank: int, world: int) -> None:
    """Before the first node-group query (``intra_and_cross_node_pg`` caches its groups): one rank per host."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"


# name -> rank-side case; run in this order in one spawn (the first sets the topology)
CASES = {
    "topology": one_rank_per_host,
    "in_order": lambda rank, world: run_training(rank, world, (0, 1)),
    "swapped": lambda rank, world: run_training(rank, world, (1, 0), steps=2),
    "tower_sharder": run_tower_sharder,
    "planner": lambda rank, world: run_training(rank, world, None, steps=2),
}
