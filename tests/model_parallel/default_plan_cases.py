"""Rank-side case (2 ranks): DistributedModelParallel's default plan (no plan given) for collections with and without
an optimizer to fuse. A plain module whose sharder has no ``optimizer`` in ``fused_params`` gets the dense kernel
(its tables train with the caller's optimizer, as unsharded); a fused module, or a sharder with an optimizer, keeps
the planner's choice. Before, the planner picked the fused kernel for plain modules too and sharding raised."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FEATURES, ROWS, DIM = ["f0", "f1"], [30, 50], 4


class _Scored(nn.Module):
    """A linear score of a collection's output, pooled (KeyedTensor) or per id (dict of JaggedTensors)."""

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.collection = collection
        self.linear = nn.Linear(DIM, 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        out = self.collection(kjt)
        rows = (
            out.values().reshape(-1, DIM)
            if hasattr(out, "length_per_key")
            else torch.cat([jt.values() for jt in out.values()])
        )
        return self.linear(rows).pow(2).mean()


def _collections() -> dict[str, tuple[nn.Module, list[Any] | None]]:
    """name -> (module to shard, sharders or None for the defaults)."""
    from tritonrec.dist import EmbeddingCollectionSharder
    from tritonrec.modules import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        FeatureProcessedEmbeddingBagCollection,
        FusedEmbeddingBagCollection,
        PositionWeightedModuleCollection,
    )

    bags = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
            for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
    ids = [EmbeddingConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
           for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip

    def processed(inner: nn.Module) -> nn.Module:
        return FeatureProcessedEmbeddingBagCollection(inner, PositionWeightedModuleCollection({f: 4 for f in FEATURES}))

    adagrad = {"optimizer": "EXACT_ROWWISE_ADAGRAD", "lr": 0.1}
    fused_bags = FusedEmbeddingBagCollection(
        bags, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch", is_weighted=True
    )
    return {
        "ebc": (EmbeddingBagCollection(bags, backend="torch"), None),
        "ec": (EmbeddingCollection(ids, backend="torch"), None),
        "fp": (processed(EmbeddingBagCollection(bags, is_weighted=True, backend="torch")), None),
        "fused_ebc": (FusedEmbeddingBagCollection(bags, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch"), None),
        "fp_fused": (processed(fused_bags), None),
        "ec_sharder_optimizer": (EmbeddingCollection(ids, backend="torch"), [EmbeddingCollectionSharder(adagrad)]),
    }


def default_plan_kernels(rank: int, world: int) -> dict[str, Any]:
    """Per collection: the planned compute kernels, a training step's loss, and whether the caller's optimizer (plain
    tables) or the fused one changed every rank-local table shard."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist.model_parallel import DistributedModelParallel

    out: dict[str, Any] = {}
    for name, (collection, sharders) in _collections().items():
        torch.manual_seed(5)
        dmp = DistributedModelParallel(_Scored(collection), device=torch.device("cpu"), sharders=sharders)
        kernels = sorted({p.compute_kernel for plan in dmp.plan.plan.values() for p in plan.values()})
        before = {k: v.detach().clone() for k, v in dmp.named_parameters() if "collection" in k}
        optimizer = torch.optim.SGD([p for _, p in dmp.named_parameters()], lr=0.5)
        g = torch.Generator().manual_seed(rank)
        lengths = torch.randint(1, 4, (len(FEATURES) * 3,), generator=g)
        values = torch.cat([torch.randint(0, r, (int(lengths[i * 3 : i * 3 + 3].sum()),), generator=g)
                            for i, r in enumerate(ROWS)])  # fmt: skip
        loss = dmp(KeyedJaggedTensor(FEATURES, values, lengths=lengths.int()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tables = [k for k in before if "position" not in k]
        changed = [k for k in tables if not torch.equal(before[k], dict(dmp.named_parameters())[k].detach())]
        out[name] = {"kernels": kernels, "loss": float(loss), "tables": len(tables), "changed": len(changed)}
    return out
