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

from tests.train_pipeline.pipeline_cases import CPU, batches, build_model, run_to_end, snapshot


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
    return out
