"""Train a DLRM end to end on one machine (hydra-configured):

    python scripts/train.py                                   # the default experiment: DLRM on synthetic data
    python scripts/train.py experiment=synthetic_dcn          # another experiment (configs/experiment/)
    python scripts/train.py steps=2000 data.zipf_alpha=1.3    # any field of configs/ from the command line
    python scripts/train.py resume=outputs/.../checkpoints/step_000200.pt

Results land in the hydra run dir: ``metrics.json``, ``curves.png`` (loss and AUROC against step) and
``checkpoints/step_*.pt`` (model, fused and dense optimizer state, data position; ``resume=<file>`` continues from
one bit for bit). ``run(cfg)`` is the whole job without hydra, for tests and notebooks.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from tritonrec.data.batcher import Batcher
from tritonrec.dist.train.builders import build_data, build_dense_optimizer, build_model
from tritonrec.dist.train.checkpoint import load_checkpoint, save_checkpoint
from tritonrec.dist.train.config import TrainConfig, as_train_config, register_configs
from tritonrec.dist.train.loop import TrainHistory, evaluate, iterate_batches, train_step
from tritonrec.dist.train.report import final_metrics, plot_curves, write_metrics


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), got device={name!r}") from None


def run(cfg: DictConfig | TrainConfig) -> dict[str, Any]:
    """Build the data, model and optimizers from ``cfg``, train ``cfg.steps`` steps (resuming from ``cfg.resume``
    when set), write metrics.json, curves.png and checkpoints into ``cfg.output_dir``; return the metrics."""
    cfg = as_train_config(cfg)
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)  # the thread count is process-wide: give the caller's back


def _train(cfg: TrainConfig) -> dict[str, Any]:
    device = _device(cfg.device)
    out_dir = Path(cfg.output_dir) if cfg.output_dir else Path.cwd()
    torch.manual_seed(cfg.seed)
    sources = build_data(cfg.data)
    model = build_model(cfg.model, sources, cfg.optim, device)
    dense_optimizer = build_dense_optimizer(model, cfg.optim)
    batcher = Batcher(sources.element_spec)
    history = TrainHistory(cfg.train_auroc_window)
    start = load_checkpoint(cfg.resume, model, dense_optimizer, batcher, history) if cfg.resume else 0

    batches = iterate_batches(batcher, sources.train, cfg.batch_size, cfg.drop_remainder)
    checkpoint = None
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=cfg.name, disable=not cfg.progress)
    for step in bar:
        began = time.perf_counter()
        host_batch = next(batches)
        batch = host_batch.to(device, non_blocking=True)
        loss, logits = train_step(model, dense_optimizer, batch)
        history.record_step(step, loss, logits, batch, host_batch.num_valid(), time.perf_counter() - began)
        last = step == cfg.steps
        if step % cfg.log_every == 0 or last:
            point = history.log_point(step)
            bar.set_postfix(
                loss=f"{point['loss']:.4f}",
                auroc=f"{point['auroc']:.4f}",
                samples_per_s=f"{point['samples_per_s']:,.0f}",
            )
        if sources.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
            result = evaluate(model, sources.eval, cfg.eval_batch_size, device)
            history.record_eval(step, result)
            bar.write(
                f"step {step}: loss {history.recent_loss():.4f}, held-out AUROC {result['auroc']:.4f}, "
                f"held-out logloss {result['logloss']:.4f}"
            )
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last:
            path = out_dir / "checkpoints" / f"step_{step:06d}.pt"
            checkpoint = save_checkpoint(path, step, model, dense_optimizer, batcher, history)
    bar.close()

    extra = {
        "resumed_from": cfg.resume,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "device": str(device),
        "data_skipped_lines": getattr(sources.train, "num_skipped", 0),
    }
    metrics = final_metrics(history, cfg.name, cfg.steps, extra)
    write_metrics(out_dir / "metrics.json", metrics)
    if cfg.plot:
        plot_curves(out_dir / "curves.png", history, f"{cfg.name}: {cfg.model.arch} on {cfg.data.kind}")
    return metrics


register_configs()


def _remove_if_unused(run_dir: Path) -> None:
    """Remove the hydra run folder of a job that failed before writing any result (it holds only hydra's own
    .hydra/ and log), so a bad config does not leave an empty-looking outputs/<name>/<date>/ behind."""
    hydra_cfg = HydraConfig.get()
    bookkeeping = {hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log"}
    if run_dir.is_dir() and {entry.name for entry in run_dir.iterdir()} <= bookkeeping:
        shutil.rmtree(run_dir)


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.output_dir is None:
        cfg.output_dir = str(run_dir)
    try:
        metrics = run(cfg)
    except (ValueError, TypeError):  # bad config values: nothing was trained
        _remove_if_unused(run_dir)
        raise
    held_out = metrics["eval_auroc"]
    print(
        f"{metrics['name']}: loss {metrics['first_loss']:.4f} (first 20 steps) -> {metrics['final_loss']:.4f} "
        f"(last 20), held-out AUROC {held_out if held_out is None else round(held_out, 4)}, "
        f"{metrics['samples_per_s']:,.0f} samples/s; results in {cfg.output_dir}"
    )


if __name__ == "__main__":
    main()
