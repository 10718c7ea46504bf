"""Experiment tracking for the ``logger/`` config group: the step, eval and throughput series of a job, written as it
runs (rank 0 only), next to metrics.json.

* ``none``: nothing beyond train.log and metrics.json;
* ``csv``: ``series.csv`` in the output folder, one row per logged point (``kind`` is ``train`` or ``eval``);
* ``tensorboard``: event files under ``tensorboard/`` through ``torch.utils.tensorboard`` (needs the ``tensorboard``
  package: ``pip install -e '.[tensorboard]'``), scalars ``train/loss``, ``train/auroc``, ``train/ne`` (the window
  NE), ``train/lifetime_ne``, ``train/samples_per_s``, ``eval/auroc``, ``eval/logloss``, ``eval/ne``.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

# ne: the window NE on train rows (auroc's window), the held-out NE on eval rows; new columns go last
_FIELDS = ("kind", "step", "loss", "auroc", "samples_per_s", "logloss", "ne", "lifetime_ne")


class MetricLogger:
    """Writes nothing (``logger=none``); the base of the others."""

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        """One point of series ``kind`` (``train`` or ``eval``) at ``step``."""

    def close(self) -> None:
        """Flush and release files."""


class CSVLogger(MetricLogger):
    """``series.csv``; a job resumed at step ``start`` into the same folder keeps the rows up to ``start`` and drops
    the later ones (the steps it trains again), so each step appears once."""

    def __init__(self, out_dir: Path, start: int = 0) -> None:
        self.path = out_dir / "series.csv"
        kept: list[dict[str, str]] = []
        if self.path.exists():
            with self.path.open(newline="") as file:
                kept = [
                    row for row in csv.DictReader(file) if row.get("step", "").isdigit() and int(row["step"]) <= start
                ]
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w", newline="") as file:  # rewritten whole, then renamed: never a half-truncated series
            writer = csv.DictWriter(file, fieldnames=_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        os.replace(partial, self.path)
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=_FIELDS)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        row = {"kind": kind, "step": step}
        row.update({k: ("" if v is None or not math.isfinite(v) else v) for k, v in values.items() if k in _FIELDS})
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def tensorboard_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a ValueError saying how to install what it needs (also called
    before a distributed job spawns its ranks, so a missing package fails there and then)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch.utils.tensorboard imports the tensorboard package
        raise ValueError(
            f"logger=tensorboard needs the tensorboard package ({error}): pip install -e '.[tensorboard]', or "
            "use logger=csv"
        ) from None
    return SummaryWriter


class TensorBoardLogger(MetricLogger):
    """Event files under ``tensorboard/``; a job resumed at step ``start`` hides the folder's events after ``start``
    (TensorBoard's ``purge_step``), so the steps it trains again are not drawn twice."""

    def __init__(self, out_dir: Path, start: int = 0) -> None:
        summary_writer = tensorboard_writer_class()
        purge = start + 1 if start else None
        self._writer: Any = summary_writer(log_dir=str(out_dir / "tensorboard"), purge_step=purge)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


def build_logger(kind: str, out_dir: Path, start: int = 0) -> MetricLogger:
    """The ``logger/`` choice ``kind`` writing into ``out_dir``, for a job starting after step ``start``."""
    if kind == "none":
        return MetricLogger()
    if kind == "csv":
        return CSVLogger(out_dir, start)
    if kind == "tensorboard":
        return TensorBoardLogger(out_dir, start)
    raise ValueError(f"logger.kind must be one of ['none', 'csv', 'tensorboard'], got {kind!r}")


__all__ = ["CSVLogger", "MetricLogger", "TensorBoardLogger", "build_logger", "tensorboard_writer_class"]
