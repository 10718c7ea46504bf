"""Results of a training job on disk: ``metrics.json`` and ``curves.png`` (loss and AUROC against step)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tritonrec.dist.train.loop import TrainHistory
from tritonrec.dist.train.ne import ne_values


def moving_average(values: list[float], width: int) -> list[float]:
    """Trailing mean over up to ``width`` values (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _json_safe(value: Any) -> Any:
    """Plain JSON values: NaN / inf floats become null (JSON has neither), containers are walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> Path:
    """``metrics`` as indented JSON (NaN written as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(metrics), indent=2, allow_nan=False) + "\n")
    return path


def plot_curves(path: str | Path, history: TrainHistory, title: str) -> Path | None:
    """Loss per step (raw and smoothed) and AUROC (running training window, held-out) in one PNG.

    Returns None, after saying so, when matplotlib (the ``plot`` extra) is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: scripts and CI write files only
        import matplotlib.pyplot as plt
    except ImportError:
        print("curves.png skipped: matplotlib is not installed (pip install -e '.[plot]')")
        return None
    history.flush()
    figure, (loss_axes, auroc_axes) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axes.plot(history.steps, history.losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss (step)")
    width = max(1, len(history.losses) // 20)
    smooth = moving_average(history.losses, width)
    loss_axes.plot(history.steps, smooth, color="tab:blue", label=f"loss ({width}-step mean)")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("BCE loss")
    loss_axes.legend()
    train = history.train_auroc_points
    points = [(s, a) for s, a in zip(train["step"], train["auroc"], strict=True) if a is not None]
    if points:
        auroc_axes.plot(*zip(*points, strict=True), color="tab:orange", label="train AUROC (running window)")
    held_out = [
        (s, a) for s, a in zip(history.eval_points["step"], history.eval_points["auroc"], strict=True) if a is not None
    ]
    if held_out:
        auroc_axes.plot(*zip(*held_out, strict=True), "o-", color="tab:green", label="held-out AUROC")
    auroc_axes.axhline(0.5, color="grey", linestyle=":", linewidth=0.8)
    auroc_axes.set_xlabel("step")
    auroc_axes.set_ylabel("AUROC")
    auroc_axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def final_metrics(history: TrainHistory, name: str, steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The summary written to metrics.json and returned by ``run``."""
    history.flush()
    losses = history.losses
    window = max(1, min(20, len(losses)))
    head, tail = losses[:window], losses[-window:]
    evals = history.eval_points
    return {
        "name": name,
        "steps": steps,
        "first_loss": sum(head) / len(head) if head else math.nan,  # mean of the first (up to) 20 steps
        "final_loss": sum(tail) / len(tail) if tail else math.nan,  # mean of the last (up to) 20 steps
        "loss_window": len(head),  # how many steps first_loss and final_loss each average
        "train_auroc": history.train_auroc.compute(),
        "eval_auroc": evals["auroc"][-1] if evals["auroc"] else None,
        "eval_logloss": evals["logloss"][-1] if evals["logloss"] else None,
        "eval_ne": evals["ne"][-1] if evals["ne"] else None,
        **{f"train_{key}": value for key, value in ne_values(history.train_ne).items()},  # window_ne, lifetime_ne
        "samples_per_s": history.samples_per_second(),
        "train_seconds": history.train_seconds,
        "train_samples": history.train_samples,
        **extra,
        "history": {"step": list(history.steps), "loss": list(losses)},
        "train_auroc_history": history.train_auroc_points,
        "train_ne_history": history.train_ne_points,
        "eval_history": evals,
    }
