"""Binary classification metrics in torch: AUROC (exact, tie-aware, weighted) and a streaming accumulator.

AUROC is the probability that a random positive scores above a random negative (ties count one half). Sorting the
scores once and stepping through each group of tied scores at once gives it exactly: the trapezoid area under the
weighted ROC curve (true- against false-positive weight) over ``W_pos * W_neg``. That curve is computed by
``tritonrec.metrics.auc.roc_area``, which ``tritonrec.metrics``' AUC uses too (one core: a fix there fixes both);
this module keeps its own conventions: float64 sums and NaN for a one-class input. Weights let padded rows
(weight 0) drop out without copying.
"""

from __future__ import annotations

import math

import torch

from tritonrec.kernels.checks import check_optional_int
from tritonrec.metrics.auc import roc_area


def _vector(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(value.shape)}")
    return value


def _check_scores_labels(
    scores: object, labels: object, weights: object | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores (float, not NaN), labels (0/1) and weights (finite, non-negative; ones when None) of one shape; labels
    and weights returned as float64."""
    scores, labels = _vector(scores, "scores"), _vector(labels, "labels")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a float tensor, got dtype {scores.dtype}")
    if labels.shape != scores.shape:
        raise ValueError(f"labels must match scores' shape {tuple(scores.shape)}, got {tuple(labels.shape)}")
    if weights is None:
        weights = torch.ones_like(scores, dtype=torch.float64)
    elif not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
    elif weights.shape != scores.shape:
        raise ValueError(f"weights must match scores' shape {tuple(scores.shape)}, got {tuple(weights.shape)}")
    weights = weights.to(torch.float64)
    labels_f = labels.to(torch.float64)
    bad = (labels_f != 0) & (labels_f != 1)
    if bool(bad.any()):
        where = int(bad.nonzero()[0].item())
        raise ValueError(f"labels must be 0 or 1, got labels[{where}] = {labels[where].item()}")
    # a NaN weight makes every later cumulative sum NaN and an infinite one gives inf / inf: either turns the AUROC
    # into NaN silently, so the first bad weight is refused by position, as a NaN score is
    bad = ~torch.isfinite(weights) | (weights < 0)
    if bool(bad.any()):
        where = int(bad.nonzero()[0].item())
        raise ValueError(f"weights must be finite and non-negative, got weights[{where}] = {weights[where].item()}")
    if bool(torch.isnan(scores).any()):
        where = int(torch.isnan(scores).nonzero()[0].item())
        raise ValueError(f"scores must not be NaN, got NaN at scores[{where}]")
    return scores, labels_f, weights


def auroc(scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Area under the ROC curve of ``scores [N]`` (logits or probabilities) for ``labels [N]`` (0/1), with optional
    finite, non-negative sample ``weights [N]`` (the first NaN, infinite or negative weight is refused by position).
    NaN when either class has zero total weight (AUROC is undefined there; ``tritonrec.metrics``' AUC reports 0.5
    instead). The curve is ``tritonrec.metrics.auc.roc_area``'s, shared with that metric, here accumulated in
    float64."""
    scores, labels, weights = _check_scores_labels(scores, labels, weights)
    # float64 holds every narrower float exactly: same order, same ties, and the sums accumulate in float64
    area, positive, negative = roc_area(scores.to(torch.float64)[None], labels[None], weights[None])
    total_pos, total_neg = float(positive[0]), float(negative[0])
    if total_pos == 0.0 or total_neg == 0.0:
        return math.nan
    return float(area[0]) / (total_pos * total_neg)


class AUROCMetric:
    """Accumulates ``(scores, labels, weights)`` batches and computes their AUROC.

    ``window``: keep only the most recent ``window`` samples (a running AUROC over the latest training batches);
    ``None`` keeps everything (a held-out evaluation). Kept on CPU.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = check_optional_int(window, "window", 1)
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._count = 0

    def update(self, scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add one batch: ``scores [B]``, ``labels [B]``, ``weights [B]`` (e.g. the batch's valid_mask)."""
        scores, labels, weights = _check_scores_labels(scores, labels, weights)
        part = (scores.detach().to("cpu", torch.float64), labels.cpu(), weights.cpu())
        self._parts.append(part)
        self._count += part[0].shape[0]
        while self.window is not None and self._parts and self._count - self._parts[0][0].shape[0] >= self.window:
            self._count -= self._parts.pop(0)[0].shape[0]

    def compute(self) -> float:
        """AUROC of the samples held (NaN if empty or one-class)."""
        if not self._parts:
            return math.nan
        scores, labels, weights = (torch.cat(parts) for parts in zip(*self._parts, strict=True))
        if self.window is not None:
            scores, labels, weights = scores[-self.window :], labels[-self.window :], weights[-self.window :]
        return auroc(scores, labels, weights)

    def reset(self) -> None:
        self._parts, self._count = [], 0

    def state_dict(self) -> dict[str, object]:
        """The samples held, so a resumed job reports the same running AUROC."""
        return {"window": self.window, "parts": [tuple(t.clone() for t in part) for part in self._parts]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if not isinstance(state, dict) or set(state) != {"window", "parts"}:
            raise ValueError("state must be a dict with keys 'window' and 'parts' (from state_dict())")
        parts = state["parts"]
        if not isinstance(parts, list):
            raise TypeError(f"state['parts'] must be a list, got {type(parts).__name__}")
        self._parts = [tuple(part) for part in parts]  # type: ignore[misc]
        self._count = sum(part[0].shape[0] for part in self._parts)
