"""Rank-side checkpoint cases: a DLRM under DMP saved at one world size and plan, loaded at another.

The chain: the 2-rank spawn trains 3 steps table-wise and saves ``tw2`` (and, asynchronously, ``async2``); the
4-rank spawn loads ``tw2`` row-wise (2 -> 4, TW -> RW), saves ``rw4``, trains 2 more steps; then a 2-rank subgroup
of it loads ``rw4`` column-wise (4 -> 2, RW -> CW) and saves ``cw2``. The tests compare the checkpoints as unsharded
tensors (identical), the resumed training with the single-process reference, and the async snapshot.

Files the tests read: ``<root>/expected.pt`` (written by rank 0 of the 2-rank spawn: the unsharded weights at step 3
and at the async save, the single-process reference's state at step 3 and its weights at step 5).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from tests.model_parallel.dlrm_cases import batch_slice, build_dlrm, dense_optimizer, global_batch, loss_of, wrap

ROOT_ENV = "TRITONREC_TEST_CHECKPOINT_ROOT"
GLOBAL_BATCH = 8
SAVED_AT = 3


class DataPosition:
    """A data loader's position, restored through datarax's ``get_state`` / ``set_state``."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def root() -> Path:
    return Path(os.environ[ROOT_ENV])


def _step(model: Any, optimizer: Any, step: int, lo: int, hi: int) -> None:
    optimizer.zero_grad()
    loss_of(model, *batch_slice(global_batch(step, GLOBAL_BATCH), lo, hi)).backward()
    optimizer.step()


def _train(dmp: Any, optimizer: Any, steps: range, rank: int, world: int) -> None:
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        _step(dmp, optimizer, step, per_rank * rank, per_rank * (rank + 1))


def run_save_suite(rank: int, world: int) -> dict[str, Any]:
    """2 ranks: train table-wise, save (sync and async), record what the other spawns must reproduce."""
    from tritonrec.dist.checkpoint import CheckpointManager, gather_unsharded_state_dict

    model = build_dlrm()
    reference = copy.deepcopy(model)
    dmp = wrap(model, "tw", world)
    dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    _train(dmp, dense, range(SAVED_AT), rank, world)
    for step in range(SAVED_AT):
        _step(reference, ref_dense, step, 0, GLOBAL_BATCH)
    path = CheckpointManager(root() / "tw2").save(SAVED_AT, dmp, {"dense": dense}, {"data": DataPosition(SAVED_AT)})
    at_save = gather_unsharded_state_dict(dmp)
    # async: the state is copied when save() returns; training on while the files are written must not change them
    manager = CheckpointManager(root() / "async2", async_save=True)
    manager.save(SAVED_AT, dmp, {"dense": dense})
    _train(dmp, dense, range(SAVED_AT, SAVED_AT + 1), rank, world)
    published = manager.wait()
    trained_on = gather_unsharded_state_dict(dmp)
    if rank == 0:
        ref_state = {
            "model": {k: v.clone() for k, v in reference.state_dict().items()},
            "fused": reference.get_submodule("sparse_arch.embedding_bag_collection").fused_optimizer.state_dict(),
            "dense": copy.deepcopy(ref_dense.state_dict()),
        }
        for step in range(SAVED_AT, SAVED_AT + 2):
            _step(reference, ref_dense, step, 0, GLOBAL_BATCH)
        expected = {
            "at_save": at_save,
            "trained_on": trained_on,
            "reference_at_save": ref_state,
            "reference_after": {k: v.clone() for k, v in reference.state_dict().items()},
        }
        torch.save(expected, root() / "expected.pt")
    return {"path": str(path), "async_path": str(published), "plan": str(dmp.plan)}


def run_reshard_suite(rank: int, world: int) -> dict[str, Any]:
    """4 ranks: load ``tw2`` row-wise, save ``rw4``, train on; a 2-rank subgroup loads ``rw4`` column-wise."""
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv
    from tritonrec.dist.checkpoint import CheckpointManager, gather_unsharded_state_dict

    out: dict[str, Any] = {}
    dmp = wrap(build_dlrm(seed=11), "rw", world)  # other initial values: the load must overwrite every one
    dense = dense_optimizer(dmp.named_parameters())
    data = DataPosition()
    loaded = CheckpointManager(root() / "tw2").load(dmp, {"dense": dense}, {"data": data})
    out["step"], out["position"] = loaded.step, data.position
    out["saved_plan_has_table_wise"] = "table_wise" in loaded.manifest["extra"]["plan"]
    CheckpointManager(root() / "rw4").save(SAVED_AT, dmp, {"dense": dense}, {"data": data})
    _train(dmp, dense, range(SAVED_AT, SAVED_AT + 2), rank, world)
    after = gather_unsharded_state_dict(dmp)
    if rank == 0:
        expected = torch.load(root() / "expected.pt", weights_only=False)["reference_after"]
        out["after_two_steps"] = max(float((after[k] - v).abs().max()) for k, v in expected.items())
    subgroup = dist.new_group([0, 1])
    if rank < 2:
        env = ShardingEnv.from_process_group(subgroup)
        small = wrap(build_dlrm(seed=12), "cw", 2, env=env)
        small_dense = dense_optimizer(small.named_parameters())
        position = DataPosition()
        manager = CheckpointManager(root() / "rw4", pg=subgroup)
        manager.load(small, {"dense": small_dense}, {"data": position})
        CheckpointManager(root() / "cw2", pg=subgroup).save(SAVED_AT, small, {"dense": small_dense}, {"data": position})
        out["cw_plan"] = sorted({p.sharding_type for m in small.plan.plan.values() for p in m.values()})
    dist.barrier()
    return out
