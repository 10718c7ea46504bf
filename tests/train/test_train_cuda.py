"""The training job on a CUDA device (skipped without one). One GPU holds one rank, so the distributed job runs as a
one-rank NCCL group (``run_rank`` with torchrun's variables for a world of 1): the DMP-sharded DLRM with compiled
Triton lookups, each pipeline, a codec on the wire, the lagged NaN check (on an accelerator the step's loss is read
one step later) and the one-process job. The pipelines train the same batches bit for bit, so every pipeline's
final metrics must equal ``base``'s.

The helpers take the device and process-group backend, so ``job_metrics("cpu", "gloo", ...)`` checks the harness
without a GPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from dist_utils import one_rank_environment

from tests.train.dist_job_cases import tiny_config

pytestmark = pytest.mark.gpu

# what differs between equal runs (timing) or names the run
_RUN_KEYS = ("pipeline", "pipelined_modules", "checkpoint")


def job_metrics(device: str, backend: str, out: Path, **changes: Any) -> dict[str, Any]:
    """One one-rank distributed job (``run_rank``) on ``device``: rank 0's metrics."""
    from tritonrec.dist.train.run import run_rank

    cfg = tiny_config(out, device=device, **changes)
    cfg.model.backend = "auto"  # Triton on CUDA
    cfg.dist.backend = backend
    with one_rank_environment():
        metrics = run_rank(cfg)
    assert metrics is not None
    return metrics


def comparable(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k not in _RUN_KEYS and not k.endswith(("seconds", "per_s"))}


def check_pipelines_agree(device: str, backend: str, root: Path) -> None:
    from tritonrec.dist.train.job_config import PipelineConfig, QCommConfig, ShardingConfig

    results = {}
    for pipeline in ("base", "sparse_dist", "staged", "semi_sync"):  # semi_sync: synchronous before step 900
        results[pipeline] = job_metrics(device, backend, root / pipeline, pipeline=PipelineConfig(kind=pipeline))
        assert results[pipeline]["device"].startswith(device)
    assert all(results[p]["pipelined_modules"] for p in ("sparse_dist", "staged", "semi_sync"))
    for pipeline in ("sparse_dist", "staged", "semi_sync"):
        assert comparable(results[pipeline]) == comparable(results["base"]), pipeline
    # row-wise with fp16 on the wire, through the staged pipeline: trains, finite
    coded = job_metrics(device, backend, root / "rw_fp16", pipeline=PipelineConfig(kind="staged"),
                        sharding=ShardingConfig(kind="rw"), qcomm=QCommConfig("fp16", "fp16"))  # fmt: skip
    assert coded["qcomm"] == "fp16/fp16"
    assert (root / "rw_fp16" / "metrics.json").is_file()
    # semi-synchronous from step 3 (lookups one update behind), stashed dense gradients: trains, finite
    semi = PipelineConfig(kind="semi_sync", start_batch=2, stash_gradients=True)
    stale = job_metrics(device, backend, root / "semi_sync_stale", pipeline=semi)
    assert all(math.isfinite(loss) for loss in stale["history"]["loss"])


def check_nan_step_is_named(device: str, backend: str, root: Path) -> tuple[str, int]:
    """The loss turns NaN at step 3 (log steps 5, 10): the error names step 3; returns it and the steps run."""
    from tests.train.dist_job_cases import _nan_loss_on_rank_1_at_step

    undo, steps_run = _nan_loss_on_rank_1_at_step(1, 3)  # "rank 1" is the patch's name for the rank that diverges
    try:
        with pytest.raises(Exception) as caught:
            job_metrics(device, backend, root / "nan", steps=10, log_every=5, eval_every=0, checkpoint_every=0)
    finally:
        undo()
    message = f"{type(caught.value).__name__}: {caught.value}"
    assert message.startswith("NonFiniteLossError: step 3: the training loss is nan on rank 0"), message
    return message, steps_run[0]


def test_distributed_job_pipelines_agree_on_cuda(tmp_path: Path) -> None:
    check_pipelines_agree("cuda", "nccl", tmp_path)


def test_nan_on_cuda_is_reported_one_step_later_naming_its_step(tmp_path: Path) -> None:
    _, steps_run = check_nan_step_is_named("cuda", "nccl", tmp_path)
    assert steps_run == 4  # the lagged read: step 3's check is read at step 4's agreement


def test_single_process_job_on_cuda(tmp_path: Path) -> None:
    from tritonrec.dist.train import run

    cfg = tiny_config(tmp_path / "single", device="cuda", steps=6)
    cfg.model.backend = "auto"
    metrics = run(cfg)
    assert metrics["device"].startswith("cuda") and (tmp_path / "single" / "metrics.json").is_file()
