"""Rank-side checkpoint cases of tower sharding on 2 gloo ranks, one per host (run in test_tower_sharding.py's spawn,
after its topology case): a DMP with a tower-sharded collection (tower 0 on rank 0, tower 1 on rank 1) trains 2
steps and is saved by ``save_checkpoint`` (model, fused rowwise-Adagrad state of the towers' tables, the dense SGD +
momentum optimizer whose parameters differ by rank: each rank holds its tower's interaction only). A fresh DMP with
other initial weights then loads it, under the same plan and under the towers swapped between the hosts, and trains
2 more steps: its losses and its gathered state must be exactly those of the DMP that kept training. Also
``gather_unsharded_state_dict`` (tables on different sub-groups, interactions on one host each) against an
independent gather, the checkpoint read as plain tensors, and ``load_state_dict`` of the full unsharded state dict.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.model_parallel.dlrm_cases import BATCH_PER_RANK, batch_slice, dense_optimizer, global_batch, max_diff
from tests.model_parallel.tower_sharding_cases import TowerModel, _wrap, collection_plan, gather_state_dict, loss_fn

ROOT_ENV = "TRITONREC_TOWER_CHECKPOINT_ROOT"
SAVED_AT = 2
RESUMED_STEPS = 2


def _build(seed: int, hosts: tuple[int, int], world: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = TowerModel()
    dmp = _wrap(model, collection_plan(model, hosts, world))
    return dmp, dense_optimizer(dmp.named_parameters())


def _step(dmp: Any, optimizer: Any, step: int, rank: int, world: int) -> float:
    """One step on this rank's slice of global batch ``step``; the global mean loss (identical on every rank)."""
    import torch.distributed as dist

    batch = global_batch(step, BATCH_PER_RANK * world)
    optimizer.zero_grad()
    loss = loss_fn(dmp, *batch_slice(batch, BATCH_PER_RANK * rank, BATCH_PER_RANK * (rank + 1)))
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def _state_diff(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor] | None) -> float | None:
    """Largest difference of two gathered state dicts (on rank 0; ``inf`` when their keys differ)."""
    if got is None or want is None:
        return None
    if sorted(got) != sorted(want):
        return float("inf")
    return max(max_diff(got[k], want[k]) for k in want)


def run_checkpoint(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.checkpoint import (
        gather_unsharded_state_dict,
        load_checkpoint,
        load_unsharded_checkpoint,
        save_checkpoint,
    )

    path = Path(os.environ[ROOT_ENV]) / f"step_{SAVED_AT}"
    dmp, optimizer = _build(3, (0, 1), world)
    for step in range(SAVED_AT):
        _step(dmp, optimizer, step, rank, world)
    save_checkpoint(path, dmp, {"dense": optimizer}, step=SAVED_AT)
    at_save = gather_unsharded_state_dict(dmp)
    independent = gather_state_dict(dmp.state_dict())  # shard by shard, over the world (the test's own gather)
    result: dict[str, Any] = {"gather": _state_diff(at_save, independent)}
    if rank == 0:
        saved = load_unsharded_checkpoint(path)["model"]
        result["unsharded_file"] = _state_diff({k: v for k, v in saved.items()}, at_save)
    kept = [_step(dmp, optimizer, step, rank, world) for step in range(SAVED_AT, SAVED_AT + RESUMED_STEPS)]
    final = gather_unsharded_state_dict(dmp)
    for name, hosts in (("same_plan", (0, 1)), ("swapped_plan", (1, 0))):
        fresh, fresh_optimizer = _build(11, hosts, world)
        before = _state_diff(gather_unsharded_state_dict(fresh), at_save)
        loaded = load_checkpoint(path, fresh, {"dense": fresh_optimizer})
        resumed = [_step(fresh, fresh_optimizer, s, rank, world) for s in range(SAVED_AT, SAVED_AT + RESUMED_STEPS)]
        result[name] = {
            "step": loaded.step,
            "differed_before": before,
            "loss": max(abs(a - b) for a, b in zip(kept, resumed, strict=True)),
            "state": _state_diff(gather_unsharded_state_dict(fresh), final),
        }
    # the full unsharded state dict (every tower's entries) loads into a tower-sharded DMP: each host takes its own
    fresh, _ = _build(11, (1, 0), world)
    full: list[Any] = [at_save]
    torch.distributed.broadcast_object_list(full, src=0)
    fresh.load_state_dict(full[0])
    result["load_state_dict"] = _state_diff(gather_unsharded_state_dict(fresh), at_save)
    return result
