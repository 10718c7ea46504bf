"""Rank-side cases (2 ranks): checkpoints of plain collections on the dense kernel, whose tables a dense optimizer
(Adam: ``step``, ``exp_avg``, ``exp_avg_sq``) trains. Saved under one plan (a table-wise table, a column-wise table
with both blocks on rank 0, so that rank holds ``weight`` and ``weight_1``, a row-wise table), then loaded under the
same plan and under another: training resumes as if uninterrupted. A load used to fail even under the same plan:
the checkpoint kept rank 0's param groups, which name rank 0's shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

TABLES = [("t0", 30, 4), ("t1", 50, 8), ("t2", 20, 8)]
BATCH = 4
SAVED_AT, RESUMED = 3, 3


class Scored(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.linear = nn.Linear(sum(d for _, _, d in TABLES), 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.linear(self.ebc(kjt).values()).pow(2).mean()


def unsharded() -> nn.Module:
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(7)
    configs = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=d, name=n, feature_names=[f"f_{n}"])
               for n, r, d in TABLES]  # fmt: skip
    return Scored(EmbeddingBagCollection(configs, backend="torch"))


def batch(rank: int, step: int) -> Any:
    from tritonrec.data import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * rank + step)
    lengths = torch.randint(0, 4, (len(TABLES) * BATCH,), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=g)
                        for i, (_, rows, _) in enumerate(TABLES)])  # fmt: skip
    return KeyedJaggedTensor([f"f_{n}" for n, _, _ in TABLES], values, lengths=lengths.int())


def sharded(plan: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from tritonrec.dist import (
        EmbeddingBagCollectionSharder,
        ShardingPlan,
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from tritonrec.dist.model_parallel import DistributedModelParallel

    model = unsharded()
    generators = {
        "a": {"t0": table_wise(rank=1), "t1": column_wise(ranks=[0, 0]), "t2": row_wise()},
        "b": {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[1, 0])},
    }[plan]
    sharder = EmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(model.ebc, generators, sharder, world, world, "cpu")
    for sharding in module_plan.values():
        sharding.compute_kernel = "dense"
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": module_plan}),
                                   sharders=[sharder])  # fmt: skip
    return dmp, torch.optim.Adam([p for _, p in dmp.named_parameters()], lr=0.05)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = model(batch(rank, step))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def dense_table_checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """The losses after the save step: uninterrupted under plan a, resumed from the checkpoint under plan a and
    under plan b; and which shard parameters rank 0 holds under plan a."""
    from tritonrec.dist.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = sharded("a", world)
    _train(model, optimizer, rank, range(SAVED_AT))
    path = Path(root) / "dense_tables"
    save_checkpoint(path, model, {"dense": optimizer}, step=SAVED_AT)
    out: dict[str, Any] = {"shards": sorted(n for n, _ in model.named_parameters() if ".t1." in n)}
    out["uninterrupted"] = _train(model, optimizer, rank, range(SAVED_AT, SAVED_AT + RESUMED))
    for plan in ("a", "b"):
        model, optimizer = sharded(plan, world)
        load_checkpoint(path, model, {"dense": optimizer})
        out[f"resumed_{plan}"] = _train(model, optimizer, rank, range(SAVED_AT, SAVED_AT + RESUMED))
    return out
