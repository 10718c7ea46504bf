"""The distributed job, run by every rank: the DLRM sharded by DistributedModelParallel (``sharding/`` plan,
``qcomm/`` codecs), trained through the configured train pipeline on this rank's part of the data, with metrics over
all ranks, held-out evaluation, and DCP checkpoints (``checkpoints/step_00000400/``) that resume exactly.

Data: each rank reads its shard of the stream (the synthetic stream by chunks of ``data.chunk_size`` samples, rank
``r`` of ``W`` drawing chunks ``r, r + W, ...``; Criteo by row or byte ranges), so a batch is fixed by (seed, rank,
step). The synthetic chunk defaults to the per-rank batch, which makes step ``s``'s global batch the same samples
at every world size with the same global batch: the condition for resuming at another world size.
"""

from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.data.batcher import Batcher
from tritonrec.dist.checkpoint import CheckpointManager, load_checkpoint, read_extra_entry
from tritonrec.dist.train.builders import build_data, build_model
from tritonrec.dist.train.config import SyntheticDataConfig, TrainConfig, check_device
from tritonrec.dist.train.dist_builders import (
    StepRunner,
    build_sharded_dense_optimizer,
    build_sharded_model,
    qcomm_unused,
)
from tritonrec.dist.train.dist_metrics import BatchFeed, RankMetrics, evaluate_over_ranks
from tritonrec.dist.train.job_report import JobReporter
from tritonrec.dist.train.job_state import (
    JobState,
    built_hyperparameters,
    check_resume,
    check_resume_optim,
    data_fingerprint,
    later_checkpoints,
    optim_fingerprint,
    restore_hyperparameters,
    resume_note,
)
from tritonrec.dist.train.launch import StopRequest, rank_device
from tritonrec.dist.train.loop import TrainHistory, iterate_batches
from tritonrec.dist.train.report import final_metrics, plot_curves, write_metrics
from tritonrec.dist.train.step_agreement import JobStepAgreement


def _chunk_size(cfg: TrainConfig, saved: int | None) -> int | None:
    """Synthetic chunk size: the checkpoint's when resuming, else ``data.chunk_size``, else the per-rank batch."""
    if not isinstance(cfg.data, SyntheticDataConfig):
        return None
    if saved is not None:
        return saved
    return cfg.data.chunk_size or cfg.batch_size


def train_distributed(
    cfg: TrainConfig, out_dir: Path, stop: StopRequest, side: dist.ProcessGroup
) -> dict[str, Any] | None:
    """Train on this rank (every rank calls it); rank 0 returns the metrics, the others None. ``side``: a gloo group
    of the same ranks for the metrics and the stop flag (CPU collectives apart from the model's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(check_device(cfg.device))
    job = JobState()
    resume_path = Path(cfg.resume) if cfg.resume else None
    fingerprint = data_fingerprint(cfg.data)
    if resume_path is not None:
        job.load_state_dict(_read_job_state(resume_path))
        _check_resume_state(cfg, resume_path, job, world)
    chunk = _chunk_size(cfg, job.state.get("chunk_size") if job.state else None)
    torch.manual_seed(cfg.seed)
    data_cfg = dataclasses.replace(cfg.data, chunk_size=chunk) if chunk is not None else cfg.data
    sources = build_data(data_cfg, rank=rank, world_size=world)
    model = build_model(cfg.model, sources, cfg.optim, "cpu")  # every rank starts from the same unsharded weights
    dmp = build_sharded_model(model, cfg, device)
    dense_optimizer = build_sharded_dense_optimizer(dmp, cfg.optim)
    batcher = Batcher(sources.element_spec)
    history = TrainHistory(cfg.train_auroc_window, cfg.batch_size * world)  # a step records every rank's rows
    start = 0
    if resume_path is not None:
        optimizers = {"sparse": dmp.fused_optimizer, "dense": dense_optimizer}
        built = built_hyperparameters(optimizers)
        load_checkpoint(resume_path, dmp, {"dense": dense_optimizer}, {"job": job})
        changed = restore_hyperparameters(built, optimizers)
        start = job.state["step"]
        endless = isinstance(cfg.data, SyntheticDataConfig) and cfg.data.num_samples is None
        batcher.set_state(job.data_state_for(rank, world, cfg.batch_size, endless))
        history.load_state_dict(job.state["history"])

    feed, runner = _start_pipeline(cfg, batcher, sources.train, dmp, dense_optimizer, device, start)
    metrics_sync = RankMetrics(history, side)
    agreement = JobStepAgreement(stop, side, device)
    manager = CheckpointManager(out_dir / "checkpoints")
    report = JobReporter(cfg.name, out_dir, start, cfg.steps, cfg.progress, cfg.logger.kind, enabled=rank == 0)
    report.message(
        f"{cfg.name}: {world} ranks ({dist.get_backend()}), sharding={cfg.sharding.kind}, pipeline="
        f"{cfg.pipeline.kind}, qcomm={cfg.qcomm.forward}/{cfg.qcomm.backward}, batch {cfg.batch_size} per rank"
    )
    if cfg.pipeline.kind == "semi_sync" and cfg.checkpoint_every == 1:
        report.message(f"{cfg.name}: pipeline=semi_sync with checkpoint_every=1 restarts the pipeline every step: "
                       "no step runs semi-synchronously (each checkpoint restarts it, for exact resume)")  # fmt: skip
    if qcomm_unused(cfg, dmp.plan):
        report.message(
            f"{cfg.name}: qcomm={cfg.qcomm.forward}/{cfg.qcomm.backward} ignored: every table is data-parallel "
            f"(sharding={cfg.sharding.kind}), so no embedding collective runs; DDP all-reduces their gradients in fp32"
        )
    if resume_path is not None:
        report.message(resume_note(cfg.name, str(resume_path), start, later_checkpoints(out_dir, start),
                                   history.ne_restored, changed))  # fmt: skip
    checkpoint, step, stopped = None, start, False
    try:
        for step in range(start + 1, cfg.steps + 1):
            began = time.perf_counter()
            output = runner.step(feed)
            position, mask, num_valid = feed.pop()
            metrics_sync.record(step, output, mask, num_valid, time.perf_counter() - began)
            report.step_done()
            agreement.note(step, output)
            stopped = agreement.agree()  # NonFiniteLossError on every rank when one diverged
            last = step == cfg.steps or stopped
            if step % cfg.log_every == 0 or last:
                metrics_sync.sync()
                report.train_point(step, history.log_point(step))
            checkpointing = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last
            if checkpointing:  # first, so the eval below sees the model the checkpoint saves (semi-sync's stash)
                runner.drain()
            if sources.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
                runner.pause()
                metrics_sync.sync()  # the eval line's training loss covers the steps since the last log line too
                result = evaluate_over_ranks(dmp, sources.eval, cfg.eval_batch_size, device, side)
                history.record_eval(step, result)
                report.eval_point(step, history.recent_loss(), result)
            if checkpointing:
                metrics_sync.sync()
                positions: list[Any] = [None] * world
                dist.all_gather_object(positions, position, group=side)
                job.update(step, world, cfg.batch_size, positions, history.state_dict(), fingerprint, chunk,
                           optim_fingerprint(cfg.optim))  # fmt: skip
                checkpoint = manager.save(step, dmp, {"dense": dense_optimizer}, {"job": job})
                if runner.restarts_at_checkpoint and not last:  # as a job resuming from this checkpoint starts
                    runner.close()
                    # a new Batcher: the closed runner's prefetch thread may still be inside a slow read of the old
                    # one (its stop waits 5 s), and would write its position over the one restored here
                    batcher = Batcher(sources.element_spec)
                    batcher.set_state(position)
                    feed, runner = _start_pipeline(cfg, batcher, sources.train, dmp, dense_optimizer, device, step)
            if stopped and step < cfg.steps:
                report.message(f"{stop.name} at step {step}: final checkpoint {checkpoint}")
                break
    except Exception as error:
        report.failed(step, error)
        raise
    finally:
        runner.close()
        report.close()
    skipped: list[Any] = [None] * world  # each rank skips the malformed lines of its own part of the files
    dist.all_gather_object(skipped, getattr(sources.train, "num_skipped", 0), group=side)
    if rank != 0:
        return None
    extra = {
        "resumed_from": cfg.resume,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "device": str(device),
        "data_skipped_lines": sum(skipped),  # over every rank's part of the data
        "world_size": world,
        "sharding": cfg.sharding.kind,
        "pipeline": cfg.pipeline.kind,
        "pipelined_modules": runner.pipelined_modules,
        "qcomm": f"{cfg.qcomm.forward}/{cfg.qcomm.backward}",
        "stopped_by": stop.name if stopped and step < cfg.steps else None,  # after the last step: completed
    }
    metrics = final_metrics(history, cfg.name, step, extra)
    write_metrics(out_dir / "metrics.json", metrics)
    if cfg.plot:
        plot_curves(out_dir / "curves.png", history, f"{cfg.name}: {cfg.model.arch} on {cfg.data.kind}, {world} ranks")
    return metrics


def _start_pipeline(
    cfg: TrainConfig,
    batcher: Batcher,
    source: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    trained_steps: int,
) -> tuple[BatchFeed, StepRunner]:
    """The training batches from ``batcher``'s position and a new step runner for the steps after ``trained_steps``:
    at the job's start (or resume) and, for a pipeline that :attr:`~StepRunner.restarts_at_checkpoint`, after each
    checkpoint, so that an uninterrupted job and one resumed from any of its checkpoints train the same way."""
    feed = BatchFeed(iterate_batches(batcher, source, cfg.batch_size, cfg.drop_remainder), batcher)
    return feed, StepRunner(cfg.pipeline, model, optimizer, device, trained_steps)


def _check_resume_state(cfg: TrainConfig, path: Path, job: JobState, world: int) -> None:
    """Every resume check that needs only the checkpoint's job state: steps left, same data, same optimizer rules,
    and a batch size / world size this rank's data position can be derived for (rank 0's stands for all)."""
    check_resume(str(path), job.state["step"], cfg.steps, job.state["data_fingerprint"], data_fingerprint(cfg.data))
    check_resume_optim(str(path), job.state.get("optim"), optim_fingerprint(cfg.optim))
    endless = isinstance(cfg.data, SyntheticDataConfig) and cfg.data.num_samples is None
    job.data_state_for(0, world, cfg.batch_size, endless)


def precheck_resume(cfg: TrainConfig, world: int) -> None:
    """The resume checks of :func:`train_distributed` for a job of ``world`` ranks, in the launching process
    (before ranks are spawned, so an error keeps its type and no rank starts)."""
    path = Path(cfg.resume)  # type: ignore[arg-type]
    job = JobState()
    job.load_state_dict(_read_job_state(path))
    _check_resume_state(cfg, path, job, world)


def _read_job_state(path: Path) -> dict[str, Any]:
    """The job state of the checkpoint at ``path``, read alone (before the model is built: the data depends on it)."""
    if not (path / "manifest.json").is_file():
        hint = "; it is a one-process checkpoint: resume it with dist.nproc=1" if path.is_file() else ""
        raise ValueError(
            f"resume: no distributed checkpoint (a checkpoints/step_<n>/ folder with a manifest.json) at "
            f"{str(path)!r}{hint}"
        )
    return torch.load(io.BytesIO(read_extra_entry(path, "job")), weights_only=False)  # type: ignore[no-any-return]


__all__ = ["precheck_resume", "train_distributed"]
