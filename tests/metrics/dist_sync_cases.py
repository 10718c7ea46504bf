"""Rank side of the sync()/unsync() and pre-compute-states cases in tests/metrics/test_metrics_dist.py (run inside
the same spawn as dist_cases.run_rank): each rank feeds its own stream, then records what the synced module reports,
the states get_pre_compute_states() returns (default group and a 1-D DeviceMesh), and what a fresh module reports
after loading them; and the compute_interval_steps each rank adjusts to when the ranks' clocks differ."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.metrics.dist_cases import BATCH, TASKS, build, rank_stream, run_rank
from tests.metrics.reference import stream
from tests.metrics.test_compute_interval import ours
from tritonrec.metrics import AUCMetric, RecComputeMode, RecMetricException, RecMetricList, RecMetricModule

UNEVEN_BATCH = 3  # rank r feeds r + 1 batches to an AUC module: the ranks keep different sample counts
# {case: (compute_interval_steps, min, max, [each rank's clock at its computes])}
INTERVAL_CASES = {
    "both_outside": (10, 5.0, math.inf, [[100.0, 101.0, 102.0], [100.0, 102.0, 103.0]]),  # want 60 and 30
    "inside_and_slow": (10, 2.0, 6.0, [[100.0, 104.0], [100.0, 120.0]]),  # want 10 (kept) and 2
    "inside_and_fast": (10, 2.0, 6.0, [[100.0, 104.0], [100.0, 100.5]]),  # want 10 (kept) and 80
}


def _floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in values.items()}


def _sync_cases(rank: int, world: int, mode: RecComputeMode) -> dict[str, Any]:
    module = build(world, rank, BATCH, mode)
    for step in rank_stream(rank):
        module.update(step)
    out: dict[str, Any] = {"local": _floats(module.local_compute()), "compute": _floats(module.compute())}
    module.sync()
    out["synced_local"] = _floats(module.local_compute())
    out["synced_compute"] = _floats(module.compute())
    try:
        module.sync()
        out["sync_twice"] = "no error"
    except RecMetricException as error:
        out["sync_twice"] = str(error)
    try:  # while synced: refused (torchrec 1.8 takes it and its window value is wrong from then on)
        module.update(stream(seed=7, steps=1, batch=BATCH)[0])
        out["update_while_synced"] = "no error"
    except RecMetricException as error:
        out["update_while_synced"] = str(error)
    fresh = build(world, rank, BATCH, mode)
    # while synced the states already span the ranks: reducing them again would count each rank world_size times
    # (torchrec 1.8's get_pre_compute_states does), and states loaded then would be thrown away by unsync()
    refused = {
        "states_while_synced": module.get_pre_compute_states,
        "load_while_synced": lambda: module.load_pre_compute_states(fresh.get_pre_compute_states()),
    }
    for name, call in refused.items():
        try:
            call()
            out[name] = "no error"
        except RecMetricException as error:
            out[name] = str(error)
    out["synced_local_after_refusals"] = _floats(module.local_compute())
    module.unsync()
    module.unsync()  # not synced any more: a no-op, as torchrec's RecMetric.unsync
    out["unsynced_local"] = _floats(module.local_compute())
    states = module.get_pre_compute_states()
    out["states"] = states
    out["mesh_states"] = module.get_pre_compute_states(init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    fresh.load_pre_compute_states(states)
    out["loaded_local"] = _floats(fresh.local_compute())
    return out


def _uneven_auc_states(rank: int, world: int) -> dict[str, Any]:
    metric = AUCMetric(world_size=world, my_rank=rank, batch_size=UNEVEN_BATCH, tasks=TASKS[:1], window_size=100)
    module = RecMetricModule(UNEVEN_BATCH, world, rec_tasks=TASKS[:1], rec_metrics=RecMetricList([metric]))
    for step in uneven_stream(rank):
        module.update(step)
    return module.get_pre_compute_states()["auc"]["t0"]


def uneven_stream(rank: int) -> list[dict[str, torch.Tensor]]:
    return stream(seed=300 + rank, steps=rank + 1, batch=UNEVEN_BATCH, tasks=1)


def run_all(rank: int, world: int) -> dict[str, Any]:
    """dist_cases.run_rank's results plus these cases under "sync": one spawn for the whole test module."""
    results = run_rank(rank, world)
    results["sync"] = {
        mode.name: _sync_cases(rank, world, mode)
        for mode in (RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION)
    }
    results["sync"]["uneven_auc"] = _uneven_auc_states(rank, world)
    results["interval"] = {
        name: ours(steps, low, high, clocks[rank], world, rank).compute_interval_steps
        for name, (steps, low, high, clocks) in INTERVAL_CASES.items()
    }
    return results
