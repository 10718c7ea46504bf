"""Rank-side cases (2 gloo ranks): GradientAccumulationWrapper around the sparse-dist pipeline on the sharded DLRM of
pipeline_cases.py, against the same model trained by a plain loop that syncs every micro-batch (DDP's average of
each micro-batch, summed over the window, then one dense step; the fused tables update every micro-batch on both
sides). The accumulated run skips DDP's sync inside each window, so the two differ only by rounding; a partial last
window (7 batches, windows of 3), and ranks whose data ends at different steps, must leave the dense replicas equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests.train_pipeline.pipeline_cases import CPU, batches, build_model, make_batch, run_to_end, snapshot


def _reference(rank: int, world: int, batch_list: list[Any], window: int) -> dict[str, Any]:
    model, optimizer, sharded = build_model("tw", world)
    losses = []
    for start in range(0, len(batch_list), window):
        optimizer.zero_grad()
        for batch in batch_list[start : start + window]:
            loss = model(batch)[0]
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return {"losses": losses, "weights": snapshot(model, sharded)}


def _accumulated(world: int, data: Iterator[Any], window: int, warmup: int) -> dict[str, Any]:
    from tritonrec.dist.train_pipeline import (
        GradientAccumulationConfig,
        GradientAccumulationWrapper,
        TrainPipelineSparseDist,
    )

    model, optimizer, sharded = build_model("tw", world)
    synced = _count_syncs(model)
    config = GradientAccumulationConfig(num_steps=window, num_warmup_steps=warmup)
    pipeline = GradientAccumulationWrapper(TrainPipelineSparseDist(model, optimizer, CPU), optimizer, model, config)
    losses = run_to_end(pipeline, data)
    steps = sorted({int(s["step"]) for s in optimizer.state.values()})
    return {"losses": losses, "weights": snapshot(model, sharded), "steps": steps, "synced": synced}


def _count_syncs(model: torch.nn.Module) -> list[int]:
    """A DDP comm hook on the model's one DDP that records the micro-batch of each bucket it all-reduces (the
    small dense arch fits one bucket, so one entry per synced backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    (ddp,) = [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
    calls: list[int] = []
    backwards = [0]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a string (postponed) annotation here
        calls.append(backwards[0])
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    ddp.register_forward_pre_hook(lambda *_: backwards.__setitem__(0, backwards[0] + 1))
    return calls


def _dense_equal_across_ranks(weights: dict[str, torch.Tensor]) -> bool:
    """Whether every dense parameter (not a table shard) holds the same bits on every rank."""
    dense = [w.reshape(-1) for name, w in sorted(weights.items()) if "embedding_bags" not in name and ":" not in name]
    flat = torch.cat(dense)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) if got[k].numel() else 0.0 for k in want)


def _dense_table_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """DistributedModelParallel over a DLRMTrain whose tables are table-wise on the dense kernel: their shards (of
    different shapes per rank) are trained by the dense optimizer but are no DDP parameters (DDP ignores them)."""
    from tests.train_pipeline.pipeline_cases import DENSE, DIM, FEATURES, ROWS
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from tritonrec.modules.dlrm import DLRM, DLRMTrain

    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
              for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
    ebc, sharder = EmbeddingBagCollection(tables, backend="torch"), EmbeddingBagCollectionSharder()
    plan = {f"t_{f}": table_wise(rank=i % world, compute_kernel="dense") for i, f in enumerate(FEATURES)}
    module_plan = construct_module_sharding_plan(ebc, plan, sharder, world, world, "cpu")
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    model = DLRMTrain(DLRM(ebc, DENSE, [16, DIM], [16, 1]))
    dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder])
    return dmp, torch.optim.SGD(dmp.parameters(), lr=0.05)


def _dense_tables_case(rank: int, world: int) -> dict[str, Any]:
    """7 micro-batches in windows of 3: the flush of the last, unsynced window all-reduces the DDP parameters only
    (averaging the table shards too mixed different tables' gradients, or hung on their different sizes)."""
    from tritonrec.dist.train_pipeline import (
        GradientAccumulationConfig,
        GradientAccumulationWrapper,
        TrainPipelineSparseDist,
    )

    model, optimizer = _dense_table_model(world)
    config = GradientAccumulationConfig(num_steps=3)
    pipeline = GradientAccumulationWrapper(TrainPipelineSparseDist(model, optimizer, CPU), optimizer, model, config)
    losses = run_to_end(pipeline, batches(rank, 7))
    reference, ref_optimizer = _dense_table_model(world)
    ref_losses, batch_list = [], list(batches(rank, 7))
    for start in range(0, len(batch_list), 3):
        ref_optimizer.zero_grad()
        for batch in batch_list[start : start + 3]:
            loss = reference(batch)[0]
            loss.backward()
            ref_losses.append(loss.item())
        ref_optimizer.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weights": _max_diff(weights, want),
        "replicas_equal": _dense_equal_across_ranks(weights),
    }


class _Branchy(torch.nn.Module):
    """Two heads; ``batch.labels.sum() > 2`` picks whether the second one runs (data-dependent, so ranks may differ)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.first, self.second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

    def forward(self, batch: Any) -> tuple:
        out = self.first(batch.dense_features).sum()
        if batch.labels.sum() > 2:
            out = out + self.second(batch.dense_features).sum()
        return out, (out.detach(),)


def _unused_on_one_rank_case(rank: int, world: int) -> dict[str, Any]:
    """4 micro-batches in windows of 3 (``find_unused_parameters``): in the last, unsynced one only rank 1 runs the
    second head, so rank 0 holds no gradient for it at the flush (it all-reduced lists of different lengths)."""
    from torch.nn.parallel import DistributedDataParallel

    from tritonrec.data.batch import Batch
    from tritonrec.dist.train_pipeline import GradientAccumulationConfig, GradientAccumulationWrapper, TrainPipelineBase

    def batch(step: int) -> Batch:
        base = make_batch(rank, step)
        labels = torch.ones_like(base.labels) if step < 3 or rank == 1 else torch.zeros_like(base.labels)
        return Batch(base.dense_features[:, :3], base.sparse_features, labels, base.valid_mask)

    model = DistributedDataParallel(_Branchy(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(num_steps=3)
    pipeline = GradientAccumulationWrapper(TrainPipelineBase(model, optimizer, CPU), optimizer, model, config)
    data = iter([batch(step) for step in range(4)])
    while True:
        try:
            pipeline.progress(data)
        except StopIteration:
            break
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"replicas_equal": _dense_equal_across_ranks(weights)}


class _SparseBagModel(torch.nn.Module):
    """A dense-part ``nn.EmbeddingBag(sparse=True)`` (sparse gradients under DDP) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.bag = torch.nn.EmbeddingBag(64, 3, mode="sum", sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, batch: Any) -> tuple:
        kjt = batch.sparse_features
        out = self.head(self.bag(kjt.values() % 64, kjt.offsets()[:-1].long())).square().mean()
        return out, (out.detach(), out.detach(), batch.labels)  # (loss, logits, labels), as run_to_end reads it


def _sparse_gradient_case(rank: int, world: int) -> dict[str, Any]:
    """4 micro-batches in windows of 3: the flush all-reduces the partial window's sparse embedding gradient (it
    failed on a sparse tensor), against a loop that syncs every micro-batch."""
    from torch.nn.parallel import DistributedDataParallel

    from tritonrec.dist.train_pipeline import GradientAccumulationConfig, GradientAccumulationWrapper, TrainPipelineBase

    def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model = DistributedDataParallel(_SparseBagModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(num_steps=3)
    pipeline = GradientAccumulationWrapper(TrainPipelineBase(model, optimizer, CPU), optimizer, model, config)
    run_to_end(pipeline, batches(rank, 4))
    reference = DistributedDataParallel(_SparseBagModel())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = list(batches(rank, 4))
    for window in (data[:3], data[3:]):
        ref_optimizer.zero_grad()
        for batch in window:
            reference(batch)[0].backward()
        ref_optimizer.step()
    got = weights(model)
    return {"replicas_equal": _dense_equal_across_ranks(got), "weights": _max_diff(got, weights(reference))}


def accumulation_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, count, window, warmup in (("partial_window", 7, 3, 1), ("warmup", 8, 4, 3)):
        got = _accumulated(world, batches(rank, count), window, warmup)
        want = _reference(rank, world, list(batches(rank, count)), window)
        out[label] = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True)),
            "weights": _max_diff(got["weights"], want["weights"]),
            "replicas_equal": _dense_equal_across_ranks(got["weights"]),
            "steps": got["steps"],
            "count": len(got["losses"]),
            "synced": got["synced"],
        }
    # uneven ends: the pipeline stops both ranks at rank 1's last batch (5), mid-window (windows of 3)
    got = _accumulated(world, batches(rank, 7 if rank == 0 else 5), 3, 1)
    out["uneven"] = {
        "replicas_equal": _dense_equal_across_ranks(got["weights"]),
        "steps": got["steps"],
        "count": len(got["losses"]),
    }
    out["dense_tables"] = _dense_tables_case(rank, world)
    out["unused_on_one_rank"] = _unused_on_one_rank_case(rank, world)
    out["sparse_gradient"] = _sparse_gradient_case(rank, world)
    return out
