"""The single-process job (``dist.nproc=1``, README command 1): a DLRM over a FusedEmbeddingBagCollection trained
step by step on one device, with ``torch.save`` checkpoints (``checkpoints/step_000400.pt``) that resume bit for bit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tritonrec.data.batcher import Batcher
from tritonrec.dist.train.builders import build_data, build_dense_optimizer, build_model, embedding_collection
from tritonrec.dist.train.checkpoint import load_checkpoint, save_checkpoint
from tritonrec.dist.train.config import TrainConfig, check_device
from tritonrec.dist.train.job_config import distributed_only_choices
from tritonrec.dist.train.job_report import JobReporter
from tritonrec.dist.train.job_state import (
    built_hyperparameters,
    data_fingerprint,
    later_checkpoints,
    optim_fingerprint,
    restore_hyperparameters,
    resume_note,
)
from tritonrec.dist.train.launch import StopRequest
from tritonrec.dist.train.loop import TrainHistory, evaluate, iterate_batches, train_step
from tritonrec.dist.train.report import final_metrics, plot_curves, write_metrics


def train_single(cfg: TrainConfig, out_dir: Path, stop: StopRequest) -> dict[str, Any]:
    device = check_device(cfg.device)
    torch.manual_seed(cfg.seed)
    sources = build_data(cfg.data)
    model = build_model(cfg.model, sources, cfg.optim, device)
    dense_optimizer = build_dense_optimizer(model, cfg.optim)
    batcher = Batcher(sources.element_spec)
    history = TrainHistory(cfg.train_auroc_window, cfg.batch_size)
    fingerprint = data_fingerprint(cfg.data)
    start = 0
    if cfg.resume:
        optimizers = {"sparse": embedding_collection(model).fused_optimizer, "dense": dense_optimizer}
        built = built_hyperparameters(optimizers)
        start = load_checkpoint(cfg.resume, model, dense_optimizer, batcher, history, cfg.steps, fingerprint,
                                cfg.batch_size, optim_fingerprint(cfg.optim))  # fmt: skip
        changed = restore_hyperparameters(built, optimizers)

    batches = iterate_batches(batcher, sources.train, cfg.batch_size, cfg.drop_remainder)
    checkpoint = None
    report = JobReporter(cfg.name, out_dir, start, cfg.steps, cfg.progress, cfg.logger.kind)
    ignored = distributed_only_choices(cfg.dist, cfg.sharding, cfg.pipeline, cfg.qcomm)
    if ignored:
        report.message(
            f"{cfg.name}: {', '.join(ignored)} ignored: one process (dist.nproc=1) has no embedding collectives to "
            "shard, pipeline or compress; the distributed job applies them (dist.nproc=N, or torchrun "
            "--nproc_per_node N)"
        )
    if cfg.resume:
        report.message(resume_note(cfg.name, cfg.resume, start, later_checkpoints(out_dir, start),
                                   history.ne_restored, changed))  # fmt: skip
    step, stopping = start, False
    try:
        for step in range(start + 1, cfg.steps + 1):
            began = time.perf_counter()
            host_batch = next(batches)
            batch = host_batch.to(device, non_blocking=True)
            loss, logits = train_step(model, dense_optimizer, batch)
            history.record_step(step, loss, logits, batch, host_batch.num_valid(), time.perf_counter() - began)
            report.step_done()
            # read once per step, as the distributed job agrees on it once: a signal arriving during this step's
            # evaluation or checkpoint is acted on at the next step, which then ends with its own final checkpoint
            stopping = stop.requested
            last = step == cfg.steps or stopping
            if step % cfg.log_every == 0 or last:
                report.train_point(step, history.log_point(step))
            if sources.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
                result = evaluate(model, sources.eval, cfg.eval_batch_size, device)
                history.record_eval(step, result)
                report.eval_point(step, history.recent_loss(), result)
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last:
                path = out_dir / "checkpoints" / f"step_{step:06d}.pt"
                checkpoint = save_checkpoint(path, step, model, dense_optimizer, batcher, history, fingerprint,
                                             cfg.batch_size, optim_fingerprint(cfg.optim))  # fmt: skip
            if stopping and step < cfg.steps:
                report.message(f"{stop.name} at step {step}: final checkpoint {checkpoint}; resume=<it> continues")
                break
    except Exception as error:
        report.failed(step, error)
        raise
    finally:
        report.close()
    stopped = stopping and step < cfg.steps  # a signal after the last step stops nothing: the run completed

    extra = {
        "resumed_from": cfg.resume,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "device": str(device),
        "data_skipped_lines": getattr(sources.train, "num_skipped", 0),
        "world_size": 1,
        "stopped_by": stop.name if stopped else None,
    }
    metrics = final_metrics(history, cfg.name, step, extra)
    write_metrics(out_dir / "metrics.json", metrics)
    if cfg.plot:
        plot_curves(out_dir / "curves.png", history, f"{cfg.name}: {cfg.model.arch} on {cfg.data.kind}")
    return metrics


__all__ = ["train_single"]
