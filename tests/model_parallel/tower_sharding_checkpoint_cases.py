"""Rank-side checkpoint cases of tower sharding on 2 gloo ranks, one per host (run in test_tower_sharding.py's spawn,
after its topology case): a DMP with a tower-sharded collection (tower 0 on rank 0, tower 1 on rank 1) trains 2
steps and is saved by ``save_checkpoint`` (model, fused rowwise-Adagrad state of the towers' tables, the dense SGD +
momentum optimizer whose parameters differ by rank: each rank holds its tower's interaction only). A fresh DMP with
other initial weights then loads it, under the same plan and under the towers swapped between the hosts, and trains
2 more steps: its losses and its gathered state must be exactly those of the DMP that kept training. Also
``gather_unsharded_state_dict`` (tables on different sub-groups, interactions on one host each) against an
independent gather, the checkpoint read as plain tensors, and ``load_state_dict`` of the full unsharded state dict.
The same cases run on 4 ranks as 2 hosts of 2 (tower_sharding_host_cases.py) and with ``EmbeddingTowerSharder``.

Before loading, the fresh DMP runs :data:`PRIMING_PASSES` backward pass (no optimizer step): it moves the fused
tables' weights, optimizer state and ``step`` away from the saved ones, so a load that left any of them alone would
show. One pass leaves the fresh DDP (``static_graph``) in its initial bucket layout at the first resumed step, where
the DMP that kept training reduces in the rebuilt one (test_three_ranks.py checks that the default deterministic
all-reduce above 2 gloo ranks makes the layout not matter).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.model_parallel.dlrm_cases import BATCH_PER_RANK, batch_slice, dense_optimizer, global_batch, max_diff
from tests.model_parallel.tower_sharding_cases import TowerModel, _wrap, collection_plan, gather_state_dict, loss_fn

ROOT_ENV = "TRITONREC_TOWER_CHECKPOINT_ROOT"
SAVED_AT = 2
RESUMED_STEPS = 2
PRIMING_PASSES = 1


PlanFn = Callable[[nn.Module, tuple[int, int], int, int], Any]


def make_checkpoint_root() -> str:
    """A temporary directory the spawned ranks save under (they inherit it through the environment), removed at
    exit; call before spawning."""
    root = tempfile.mkdtemp(prefix="tritonrec-tower-checkpoints-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ[ROOT_ENV] = root
    return root


def _build(seed: int, hosts: tuple[int, int], world: int, local: int, plan: PlanFn) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = TowerModel()
    dmp = _wrap(model, plan(model, hosts, world, local))
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


def _prime(dmp: Any, optimizer: Any, rank: int, world: int) -> None:
    """:data:`PRIMING_PASSES` forward/backward passes on an unrelated batch, gradients then cleared (see module
    docstring)."""
    batch = global_batch(99, BATCH_PER_RANK * world)
    for _ in range(PRIMING_PASSES):
        loss_fn(dmp, *batch_slice(batch, BATCH_PER_RANK * rank, BATCH_PER_RANK * (rank + 1))).backward()
        optimizer.zero_grad()


def _state_diff(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor] | None) -> float | None:
    """Largest difference of two gathered state dicts (on rank 0; ``inf`` when their keys differ)."""
    if got is None or want is None:
        return None
    if sorted(got) != sorted(want):
        return float("inf")
    return max(max_diff(got[k], want[k]) for k in want)


def run_checkpoint(
    rank: int, world: int, local: int = 1, plan: PlanFn = collection_plan, tag: str = "collection"
) -> dict[str, Any]:
    """The cases above for ``world`` ranks, ``local`` per host, under ``plan(model, hosts, world, local)`` (the
    collection sharder's by default; ``tag`` names the checkpoint's directory)."""
    from tritonrec.dist.checkpoint import (
        gather_unsharded_state_dict,
        load_checkpoint,
        load_unsharded_checkpoint,
        save_checkpoint,
    )

    path = Path(os.environ[ROOT_ENV]) / f"{tag}_w{world}_step_{SAVED_AT}"
    dmp, optimizer = _build(3, (0, 1), world, local, plan)
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
        fresh, fresh_optimizer = _build(11, hosts, world, local, plan)
        _prime(fresh, fresh_optimizer, rank, world)
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
    fresh, _ = _build(11, (1, 0), world, local, plan)
    full: list[Any] = [at_save]
    torch.distributed.broadcast_object_list(full, src=0)
    fresh.load_state_dict(full[0])
    result["load_state_dict"] = _state_diff(gather_unsharded_state_dict(fresh), at_save)
    return result
