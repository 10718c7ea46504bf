"""Rank side of tests/metrics/test_metrics_dist.py: every rank feeds its own stream into a RecMetricModule built for
the whole world and records what compute() (reduced over the gloo group) and local_compute() return after each step.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.metrics.reference import stream
from tritonrec.metrics import (
    MetricsConfig,
    RecComputeMode,
    RecMetricDef,
    RecMetricEnum,
    RecMetricModule,
    RecTaskInfo,
    generate_metric_module,
)

TASKS = [RecTaskInfo(name=f"t{t}", label_name=f"l{t}", prediction_name=f"p{t}", weight_name=f"w{t}") for t in range(2)]
BATCH, STEPS, WINDOW = 5, 7, 40  # per rank; the global window of 40 is 4 steps of both ranks' batches
METRICS = [RecMetricEnum.NE, RecMetricEnum.CTR, RecMetricEnum.CALIBRATION, RecMetricEnum.ACCURACY, RecMetricEnum.MSE,
           RecMetricEnum.MAE, RecMetricEnum.AUC]  # fmt: skip


def build(world: int, rank: int, batch: int, mode: RecComputeMode, all_ranks: bool = True) -> RecMetricModule:
    cfg = MetricsConfig(
        rec_tasks=TASKS,
        rec_metrics={m: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW) for m in METRICS},
        rec_compute_mode=mode,
        compute_on_all_ranks=all_ranks,
    )
    return generate_metric_module(RecMetricModule, cfg, batch, world, rank, {}, torch.device("cpu"))


def rank_stream(rank: int) -> list[dict[str, torch.Tensor]]:
    return stream(seed=100 + rank, steps=STEPS, batch=BATCH)


def _floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in values.items()}


def run_rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for mode in (RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION):
        module = build(world, rank, BATCH, mode)
        rank0_only = build(world, rank, BATCH, mode, all_ranks=False)
        computed, rank0_computed = [], []
        for step in rank_stream(rank):
            module.update(step)
            rank0_only.update(step)
            computed.append(_floats(module.compute()))
            rank0_computed.append(_floats(rank0_only.compute()))
        # a restart: lifetime states come back from the checkpoint, the reduction still spans the ranks
        restored = build(world, rank, BATCH, mode)
        restored.load_state_dict(module.state_dict())
        results[mode.name] = {
            "compute": computed,
            "rank0_only": rank0_computed,
            "local": _floats(module.local_compute()),
            "restored": _floats(restored.compute()),
        }
    return results
