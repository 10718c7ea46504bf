"""What a job shows and writes while it runs (rank 0 only): the tqdm bar, ``train.log`` (one line per logged step and
per held-out evaluation, appended, so a resumed job continues its folder's log) and the ``logger/`` series."""

from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from tritonrec.dist.train.loggers import MetricLogger, build_logger

_LOG_FORMAT = "[%(asctime)s] %(message)s"


class JobReporter:
    """Progress of one job. ``enabled=False`` (ranks other than 0) makes every method a no-op."""

    def __init__(self, name: str, out_dir: Path, start: int, steps: int, progress: bool, logger_kind: str,
                 enabled: bool = True) -> None:  # fmt: skip
        self.enabled = enabled
        self.bar = tqdm(total=steps, initial=start, desc=name, disable=not (progress and enabled))
        self._log = logging.getLogger(f"tritonrec.train.{id(self)}")
        self._log.propagate = False  # the job's lines go to train.log only, not to hydra's log or the console twice
        self._log.setLevel(logging.INFO)
        self._handler: logging.Handler | None = None
        self.series: MetricLogger = MetricLogger()
        if enabled:
            self._handler = logging.FileHandler(out_dir / "train.log")
            self._handler.setFormatter(logging.Formatter(_LOG_FORMAT))
            self._log.addHandler(self._handler)
            self.series = build_logger(logger_kind, out_dir, start)

    def step_done(self) -> None:
        self.bar.update(1)

    def train_point(self, step: int, point: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.bar.set_postfix(loss=f"{point['loss']:.4f}", auroc=f"{point['auroc']:.4f}", ne=f"{point['ne']:.4f}",
                             samples_per_s=f"{point['samples_per_s']:,.0f}")  # fmt: skip
        self._log.info(
            "step %d: loss %.4f, train AUROC %.4f, train NE %.4f (lifetime %.4f), %.0f samples/s", step, point["loss"],
            point["auroc"], point["ne"], point["lifetime_ne"], point["samples_per_s"],
        )  # fmt: skip
        self.series.log("train", step, point)

    def eval_point(self, step: int, recent_loss: float, result: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = (f"step {step}: loss {recent_loss:.4f}, held-out AUROC {result['auroc']:.4f}, "
                f"held-out logloss {result['logloss']:.4f}, held-out NE {result['ne']:.4f}")  # fmt: skip
        self.bar.write(line)
        self._log.info(line)
        self.series.log("eval", step, {"auroc": result["auroc"], "logloss": result["logloss"], "ne": result["ne"]})

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)
            self._log.info(text)

    def failed(self, step: int, error: BaseException) -> None:
        """Record in train.log why the job stopped at ``step`` (the log outlives the traceback on the console)."""
        if self.enabled:
            self._log.error("stopped at step %d by %s: %s", step, type(error).__name__, error)

    def close(self) -> None:
        self.bar.close()
        self.series.close()
        if self._handler is not None:
            self._log.removeHandler(self._handler)
            self._handler.close()


__all__ = ["JobReporter"]
