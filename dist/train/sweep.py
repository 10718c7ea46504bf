"""Multirun sweeps: every job of ``python scripts/train.py -m ...`` lands in one sweep folder
(``multirun/<date>/<job number>_<experiment name>/``, configured in ``configs/train.yaml``), and when the sweep ends
:class:`SweepSummary` (a hydra callback) writes ``summary.csv`` and ``summary.md`` there: one row per job with its
overrides and final metrics, so a sweep over experiments reads as one table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("job", "overrides", "name", "steps", "world_size", "first_loss", "final_loss", "train_auroc", "eval_auroc",
           "eval_logloss", "samples_per_s")  # fmt: skip


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


def summarize_sweep(sweep_dir: Path) -> list[dict[str, str]]:
    """One row per job folder of ``sweep_dir`` (a job without metrics.json, e.g. one that failed, shows no metrics);
    writes summary.csv (numbers at full precision) and summary.md (rounded for reading); returns the CSV rows."""
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                          key=lambda p: (len(p.name.split("_")[0]), p.name)):  # fmt: skip
        metrics_path = job_dir / "metrics.json"
        metrics: dict[str, Any] = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
        row = {"job": job_dir.name, "overrides": _overrides(job_dir)}
        row.update({c: _csv_cell(metrics.get(c)) for c in COLUMNS[2:]})
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
    """Hydra callback: the sweep's summary table when a multirun ends (printed and written, see module docstring)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        summarize_sweep(sweep_dir)
        print(f"sweep summary: {sweep_dir / 'summary.md'}")
        print((sweep_dir / "summary.md").read_text(), end="")


__all__ = ["SweepSummary", "summarize_sweep"]
