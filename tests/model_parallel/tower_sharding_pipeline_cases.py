"""Rank-side pipeline case of tower sharding on 2 gloo ranks, one per host (run in test_tower_sharding.py's spawn,
after its topology case): a model whose tower collection is sharded by ``EmbeddingTowerCollectionSharder`` (an EBC
tower on rank 0, an EC tower on rank 1) trained 8 steps by ``TrainPipelineSparseDist`` and by
``TrainPipelineBase`` from the same initial weights on the same batches (tests/train_pipeline's). The pipeline
prefetches the tower collection's input dist (two all-to-all rounds over the cross-host group) one batch ahead; the
losses and the whole gathered state must be bit for bit the base pipeline's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.model_parallel.tower_sharding_cases import DIM, PooledLinear, SequenceSumLinear, _wrap
from tests.train_pipeline.pipeline_cases import CPU, DENSE, FEATURES, ROWS, batches

STEPS = 8
TOWER_FEATURES = [FEATURES[:2], FEATURES[2:]]


class TowerTrain(nn.Module):
    """``batch -> (loss, (loss, logits [B], labels))`` (the pipelines' model contract): the over arch of the dense
    arch and the two towers' outputs."""

    def __init__(self) -> None:
        super().__init__()
        from tritonrec.modules import EmbeddingBagConfig, EmbeddingConfig, EmbeddingTower, EmbeddingTowerCollection
        from tritonrec.modules import FusedEmbeddingBagCollection as FusedEBC
        from tritonrec.modules import FusedEmbeddingCollection as FusedEC

        rows = dict(zip(FEATURES, ROWS, strict=True))
        adagrad = ("EXACT_ROWWISE_ADAGRAD", {"lr": 0.1})
        bags = [EmbeddingBagConfig(num_embeddings=rows[f], embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
                for f in TOWER_FEATURES[0]]  # fmt: skip
        seqs = [EmbeddingConfig(num_embeddings=rows[f], embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
                for f in TOWER_FEATURES[1]]  # fmt: skip
        ebc = FusedEBC(bags, *adagrad, backend="torch", stochastic_rounding=False)
        ec = FusedEC(seqs, *adagrad, backend="torch", stochastic_rounding=False)
        towers = [EmbeddingTower(ebc, PooledLinear()), EmbeddingTower(ec, SequenceSumLinear(TOWER_FEATURES[1]))]
        self.dense_arch = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.tower_arch = EmbeddingTowerCollection(towers)
        self.over_arch = nn.Linear(3 * DIM, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        from tritonrec.modules.dlrm import masked_bce_with_logits

        towers = self.tower_arch(batch.sparse_features)
        logits = self.over_arch(torch.cat([self.dense_arch(batch.dense_features), towers], dim=1)).squeeze(-1)
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _build(world: int, local: int) -> tuple[Any, torch.optim.Optimizer]:
    """(DMP with tower 0 table-row-wise on host 0 and tower 1 table-column-wise on host 1 (``local`` ranks per host),
    dense Adagrad over the rest), the same initial weights on every call."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_column_wise, table_row_wise
    from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    torch.manual_seed(5)
    model = TowerTrain()
    column_ranks = [local + i % local for i in range(2)]
    gens = {f"t_{f}": table_row_wise(host_index=0) for f in TOWER_FEATURES[0]}
    gens |= {f"t_{f}": table_column_wise(ranks=column_ranks) for f in TOWER_FEATURES[1]}
    sharder = EmbeddingTowerCollectionSharder()
    plan = construct_module_sharding_plan(model.tower_arch, gens, sharder, local, world, "cpu")
    dmp = _wrap(model, ShardingPlan({"tower_arch": plan}))
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


def _losses(pipeline: Any, data: Any) -> list[float]:
    losses = []
    while True:
        try:
            losses.append(float(pipeline.progress(data)[0]))
        except StopIteration:
            return losses


def run_pipeline(rank: int, world: int, local: int = 1) -> dict[str, Any]:
    """Both pipelines on ``world`` ranks, ``local`` per host (each rank its own batches)."""
    from tritonrec.dist.sharded_state import gather_unsharded_state_dict
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    model, optimizer = _build(world, local)
    initial = gather_unsharded_state_dict(model)
    base = _losses(TrainPipelineBase(model, optimizer, CPU), batches(rank, STEPS))
    base_state = gather_unsharded_state_dict(model)
    model, optimizer = _build(world, local)
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
    losses = _losses(pipeline, batches(rank, STEPS))
    state = gather_unsharded_state_dict(model)
    pipeline.close()
    result: dict[str, Any] = {
        "steps": len(losses),
        "losses_equal": losses == base,
        "pipelined": pipeline.pipelined_modules,
        "fallback_reason": pipeline.fallback_reason,
    }
    if rank == 0:
        assert base_state is not None and state is not None and initial is not None
        result["keys_equal"] = sorted(state) == sorted(base_state)
        result["differing"] = sorted(k for k in base_state if not torch.equal(state[k], base_state[k]))
        result["moved"] = sorted(k for k in initial if not torch.equal(initial[k], base_state[k]))
    return result
