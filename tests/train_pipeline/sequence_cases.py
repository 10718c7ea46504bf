"""Rank-side cases (2 gloo ranks): a sequence model, a sharded ``EmbeddingCollection`` (per-id embeddings, no
pooling; fused rowwise Adagrad) under DistributedModelParallel, trained by TrainPipelineSparseDist and
StagedTrainPipeline and compared with TrainPipelineBase bit for bit, table-wise and row-wise. The pipelines were
built around the pooled collections; the sequence one's input dist (and its all-to-all of per-id rows) must be
found by the tracer and prefetched all the same."""

from __future__ import annotations

from typing import Any

import torch

from tests.train_pipeline.pipeline_cases import CPU, DENSE, DIM, FEATURES, ROWS, batches, snapshot
from tests.train_pipeline.toy import staged_losses

STEPS = 10


class SequenceModel(torch.nn.Module):
    """Per sample: a linear score of the dense features plus, per feature, the sum of a linear score of each of its
    ids' embeddings (so every looked-up row gets its own gradient)."""

    def __init__(self, ec: torch.nn.Module) -> None:
        super().__init__()
        self.ec = ec
        self.score = torch.nn.Linear(DIM, 1)
        self.dense = torch.nn.Linear(DENSE, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        from tritonrec.modules.dlrm import masked_bce_with_logits

        sequences = self.ec(batch.sparse_features)  # {feature: JaggedTensor [ids, DIM]}
        size = batch.dense_features.shape[0]
        logits = self.dense(batch.dense_features).squeeze(-1)
        for feature in FEATURES:
            jt = sequences[feature]
            sample = torch.repeat_interleave(torch.arange(size), jt.lengths().long(), output_size=jt.values().shape[0])
            logits = logits + torch.zeros(size).index_add(0, sample, self.score(jt.values()).squeeze(-1))
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_sequence_model(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over a SequenceModel, dense Adagrad, the sharded EC inside), the same initial weights
    on every call."""
    from tritonrec.dist import (
        EmbeddingCollectionSharder,
        ShardingPlan,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from tritonrec.dist.embedding import ShardedEmbeddingCollection
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.modules import EmbeddingConfig, FusedEmbeddingCollection
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    torch.manual_seed(3)
    tables = [EmbeddingConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
              for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
    ec = FusedEmbeddingCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    sharder = EmbeddingCollectionSharder()
    plan = {f"t_{f}": table_wise(rank=i % world) if kind == "tw" else row_wise() for i, f in enumerate(FEATURES)}
    module_plan = construct_module_sharding_plan(ec, plan, sharder, world, world, "cpu")
    dmp = DistributedModelParallel(SequenceModel(ec), device=CPU, plan=ShardingPlan({"ec": module_plan}),
                                   sharders=[sharder])  # fmt: skip
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    sharded = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingCollection))
    return dmp, torch.optim.Adagrad(dense, lr=0.05), sharded


def _progress_losses(pipeline: Any, data: Any) -> list[float]:
    losses = []
    while True:
        try:
            losses.append(float(pipeline.progress(data)[0]))
        except StopIteration:
            return losses


def sequence_cases(rank: int, world: int) -> dict[str, Any]:
    """Per sharding and pipeline: the losses, the base pipeline's, the state entries that differ from its, and the
    modules the pipeline prefetched for."""
    from tritonrec.dist.train_pipeline import (
        PipelineStage,
        SparseDataDistUtil,
        StagedTrainPipeline,
        TrainPipelineBase,
        TrainPipelineSparseDist,
    )

    out: dict[str, Any] = {}
    for kind in ("tw", "rw"):
        model, optimizer, sharded = build_sequence_model(kind, world)
        base = _progress_losses(TrainPipelineBase(model, optimizer, CPU), batches(rank, STEPS))
        base_weights = snapshot(model, sharded)
        model, optimizer, sharded = build_sequence_model(kind, world)
        pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
        losses = _progress_losses(pipeline, batches(rank, STEPS))
        runs = {"sparse_dist": (losses, pipeline.pipelined_modules, snapshot(model, sharded))}
        pipeline.close()
        model, optimizer, sharded = build_sequence_model(kind, world)
        sdd = SparseDataDistUtil(model)
        staged = StagedTrainPipeline([PipelineStage("data_copy", lambda b: b), sdd.start_sparse_data_dist_stage()])
        losses = staged_losses(staged, model, optimizer, batches(rank, STEPS))
        runs["staged"] = (losses, sdd.pipelined_modules, snapshot(model, sharded))
        staged.close()
        for name, (losses, pipelined, weights) in runs.items():
            differ = [k for k, v in base_weights.items() if not torch.equal(weights[k], v)]
            out[f"{kind}-{name}"] = {"losses": losses, "base_losses": base, "differ": differ, "pipelined": pipelined}
    return out
