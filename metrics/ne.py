"""NE, normalized entropy: the weighted cross entropy of the predictions divided by that of always predicting the
weighted base rate, with torchrec's clamping (``eta`` = 1e-12) and base-2 logs (``torchrec.metrics.ne``):

    ce_sum   = sum_i -w_i (y_i log2 p_i + (1 - y_i) log2 (1 - p_i)),   p_i clamped to [eta, 1 - eta]
    ne       = ce_sum / (-pos log2 q - neg log2 (1 - q)),  pos = sum w y,  neg = sum w (1 - y),  q = pos / sum w
    logloss  = ce_sum / (pos + neg)        (``include_logloss=True``)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tritonrec.metrics._checks import check_bool
from tritonrec.metrics.computation import MetricComputationReport, RecMetricComputation
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from tritonrec.metrics.rec_metric import RecMetric

ETA = 1e-12


def compute_cross_entropy(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> torch.Tensor:
    """[n_tasks, B] -> [n_tasks, B] weighted per-sample cross entropy (bits), in float64."""
    p = predictions.double().clamp(min=eta, max=1 - eta)
    return -weights * labels * torch.log2(p) - weights * (1.0 - labels) * torch.log2(1.0 - p)


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float,
    allow_missing_label_with_zero_weight: bool = False,
) -> torch.Tensor:
    """[n_tasks] states -> [n_tasks] NE."""
    mean_label = (pos_labels / weighted_num_samples.double().clamp(min=eta)).clamp(min=eta, max=1 - eta)
    ce_norm = -pos_labels * torch.log2(mean_label) - neg_labels * torch.log2(1.0 - mean_label)
    ne = ce_sum / ce_norm
    if allow_missing_label_with_zero_weight and not weighted_num_samples.all():
        return torch.where(weighted_num_samples > 0, ne, eta)  # a task without weight reports eta, not 0/0
    return ne


def compute_logloss(
    ce_sum: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    return ce_sum / (pos_labels + neg_labels).clamp(min=eta)


def get_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> dict[str, torch.Tensor]:
    """[n_tasks, B] inputs -> the batch's [n_tasks] sums."""
    return {
        "cross_entropy_sum": compute_cross_entropy(labels, predictions, weights, eta).sum(dim=-1),
        "weighted_num_samples": weights.sum(dim=-1),
        "pos_labels": (weights * labels).sum(dim=-1),
        "neg_labels": (weights * (1.0 - labels)).sum(dim=-1),
    }


class NEMetricComputation(RecMetricComputation):
    """NE (and optionally logloss), lifetime and window. Options: ``include_logloss``,
    ``allow_missing_label_with_zero_weight``."""

    options: ClassVar[tuple[str, ...]] = ("include_logloss", "allow_missing_label_with_zero_weight")

    def __init__(
        self,
        *args: Any,
        include_logloss: bool = False,
        allow_missing_label_with_zero_weight: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._include_logloss = check_bool(include_logloss, "include_logloss")
        self._allow_missing = check_bool(allow_missing_label_with_zero_weight, "allow_missing_label_with_zero_weight")
        for name in ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels"):
            self._add_state(
                name, torch.zeros(self._n_tasks, dtype=torch.double), True, dist_reduce_fx="sum", persistent=True
            )
        self.eta = ETA

    def update(self, *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        self._accumulate(get_ne_states(labels, predictions, weights, self.eta), predictions.shape[-1])

    def _states(self, window: bool) -> list[torch.Tensor]:
        names = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")
        return [self.get_window_state(n) if window else getattr(self, n) for n in names]

    def _compute(self) -> list[MetricComputationReport]:
        reports = []
        for prefix, window in ((MetricPrefix.LIFETIME, False), (MetricPrefix.WINDOW, True)):
            ce, num, pos, neg = self._states(window)
            reports.append(
                MetricComputationReport(
                    MetricName.NE, prefix, compute_ne(ce, num, pos, neg, self.eta, self._allow_missing)
                )
            )
        if self._include_logloss:
            for prefix, window in ((MetricPrefix.LIFETIME, False), (MetricPrefix.WINDOW, True)):
                ce, _, pos, neg = self._states(window)
                reports.append(
                    MetricComputationReport(MetricName.LOG_LOSS, prefix, compute_logloss(ce, pos, neg, self.eta))
                )
        return reports


class NEMetric(RecMetric):
    _namespace = MetricNamespace.NE
    _computation_class = NEMetricComputation
