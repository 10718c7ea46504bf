"""Experiment tracking for the ``logger/`` config group: the step, eval and throughput series of a job, written as it
runs (rank 0 only), next to metrics.json.

* ``none``: nothing beyond train.log and metrics.json;
* ``csv``: ``series.csv`` in the output folder, one row per logged point (``kind`` is ``train`` or ``eval``);
* ``tensorboard``: event files under ``tensorboard/`` through ``torch.utils.tensorboard`` (needs the ``tensorboard``
  package: ``pip install -e '.[tensorboard]'``), scalars ``train/loss``, ``train/auroc``, ``train/samples_per_s``,
  ``eval/auroc``, ``eval/logloss``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

_FIELDS = ("kind", "step", "loss", "auroc", "samples_per_s", "logloss")


class MetricLogger:
    """Writes nothing (``logger=none``); the base of the others."""

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        """One point of series ``kind`` (``train`` or ``eval``) at ``step``."""

    def close(self) -> None:
        """Flush and release files."""


class CSVLogger(MetricLogger):
    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "series.csv"
        new = not self.path.exists()  # a resumed job appends to its folder's series
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=_FIELDS)
        if new:
            self._writer.writeheader()

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        row = {"kind": kind, "step": step}
        row.update({k: ("" if v is None or not math.isfinite(v) else v) for k, v in values.items() if k in _FIELDS})
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger(MetricLogger):
    def __init__(self, out_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch.utils.tensorboard imports the tensorboard package
            raise ValueError(
                f"logger=tensorboard needs the tensorboard package ({error}): pip install -e '.[tensorboard]', or "
                "use logger=csv"
            ) from None
        self._writer: Any = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


def build_logger(kind: str, out_dir: Path) -> MetricLogger:
    if kind == "none":
        return MetricLogger()
    if kind == "csv":
        return CSVLogger(out_dir)
    if kind == "tensorboard":
        return TensorBoardLogger(out_dir)
    raise ValueError(f"logger.kind must be one of ['none', 'csv', 'tensorboard'], got {kind!r}")


__all__ = ["CSVLogger", "MetricLogger", "TensorBoardLogger", "build_logger"]
