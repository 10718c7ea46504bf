"""MAE: weighted mean absolute error (``torchrec.metrics.mae``); 0 where no weight was seen."""

from __future__ import annotations

from typing import ClassVar

import torch

from tritonrec.metrics._ratio import RatioMetricComputation, ReportFn, StateFn, ratio_or_zero
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace
from tritonrec.metrics.rec_metric import RecMetric


def _abs_error_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * (labels - predictions.double()).abs()).sum(dim=-1)


class MAEMetricComputation(RatioMetricComputation):
    state_fns: ClassVar[dict[str, StateFn]] = {
        "error_sum": _abs_error_sum,
        "weighted_num_samples": lambda labels, predictions, weights: weights.sum(dim=-1),
    }
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {
        MetricName.MAE: (("error_sum", "weighted_num_samples"), ratio_or_zero)
    }


class MAEMetric(RecMetric):
    _namespace = MetricNamespace.MAE
    _computation_class = MAEMetricComputation
