"""Multirun sweeps: every job of ``python scripts/train.py -m ...`` lands in one sweep folder
(``multirun/<date>/<job number>_<experiment name>/``, configured in ``configs/train.yaml``), and after every job
:class:`SweepSummary` (a hydra callback) rewrites ``summary.csv`` and ``summary.md`` there: one row per job with its
overrides, its status and final metrics, so a sweep over experiments reads as one table. Written after each job, not
only when the sweep ends: hydra raises a failed job's error after the sweep's jobs ran and never reaches its end
hook, and a failed job's row (status ``failed: <error>``, no metrics) is what the table is for then. A job stopped
by SIGTERM gets its row (``stopped by SIGTERM``), then the sweep ends with exit status 143: its later jobs do not
run."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

COLUMNS = ("job", "status", "overrides", "name", "steps", "world_size", "first_loss", "final_loss", "train_auroc",
           "eval_auroc", "eval_logloss", "eval_ne", "samples_per_s")  # fmt: skip


def _csv_cell(value: Any) -> str:
    """A number as Python writes it (full precision, no thousands separator: the CSV is for programs)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _md_cell(value: str) -> str:
    """A CSV cell rounded for reading: 4 decimals, or whole numbers with separators from 100 up."""
    try:
        number = float(value)
    except ValueError:
        return value.replace("|", "\\|")
    if value.lstrip("-").isdigit():
        return value
    return f"{number:.4f}" if abs(number) < 100 else f"{number:,.0f}"


def _overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    lines = [line[2:].strip() for line in path.read_text().splitlines() if line.startswith("- ")]
    return " ".join(lines)


def _status(metrics: dict[str, Any], error: str | None) -> str:
    if error is not None:
        return f"failed: {error}"
    if not metrics:
        return "failed"
    return f"stopped by {metrics['stopped_by']}" if metrics.get("stopped_by") else "completed"


def _stopped_by(job_return: Any) -> str | None:
    """The signal that stopped a completed job (its metrics' ``stopped_by``), None for a job that ran to its end."""
    if job_return is None or job_return.status != JobStatus.COMPLETED:
        return None
    metrics = job_return.return_value  # the task function's return value: the job's metrics, or None
    return metrics.get("stopped_by") if isinstance(metrics, dict) else None


def summarize_sweep(sweep_dir: Path, errors: dict[str, str] | None = None) -> list[dict[str, str]]:
    """One row per job folder of ``sweep_dir`` (a job without metrics.json, e.g. one that failed, shows no metrics;
    ``errors`` maps a job folder's name to its error, shown in its status); writes summary.csv (numbers at full
    precision) and summary.md (rounded for reading); returns the CSV rows."""
    if errors is not None and not isinstance(errors, dict):
        raise TypeError(f"errors must be a dict of job folder name -> error text, got {type(errors).__name__}")
    errors = errors or {}
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                          key=lambda p: (len(p.name.split("_")[0]), p.name)):  # fmt: skip
        metrics_path = job_dir / "metrics.json"
        metrics: dict[str, Any] = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
        row = {"job": job_dir.name, "status": _status(metrics, errors.get(job_dir.name)),
               "overrides": _overrides(job_dir)}  # fmt: skip
        row.update({c: _csv_cell(metrics.get(c)) for c in COLUMNS[3:]})
        rows.append(row)
    with (sweep_dir / "summary.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(_md_cell(row[c]) for c in COLUMNS) + " |" for row in rows]
    (sweep_dir / "summary.md").write_text("\n".join(table) + "\n")
    return rows


class SweepSummary(Callback):
    """Hydra callback: the sweep's summary table, rewritten after each job and printed when the sweep ends (see
    module docstring)."""

    def __init__(self) -> None:
        self._errors: dict[str, str] = {}  # job folder name -> "<type>: <first line of the message>"

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(str(config.hydra.runtime.output_dir))
        failed = job_return is not None and job_return.status == JobStatus.FAILED
        if failed:
            error = job_return._return_value  # the exception (reading .return_value would raise it)
            first_line = str(error).splitlines()[0] if str(error) else ""
            self._errors[job_dir.name] = f"{type(error).__name__}: {first_line}"[:300]
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            summarize_sweep(sweep_dir, self._errors)
            if failed:
                print(f"sweep summary (so far, with the failed job): {sweep_dir / 'summary.md'}")
        stopped_by = _stopped_by(job_return)
        if stopped_by:  # scripts/train.py returns a stopped job's metrics here instead of exiting inside the job
            print(f"sweep stopped by {stopped_by}: later jobs not run; summary: {sweep_dir / 'summary.md'}")
            raise SystemExit(143)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        summarize_sweep(sweep_dir, self._errors)
        print(f"sweep summary: {sweep_dir / 'summary.md'}")
        print((sweep_dir / "summary.md").read_text(), end="")


__all__ = ["SweepSummary", "summarize_sweep"]
