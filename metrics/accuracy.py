"""Accuracy at a threshold: the weighted share of samples with ``(prediction >= threshold) == label``
(``torchrec.metrics.accuracy``); 0 where no weight was seen."""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch

from tritonrec.metrics._checks import check_float
from tritonrec.metrics._ratio import RatioMetricComputation, ReportFn, StateFn, ratio_or_zero
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace
from tritonrec.metrics.rec_metric import RecMetric


def compute_accuracy_sum(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    """[n_tasks, B] -> [n_tasks] weight of the samples classified right at ``threshold``."""
    return (weights * ((predictions.double() >= threshold) == labels)).sum(dim=-1)


class AccuracyMetricComputation(RatioMetricComputation):
    """Option ``threshold`` (default 0.5): a prediction at or above it counts as positive."""

    options: ClassVar[tuple[str, ...]] = ("threshold",)
    state_fns: ClassVar[dict[str, StateFn]] = {
        "accuracy_sum": compute_accuracy_sum,
        "weighted_num_samples": lambda labels, predictions, weights: weights.sum(dim=-1),
    }
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {
        MetricName.ACCURACY: (("accuracy_sum", "weighted_num_samples"), ratio_or_zero)
    }

    def __init__(self, *args: Any, threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = check_float(threshold, "threshold")
        self.state_fns = {**self.state_fns, "accuracy_sum": partial(compute_accuracy_sum, threshold=self._threshold)}


class AccuracyMetric(RecMetric):
    _namespace = MetricNamespace.ACCURACY
    _computation_class = AccuracyMetricComputation
