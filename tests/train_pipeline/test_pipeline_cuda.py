"""The train pipelines on a CUDA device (skipped without one). One process joins a one-rank NCCL group; the DLRM of
pipeline_cases is sharded by DistributedModelParallel onto the GPU (compiled Triton lookups and fused rowwise Adagrad)
and trained for 20 steps by TrainPipelineSparseDist (its memcpy and data-dist streams) and by StagedTrainPipeline (a
stream per stage), each compared with TrainPipelineBase bit for bit: losses, every weight and the optimizer's per-row
state. Table-wise and row-wise, with fp32 and with fp16 on the output dist's wire. A stream bug (a batch read before
its copy finished, a buffer freed while another stream still reads it) shows as a difference from ``base``.

The helpers take the device and backend, so ``run_case("cpu", "gloo", ...)`` checks the harness without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_utils import one_rank_environment

from tests.train_pipeline.pipeline_cases import DENSE, DIM, FEATURES, ROWS, make_batch, run_to_end, snapshot
from tests.train_pipeline.toy import staged_losses

pytestmark = pytest.mark.gpu

STEPS = 20


def build(kind: str, device: torch.device, qcomm: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DMP over a DLRMTrain on ``device``, dense Adagrad, the sharded EBC); the same initial weights every call."""
    from tritonrec.dist import QCommsConfig, ShardingPlan, construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.dist.qcomm_config import get_qcomm_codecs_registry
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM, DLRMTrain
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
              for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1})  # backend auto: Triton on CUDA
    registry = None
    if qcomm != "fp32":
        config = QCommsConfig(forward_precision=qcomm, backward_precision=qcomm)
        registry = get_qcomm_codecs_registry(config, device=device)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    plan = {f"t_{f}": table_wise(rank=0) if kind == "tw" else row_wise() for f in FEATURES}
    module_plan = construct_module_sharding_plan(ebc, plan, sharder, 1, 1, device.type)
    model = DLRMTrain(DLRM(ebc, DENSE, [16, DIM], [16, 1]))
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    sharded = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05), sharded


def data() -> Iterator[Any]:
    """Host batches (the pipelines copy them to the device)."""
    return (make_batch(0, step) for step in range(STEPS))


def train(pipeline_kind: str, kind: str, device: torch.device, qcomm: str) -> dict[str, Any]:
    from tritonrec.dist.train_pipeline import (
        PipelineStage,
        SparseDataDistUtil,
        StagedTrainPipeline,
        TrainPipelineBase,
        TrainPipelineSparseDist,
    )

    model, optimizer, sharded = build(kind, device, qcomm)
    if pipeline_kind == "staged":
        cuda = device.type == "cuda"
        sdd = SparseDataDistUtil(model, data_dist_stream=torch.cuda.Stream() if cuda else None)
        copy = PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True),
                             stream=torch.cuda.Stream() if cuda else None)  # fmt: skip
        dist_stage = PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, stream=sdd.data_dist_stream,
                                   fill_callback=sdd.wait_sdd_fill_callback)  # fmt: skip
        stages = [copy, dist_stage]
        pipeline = StagedTrainPipeline(stages)
        losses = staged_losses(pipeline, model, optimizer, data())
        pipeline.close()
        pipelined = sdd.pipelined_modules
    else:
        make = TrainPipelineBase if pipeline_kind == "base" else TrainPipelineSparseDist
        pipeline = make(model, optimizer, device)
        losses = run_to_end(pipeline, data())
        pipelined = getattr(pipeline, "pipelined_modules", None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    weights = {k: v.cpu() for k, v in snapshot(model, sharded).items()}
    on_device = {p.device.type for p in model.parameters()}
    return {"losses": losses, "weights": weights, "pipelined": pipelined, "devices": on_device}


def run_case(device_name: str, backend: str, kind: str, qcomm: str) -> None:
    """Join a one-rank group (unless one is up), train base / sparse_dist / staged and compare them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with one_rank_environment():
            dist.init_process_group(backend)
    device = torch.device(device_name)
    base = train("base", kind, device, qcomm)
    assert base["devices"] == {device.type}
    assert len(base["losses"]) == STEPS and all(torch.isfinite(torch.tensor(base["losses"])))
    for pipeline_kind in ("sparse_dist", "staged"):
        other = train(pipeline_kind, kind, device, qcomm)
        assert other["pipelined"], f"{pipeline_kind} pipelined no module"
        assert other["losses"] == base["losses"], f"{pipeline_kind} {kind} {qcomm}: losses differ from base"
        assert other["weights"].keys() == base["weights"].keys()
        for name, value in base["weights"].items():
            assert torch.equal(other["weights"][name], value), f"{pipeline_kind} {kind} {qcomm}: {name} differs"


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[None]:
    """The one-rank group ``run_case`` joins, taken down after the module."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("kind", "qcomm"), [("tw", "fp32"), ("rw", "fp32"), ("tw", "fp16")])
def test_pipelines_on_cuda_equal_base(nccl_group: None, kind: str, qcomm: str) -> None:
    run_case("cuda", "nccl", kind, qcomm)
