"""Calibration: weighted sum of predictions over weighted sum of labels (``torchrec.metrics.calibration``);
0 where no positive weight was seen."""

from __future__ import annotations

from typing import ClassVar

import torch

from tritonrec.metrics._ratio import RatioMetricComputation, ReportFn, StateFn
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace
from tritonrec.metrics.rec_metric import RecMetric

CALIBRATION_NUM = "calibration_num"
CALIBRATION_DENOM = "calibration_denom"


def compute_calibration(calibration_num: torch.Tensor, calibration_denom: torch.Tensor) -> torch.Tensor:
    return torch.where(calibration_denom <= 0.0, 0.0, calibration_num / calibration_denom).double()


class CalibrationMetricComputation(RatioMetricComputation):
    state_fns: ClassVar[dict[str, StateFn]] = {
        CALIBRATION_NUM: lambda labels, predictions, weights: (predictions * weights).sum(dim=-1),
        CALIBRATION_DENOM: lambda labels, predictions, weights: (labels * weights).sum(dim=-1),
    }
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {
        MetricName.CALIBRATION: ((CALIBRATION_NUM, CALIBRATION_DENOM), compute_calibration)
    }


class CalibrationMetric(RecMetric):
    _namespace = MetricNamespace.CALIBRATION
    _computation_class = CalibrationMetricComputation
