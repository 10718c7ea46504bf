"""Rank-side cases of the distributed training job (2 gloo ranks, one spawn for all): a tiny DLRM job under several
sharding x pipeline x codec combinations, an exact resume at the same world size (through the checkpoint's pipeline
and through the staged one), SIGTERM on one rank, a diverging run, a loss that turns NaN on one rank only, and a
malformed data line on one rank."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any


def tiny_config(output_dir: Path, **changes: Any) -> Any:
    from tritonrec.dist.train.config import DLRMConfig, SyntheticDataConfig, TrainConfig
    from tritonrec.dist.train.job_config import LoggerConfig, PipelineConfig, QCommConfig, ShardingConfig

    cfg = TrainConfig(
        model=DLRMConfig(embedding_dim=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], backend="torch"),
        data=SyntheticDataConfig(num_sparse_features=3, num_embeddings=40, num_eval_samples=64),
        batch_size=8, eval_batch_size=16, steps=6, log_every=2, eval_every=3, checkpoint_every=3, progress=False,
        plot=False, output_dir=str(output_dir), name="tiny_dist", num_threads=1,
    )  # fmt: skip
    cfg.sharding, cfg.pipeline = ShardingConfig(kind="tw"), PipelineConfig(kind="sparse_dist")
    cfg.qcomm, cfg.logger = QCommConfig(), LoggerConfig(kind="csv")
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


VARIANTS = {  # name -> (sharding, pipeline, qcomm)
    "staged-cw-fp16": ("cw", "staged", "fp16"),
    "base-dp-int8": ("dp", "base", "int8"),
    "sparse_dist-twrw-bf16": ("twrw", "sparse_dist", "bf16"),
    "sparse_dist-auto-fp32": ("auto", "sparse_dist", "fp32"),
}


def _sigterm_when_training(log: Path) -> None:
    """Rank 1 sends itself SIGTERM once rank 0 logged a step (every rank's handler is installed by then)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.is_file() and "step 2:" in log.read_text():
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)


def _nan_loss_on_rank_1_at_step(rank: int, step: int) -> Any:
    """Patch the job's step runner so that rank 1's ``step``-th step returns a NaN loss (the other rank's stay
    finite: no rank could tell from its own loss); returns the undo and the count of steps run so far."""
    import torch

    from tritonrec.dist.train.dist_builders import StepRunner

    original, calls = StepRunner.step, [0]

    def step_with_nan(self: Any, batches: Any) -> Any:
        output = original(self, batches)
        calls[0] += 1
        if rank == 1 and calls[0] == step:
            return (torch.full_like(output[0], float("nan")), *output[1:])
        return output

    StepRunner.step = step_with_nan  # type: ignore[method-assign]
    return (lambda: setattr(StepRunner, "step", original)), calls


def run_suite(rank: int, world: int, root: str) -> dict[str, Any]:
    from tritonrec.dist.train.config import OptimConfig
    from tritonrec.dist.train.job_config import PipelineConfig, QCommConfig, ShardingConfig
    from tritonrec.dist.train.run import run_rank

    base = Path(root)
    out: dict[str, Any] = {"smoke": run_rank(tiny_config(base / "smoke"))}
    checkpoint = base / "smoke" / "checkpoints" / "step_00000003"
    out["resumed"] = run_rank(tiny_config(base / "resumed", resume=str(checkpoint)))
    # the staged pipeline reads a batch ahead of its stages: resuming through it must train the same batches
    staged = PipelineConfig(kind="staged")
    out["resumed_staged"] = run_rank(tiny_config(base / "resumed_staged", resume=str(checkpoint), pipeline=staged))
    # a resume with another table learning rate trains with it (the loaded optimizer state restored the old one)
    faster = OptimConfig(sparse_lr=1.5)
    out["resumed_sparse_lr"] = run_rank(tiny_config(base / "resumed_sparse_lr", resume=str(checkpoint), optim=faster))
    for name, (sharding, pipeline, qcomm) in VARIANTS.items():
        cfg = tiny_config(base / name, steps=3, eval_every=0, checkpoint_every=0)
        cfg.sharding, cfg.pipeline = ShardingConfig(kind=sharding), PipelineConfig(kind=pipeline)
        cfg.qcomm = QCommConfig(forward=qcomm, backward=qcomm)
        out[name] = run_rank(cfg)
    log = base / "sigterm" / "train.log"
    if rank == 1:
        threading.Thread(target=_sigterm_when_training, args=(log,), daemon=True).start()
    out["sigterm"] = run_rank(tiny_config(base / "sigterm", steps=100_000, log_every=1, eval_every=0,
                                          checkpoint_every=0))  # fmt: skip
    # a diverging run: every rank raises the same error at the same point (none left waiting in a collective)
    diverging = OptimConfig(sparse="EXACT_SGD", dense="sgd", sparse_lr=1e4, dense_lr=1e4)
    try:
        run_rank(tiny_config(base / "diverged", optim=diverging, steps=30, log_every=5, eval_every=0,
                             checkpoint_every=5))  # fmt: skip
        out["diverged"] = None
    except Exception as error:
        out["diverged"] = f"{type(error).__name__}: {error}"
    # one rank's loss turns NaN at step 3, between log steps: every rank stops there, not at the next log step
    undo, steps_run = _nan_loss_on_rank_1_at_step(rank, 3)
    try:
        run_rank(tiny_config(base / "nan_one_rank", steps=10, log_every=5, eval_every=0, checkpoint_every=2))
        out["nan_one_rank"] = None
    except Exception as error:
        out["nan_one_rank"] = f"{type(error).__name__}: {error}"
    finally:
        undo()
    out["nan_one_rank_steps"] = steps_run[0]
    out["malformed_on_rank_1"] = _malformed_line_on_rank_1(base)
    out["side_group_timeout_s"] = _side_group_timeout_s(base / "side_timeout")
    return out


def write_malformed_day(path: Path) -> None:
    """A 60-line Criteo day whose line 41 is malformed: in rank 1's half of the file (rank 0 reads lines 1-30)."""
    good = "\t".join(["1", *["1"] * 13, *["0a"] * 26])
    lines = [good] * 60
    lines[40] = "not\ta\tcriteo\tline"
    path.write_text("\n".join(lines) + "\n")


def _malformed_line_on_rank_1(base: Path) -> str | None:
    """The error each rank raises when rank 1 reads the malformed line of :func:`write_malformed_day`'s file."""
    from tritonrec.dist.train.config import CriteoTSVDataConfig
    from tritonrec.dist.train.run import run_rank

    data = CriteoTSVDataConfig(paths=[str(base / "malformed.tsv")], num_embeddings=40)
    try:
        run_rank(tiny_config(base / "malformed", steps=4, eval_every=0, checkpoint_every=0, data=data))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _side_group_timeout_s(output_dir: Path) -> float | None:
    """The timeout of the gloo side group the job builds (metrics, step agreement), read in place of training."""
    from tritonrec.dist.side_groups import group_timeout
    from tritonrec.dist.train import distributed
    from tritonrec.dist.train.run import run_rank

    def report_timeout(cfg: Any, out_dir: Path, stop: Any, side: Any) -> float | None:
        timeout = group_timeout(side)
        return None if timeout is None else timeout.total_seconds()

    original = distributed.train_distributed
    distributed.train_distributed = report_timeout  # type: ignore[assignment]
    try:
        return run_rank(tiny_config(output_dir))
    finally:
        distributed.train_distributed = original
