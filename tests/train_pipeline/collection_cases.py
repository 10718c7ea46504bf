"""Rank-side cases (2 gloo ranks): the other sharded collections under DistributedModelParallel, trained by
TrainPipelineSparseDist and StagedTrainPipeline and compared with TrainPipelineBase bit for bit, table-wise and
row-wise. The pipelines were built around the pooled collection; these must be traced and prefetched all the same:

* a sequence model on a sharded ``EmbeddingCollection`` (per-id embeddings, no pooling; fused rowwise Adagrad);
* the DLRM's EBC on a mixed plan (table-, row-, column-wise and data-parallel tables at once) fed weighted KJTs;
* the DLRM's EBC fed int32 ids (torchrec's npy reader gives them), which must train as int64 ids do;
* a ``FeatureProcessedEmbeddingBagCollection`` (learned position weights, torchrec's DLRM v2 features), with fused
  and with dense tables. Its position weights must be read when a batch is looked up: a pipeline starts the next
  batch's input dist before this batch's optimizer step updates them in place (taking them at the input dist raised
  autograd's in-place error).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.train_pipeline.pipeline_cases import CPU, DENSE, DIM, FEATURES, ROWS, batches, build_model, snapshot
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


def _configs(config_type: type) -> list[Any]:
    """One table per feature of pipeline_cases' batches (``t_<feature>``, ``ROWS`` rows, ``DIM`` wide)."""
    return [config_type(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
            for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip


def _shard(
    model: torch.nn.Module, path: str, generators: dict[str, Any], sharder: Any, world: int, kernel: str | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel of ``model`` with the collection at ``path`` sharded by ``generators`` (table ->
    sharding; ``kernel``: force a compute kernel), dense Adagrad over the rest, the sharded collection (the EBC
    inside a feature-processed one))."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan
    from tritonrec.dist.embedding import ShardedEmbeddingCollection
    from tritonrec.dist.embeddingbag import ShardedEmbeddingBagCollection
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    module_plan = construct_module_sharding_plan(model.get_submodule(path), generators, sharder, world, world, "cpu")
    for sharding in module_plan.values():
        sharding.compute_kernel = kernel or sharding.compute_kernel
    dmp = DistributedModelParallel(model, device=CPU, plan=ShardingPlan({path: module_plan}), sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    kinds = (ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)
    sharded = next(m for m in dmp.modules() if isinstance(m, kinds))
    return dmp, torch.optim.Adagrad(dense, lr=0.05), sharded


def _tw_or_rw(kind: str, world: int) -> dict[str, Any]:
    from tritonrec.dist import row_wise, table_wise

    return {f"t_{f}": table_wise(rank=i % world) if kind == "tw" else row_wise() for i, f in enumerate(FEATURES)}


def build_sequence_model(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over a SequenceModel, dense Adagrad, the sharded EC inside), the same initial weights
    on every call."""
    from tritonrec.dist import EmbeddingCollectionSharder
    from tritonrec.modules import EmbeddingConfig, FusedEmbeddingCollection

    torch.manual_seed(3)
    ec = FusedEmbeddingCollection(_configs(EmbeddingConfig), "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    return _shard(SequenceModel(ec), "ec", _tw_or_rw(kind, world), EmbeddingCollectionSharder(), world)


class ProcessedModel(torch.nn.Module):
    """A linear score of the pooled, position-weighted features and the dense features."""

    def __init__(self, fp: torch.nn.Module) -> None:
        super().__init__()
        self.fp = fp
        self.linear = torch.nn.Linear(len(FEATURES) * DIM + DENSE, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        from tritonrec.modules.dlrm import masked_bce_with_logits

        logits = self.linear(torch.cat([self.fp(batch.sparse_features).values(), batch.dense_features], 1)).squeeze(-1)
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_processed_model(kind: str, world: int, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over a ProcessedModel, dense Adagrad over the rest, the sharded EBC inside)."""
    from tritonrec.dist import FeatureProcessedEmbeddingBagCollectionSharder
    from tritonrec.modules import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        FeatureProcessedEmbeddingBagCollection,
        PositionWeightedModuleCollection,
    )

    torch.manual_seed(3)
    processors = PositionWeightedModuleCollection({f: 5 for f in FEATURES})  # bags hold 0-4 ids
    with torch.no_grad():
        for weight in processors.position_weights.values():
            weight.copy_(torch.rand(weight.shape) + 0.5)  # not all ones, so they matter
    ebc = EmbeddingBagCollection(_configs(EmbeddingBagConfig), is_weighted=True, backend="torch")
    fp = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    fused_params = {"optimizer": "EXACT_ROWWISE_ADAGRAD", "lr": 0.1} if fused else None
    sharder = FeatureProcessedEmbeddingBagCollectionSharder(fused_params=fused_params)
    return _shard(ProcessedModel(fp), "fp", _tw_or_rw(kind, world), sharder, world, "fused" if fused else "dense")


def build_mixed_weighted(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over the DLRM of pipeline_cases with a weighted EBC whose four tables are sharded
    table-wise, row-wise, column-wise and data-parallel, dense Adagrad, the sharded EBC)."""
    from tritonrec.dist import column_wise, data_parallel, row_wise, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM, DLRMTrain

    torch.manual_seed(3)
    ebc = FusedEmbeddingBagCollection(_configs(EmbeddingBagConfig), "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1},
                                      backend="torch", is_weighted=True)  # fmt: skip
    kinds = [table_wise(rank=1 % world), row_wise(), column_wise(ranks=list(range(world))[::-1]),
             data_parallel(compute_kernel="fused")]  # fmt: skip
    generators = {f"t_{f}": g for f, g in zip(FEATURES, kinds, strict=True)}
    model = DLRMTrain(DLRM(ebc, DENSE, [16, DIM], [16, 1]))
    return _shard(
        model, "model.sparse_arch.embedding_bag_collection", generators, EmbeddingBagCollectionSharder(), world
    )


def weighted_batches(rank: int, count: int) -> Iterator[Any]:
    """pipeline_cases' batches with a per-id weight in [0, 1) on every value."""
    for batch in batches(rank, count):
        kjt = batch.sparse_features
        g = torch.Generator().manual_seed(rank * 1000 + int(kjt.values().sum()))
        weights = torch.rand(kjt.values().shape, generator=g)
        weighted = type(kjt)(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
        yield type(batch)(batch.dense_features, weighted, batch.labels, batch.valid_mask)


def _progress_losses(pipeline: Any, data: Any) -> list[float]:
    losses = []
    while True:
        try:
            losses.append(float(pipeline.progress(data)[0]))
        except StopIteration:
            return losses


def _pipelines_vs_base(build: Callable[[], tuple[Any, Any, Any]], data: Callable[[], Iterator[Any]]) -> dict[str, Any]:
    """Per pipeline (sparse_dist, staged): its losses, the base pipeline's, the parameters and fused optimizer state
    that differ from the base run's, and the modules it prefetched for."""
    from tritonrec.dist.train_pipeline import (
        PipelineStage,
        SparseDataDistUtil,
        StagedTrainPipeline,
        TrainPipelineBase,
        TrainPipelineSparseDist,
    )

    model, optimizer, sharded = build()
    base = _progress_losses(TrainPipelineBase(model, optimizer, CPU), data())
    base_weights = snapshot(model, sharded)
    model, optimizer, sharded = build()
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
    losses = _progress_losses(pipeline, data())
    runs = {"sparse_dist": (losses, pipeline.pipelined_modules, snapshot(model, sharded))}
    pipeline.close()
    model, optimizer, sharded = build()
    sdd = SparseDataDistUtil(model)
    staged = StagedTrainPipeline([PipelineStage("data_copy", lambda b: b), sdd.start_sparse_data_dist_stage()])
    losses = staged_losses(staged, model, optimizer, data())
    runs["staged"] = (losses, sdd.pipelined_modules, snapshot(model, sharded))
    staged.close()
    out = {}
    for name, (losses, pipelined, weights) in runs.items():
        differ = [k for k, v in base_weights.items() if not torch.equal(weights[k], v)]
        out[name] = {"losses": losses, "base_losses": base, "differ": differ, "pipelined": pipelined}
    return out


def collection_cases(rank: int, world: int) -> dict[str, Any]:
    """``{collection}-{sharding}-{pipeline}`` -> what :func:`_pipelines_vs_base` reports."""
    from tritonrec.dist.train_pipeline import TrainPipelineBase

    builds: dict[str, Callable[[str], tuple[Any, Any, Any]]] = {
        "ec": lambda kind: build_sequence_model(kind, world),
        "fp_fused": lambda kind: build_processed_model(kind, world, fused=True),
        "fp_dense": lambda kind: build_processed_model(kind, world, fused=False),
    }
    plain = functools.partial(batches, rank, STEPS)
    out: dict[str, Any] = {}
    for collection, build in builds.items():
        for kind in ("tw", "rw"):
            for name, result in _pipelines_vs_base(functools.partial(build, kind), plain).items():
                out[f"{collection}-{kind}-{name}"] = result
    mixed = _pipelines_vs_base(
        functools.partial(build_mixed_weighted, world), functools.partial(weighted_batches, rank, STEPS)
    )
    out.update({f"ebc_weighted-mixed-{name}": result for name, result in mixed.items()})
    # int32 ids (torchrec's npy reader gives them): the same training as int64 ids, through every pipeline
    for kind in ("tw", "rw"):
        build = functools.partial(build_model, kind, world)
        int64 = _progress_losses(TrainPipelineBase(*build()[:2], CPU), plain())
        for name, result in _pipelines_vs_base(build, functools.partial(int32_batches, rank, STEPS)).items():
            out[f"ebc_int32-{kind}-{name}"] = {**result, "int64_losses": int64}
    return out


def int32_batches(rank: int, count: int) -> Iterator[Any]:
    """pipeline_cases' batches with int32 ids."""
    for batch in batches(rank, count):
        kjt = batch.sparse_features
        narrow = type(kjt)(kjt.keys(), kjt.values().int(), lengths=kjt.lengths())
        yield type(batch)(batch.dense_features, narrow, batch.labels, batch.valid_mask)
