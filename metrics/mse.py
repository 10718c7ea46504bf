"""MSE and RMSE (and R² with ``include_r_squared=True``), weighted (``torchrec.metrics.mse``):

mse = sum w (y - p)^2 / sum w,   rmse = sqrt(mse),   r2 = 1 - sum w (y - p)^2 / (sum w y^2 - (sum w y)^2 / sum w)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tritonrec.metrics._checks import check_bool
from tritonrec.metrics._ratio import RatioMetricComputation, ReportFn, StateFn, ratio_or_zero
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace
from tritonrec.metrics.rec_metric import RecMetric

ERROR_SUM = "error_sum"
WEIGHTED_NUM_SAMPLES = "weighted_num_samples"
LABEL_SUM = "label_sum"
LABEL_SQUARED_SUM = "label_squared_sum"


def compute_rmse(error_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, torch.sqrt(error_sum / weighted_num_samples)).double()


def compute_r_squared(
    error_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    label_sum: torch.Tensor,
    label_squared_sum: torch.Tensor,
) -> torch.Tensor:
    total = label_squared_sum.double() - label_sum.double().square() / weighted_num_samples.double()
    return torch.where(total == 0.0, 1.0, 1.0 - error_sum / total).double()  # constant labels: torchrec reports 1


def _squared_error_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * (labels - predictions.double()).square()).sum(dim=-1)


class MSEMetricComputation(RatioMetricComputation):
    """Option ``include_r_squared``: also report R² (its label sums are then checkpointed, as in torchrec)."""

    options: ClassVar[tuple[str, ...]] = ("include_r_squared",)
    state_fns: ClassVar[dict[str, StateFn]] = {
        ERROR_SUM: _squared_error_sum,
        WEIGHTED_NUM_SAMPLES: lambda labels, predictions, weights: weights.sum(dim=-1),
        LABEL_SUM: lambda labels, predictions, weights: (weights * labels).sum(dim=-1),
        LABEL_SQUARED_SUM: lambda labels, predictions, weights: (weights * labels.square()).sum(dim=-1),
    }
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {
        MetricName.MSE: ((ERROR_SUM, WEIGHTED_NUM_SAMPLES), ratio_or_zero),
        MetricName.RMSE: ((ERROR_SUM, WEIGHTED_NUM_SAMPLES), compute_rmse),
    }

    def __init__(self, *args: Any, include_r_squared: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if check_bool(include_r_squared, "include_r_squared"):
            self.report_fns = {
                **self.report_fns,
                MetricName.R_SQUARED: (
                    (ERROR_SUM, WEIGHTED_NUM_SAMPLES, LABEL_SUM, LABEL_SQUARED_SUM),
                    compute_r_squared,
                ),
            }
        else:  # torchrec keeps the label sums out of checkpoints when R² is off
            self._non_persistent_buffers_set.update({LABEL_SUM, LABEL_SQUARED_SUM})


class MSEMetric(RecMetric):
    _namespace = MetricNamespace.MSE
    _computation_class = MSEMetricComputation
