"""The pieces of one training job, kept apart so the staged pipeline (later) can take them over one by one:
batch production (:func:`iterate_batches`), the train step (:func:`train_step`), held-out evaluation
(:func:`evaluate`) and the record of what happened (:class:`TrainHistory`). The device copy is ``Batch.to``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.data.elements import ElementSource
from tritonrec.dist.train.metrics import AUROCMetric
from tritonrec.dist.train.ne import held_out_ne, ne_module, ne_values, update_ne
from tritonrec.modules.dlrm import DLRMTrain, masked_bce_with_logits


def iterate_batches(
    batcher: Batcher, source: ElementSource, batch_size: int, drop_remainder: bool = False
) -> Iterator[Batch]:
    """Endless batches: pass after pass over ``source``, continuing from the Batcher's state."""
    while True:
        started_fresh = batcher.get_state()["position"] == 0
        produced = False
        for batch in batcher.process(source, batch_size, drop_remainder):
            produced = True
            yield batch
        if started_fresh and not produced:
            what = (
                f"fewer than batch_size={batch_size} samples, and drop_remainder=True drops a short batch"
                if drop_remainder
                else "no sample"
            )
            where = "the training data"
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
                where = f"rank {rank}'s part of the training data (each of the {world} ranks reads its own part)"
            raise ValueError(f"{where} holds {what}: it yields no batch")


def train_step(
    model: DLRMTrain, dense_optimizer: torch.optim.Optimizer, batch: Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on ``batch`` (already on the model's device) -> detached ``(loss, logits [B])``.

    The embedding tables update inside ``backward`` (fused optimizer); ``dense_optimizer`` updates the rest.
    """
    model.train()
    dense_optimizer.zero_grad(set_to_none=True)
    loss, (loss_value, logits, _) = model(batch)
    loss.backward()
    dense_optimizer.step()
    return loss_value, logits


@torch.no_grad()
def evaluate(
    model: DLRMTrain, source: ElementSource, batch_size: int, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """One pass over ``source``: ``{"auroc", "logloss", "ne", "samples"}`` over its (unpadded) samples."""
    model.eval()
    metric = AUROCMetric()
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    loss_sum, count = 0.0, 0
    for batch in Batcher(source.element_spec).process(source, batch_size):
        batch = batch.to(device)
        logits = model.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        valid = int(batch.valid_mask.sum())
        loss_sum += float(masked_bce_with_logits(logits, batch.labels, batch.valid_mask)) * valid
        count += valid
        metric.update(logits.float(), batch.labels, batch.valid_mask)
        rows.append((logits.float().cpu(), batch.labels.cpu(), batch.valid_mask.cpu()))
    model.train()
    ne = held_out_ne(*(torch.cat(part) for part in zip(*rows, strict=True))) if rows else math.nan
    logloss = loss_sum / count if count else math.nan
    return {"auroc": metric.compute(), "logloss": logloss, "ne": ne, "samples": float(count)}


class NonFiniteLossError(FloatingPointError):
    """A training step's loss or scores left the finite numbers: the run diverged (the message names the step)."""


def check_finite_step(step: int, loss: float, scores_are_nan: bool) -> None:
    """Raise :class:`NonFiniteLossError` for step ``step`` when its ``loss`` is NaN / inf or its scores hold a NaN
    (before they reach the AUROC metric, whose input check would name neither the step nor the cause)."""
    if math.isfinite(loss) and not scores_are_nan:
        return
    raise NonFiniteLossError(nonfinite_step_message(step, str(loss), scores_are_nan))


def nonfinite_step_message(step: int, loss: str, scores_are_nan: bool) -> str:
    """The :class:`NonFiniteLossError` message for step ``step`` whose loss reads ``loss`` (a value, or values per
    rank)."""
    scores = ", and the model's scores hold NaN" if scores_are_nan else ""
    return (
        f"step {step}: the training loss is {loss}{scores}: training diverged (the weights overflowed); lower the "
        "learning rates (optim.dense_lr, optim.sparse_lr), then start a new run or resume from a checkpoint taken "
        f"before step {step}"
    )


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN


class TrainHistory:
    """Per-step losses, running training AUROC and NE, held-out evaluations and throughput of one job
    (checkpointable). ``step_samples``: the rows one step records over all ranks, padding included (the window NE
    holds the latest whole steps within ``train_auroc_window`` rows, at least one)."""

    def __init__(self, train_auroc_window: int, step_samples: int) -> None:
        self.train_auroc = AUROCMetric(window=train_auroc_window)
        self._ne_sizes = (train_auroc_window, step_samples)
        self.train_ne = ne_module(*self._ne_sizes)
        self.ne_restored = True  # False after loading a checkpoint written before the NE was kept
        self.steps: list[int] = []
        self.losses: list[float] = []
        self._pending: list[torch.Tensor] = []  # losses not yet read back (one sync per log interval, not per step)
        self.train_auroc_points: dict[str, list] = {"step": [], "auroc": []}
        self.train_ne_points: dict[str, list] = {"step": [], "window_ne": [], "lifetime_ne": []}
        self.eval_points: dict[str, list] = {"step": [], "auroc": [], "logloss": [], "samples": [], "ne": []}
        self.train_seconds = 0.0
        self.train_samples = 0

    def record_step(
        self, step: int, loss: torch.Tensor, logits: torch.Tensor, batch: Batch, num_valid: int, seconds: float
    ) -> None:
        """Step ``step`` trained on ``batch`` (``num_valid`` real rows, counted on the host) in ``seconds``;
        :class:`NonFiniteLossError` when the step diverged (one device sync: the AUROC update reads the scores
        back every step anyway)."""
        if not bool(torch.isfinite(loss).all() & ~torch.isnan(logits).any()):
            check_finite_step(step, float(loss), bool(torch.isnan(logits).any()))
        self.steps.append(step)
        self._pending.append(loss)
        self.train_auroc.update(logits.float(), batch.labels, batch.valid_mask)
        update_ne(self.train_ne, logits.float(), batch.labels, batch.valid_mask)
        self.train_seconds += seconds
        self.train_samples += num_valid

    def record_values(self, step: int, loss: float, scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      num_samples: int, seconds: float) -> None:  # fmt: skip
        """Step ``step`` with values already combined over ranks: its mean ``loss``, every rank's ``scores`` /
        ``labels`` / ``weights [N]`` and real samples, and this rank's wall time. Every rank holds the same values
        here, so a diverged step raises :class:`NonFiniteLossError` on every rank at once (none waits for another)."""
        check_finite_step(step, loss if num_samples else 0.0, bool(torch.isnan(scores).any()))  # 0 samples: no loss
        self.flush()
        self.steps.append(step)
        self.losses.append(loss)
        self.train_auroc.update(scores, labels, weights)
        update_ne(self.train_ne, scores, labels, weights)
        self.train_seconds += seconds
        self.train_samples += num_samples

    def flush(self) -> None:
        """Read pending losses back to the host."""
        if self._pending:
            self.losses += torch.stack(self._pending).tolist()
            self._pending = []

    def log_point(self, step: int) -> dict[str, float]:
        """Record the running training AUROC and NE at ``step``; return the progress-bar summary."""
        self.flush()
        auroc = self.train_auroc.compute()
        self.train_auroc_points["step"].append(step)
        self.train_auroc_points["auroc"].append(_finite_or_none(auroc))
        ne = ne_values(self.train_ne)
        self.train_ne_points["step"].append(step)
        for key, value in ne.items():
            self.train_ne_points[key].append(_finite_or_none(value))
        return {
            "loss": self.recent_loss(),
            "auroc": auroc,
            "ne": ne["window_ne"],
            "lifetime_ne": ne["lifetime_ne"],
            "samples_per_s": self.samples_per_second(),
        }

    def recent_loss(self, steps: int = 20) -> float:
        """Mean loss of the last ``steps`` steps (NaN before the first)."""
        self.flush()
        recent = self.losses[-steps:]
        return sum(recent) / len(recent) if recent else math.nan

    def record_eval(self, step: int, result: dict[str, float]) -> None:
        self.eval_points["step"].append(step)
        self.eval_points["auroc"].append(_finite_or_none(result["auroc"]))
        self.eval_points["logloss"].append(_finite_or_none(result["logloss"]))
        self.eval_points.setdefault("samples", []).append(result.get("samples"))
        self.eval_points["ne"].append(_finite_or_none(result["ne"]))

    def samples_per_second(self) -> float:
        return self.train_samples / self.train_seconds if self.train_seconds > 0 else math.nan

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {
            "steps": list(self.steps),
            "losses": list(self.losses),
            "train_auroc": self.train_auroc.state_dict(),
            "train_auroc_points": {k: list(v) for k, v in self.train_auroc_points.items()},
            "train_ne": {k: v.clone() for k, v in self.train_ne.state_dict().items()},
            "train_ne_points": {k: list(v) for k, v in self.train_ne_points.items()},
            "eval_points": {k: list(v) for k, v in self.eval_points.items()},
            "train_seconds": self.train_seconds,
            "train_samples": self.train_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a state saved before the NE was kept (no ``train_ne``) loads too, its
        lifetime NE then restarting here (see :meth:`_load_train_ne`)."""
        expected = {"steps", "losses", "train_auroc", "train_auroc_points", "eval_points", "train_seconds",
                    "train_samples"}  # fmt: skip
        optional = {"train_ne", "train_ne_points"}
        if not isinstance(state, dict) or not expected <= set(state) <= expected | optional:
            raise ValueError(f"history state must have the keys {sorted(expected)} (and optionally {sorted(optional)})")
        self.steps, self.losses, self._pending = list(state["steps"]), list(state["losses"]), []
        self.train_auroc.load_state_dict(state["train_auroc"])
        self.train_auroc_points = {k: list(v) for k, v in state["train_auroc_points"].items()}
        self.eval_points = {k: list(v) for k, v in state["eval_points"].items()}
        self.eval_points.setdefault("ne", [None] * len(self.eval_points["step"]))  # evaluations from before NE
        points = state.get("train_ne_points", {"step": [], "window_ne": [], "lifetime_ne": []})
        self.train_ne_points = {k: list(v) for k, v in points.items()}
        self._load_train_ne(state.get("train_ne"), state["train_auroc"]["parts"])
        self.train_seconds, self.train_samples = float(state["train_seconds"]), int(state["train_samples"])

    def _load_train_ne(
        self, saved: dict[str, torch.Tensor] | None, auroc_steps: list[tuple[torch.Tensor, ...]]
    ) -> None:
        """The NE module's lifetime states from ``saved``; its window (not in a metric module's state dict: torchrec
        restarts it) is rebuilt from ``auroc_steps``, the (scores, labels, weights) of the steps the training AUROC
        holds, which cover the NE window, so a resumed job reports the window NE of an uninterrupted one. ``saved``
        None (an older checkpoint): the lifetime states start from zero, so the lifetime NE covers the steps trained
        after the resume."""
        self.train_ne = ne_module(*self._ne_sizes)  # not reset(): that restores torchrec's 1000-step window cap
        for scores, labels, weights in auroc_steps:
            update_ne(self.train_ne, scores, labels, weights)
        self.ne_restored = saved is not None
        # load_state_dict sets the lifetime states only (the window states are not persistent)
        zeros = {name: torch.zeros_like(value) for name, value in self.train_ne.state_dict().items()}
        self.train_ne.load_state_dict(saved if saved is not None else zeros)
