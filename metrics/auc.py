"""AUC, exact, over the window: each rank keeps its most recent ``ceil(window_size / world_size)`` samples (trimmed
sample by sample, as ``torchrec.metrics.auc``) and ``compute`` gathers every rank's, so the value is the AUC of the
union. torchrec reports only ``window_auc`` and does not checkpoint the kept samples; neither do we.

The weighted ROC curve: sort by prediction, descending; the true/false positive weights accumulated so far are the
curve's points; the AUC is the trapezoid area under them over (total positive weight x total negative weight), 0.5
when either is 0. Ties: all samples sharing a prediction enter the curve as one step (a tie between a positive and a
negative counts one half, the Mann-Whitney convention); torchrec steps through tied samples one at a time in sort
order, so its value there depends on that order. Without ties the two agree.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tritonrec.metrics._checks import check_bool
from tritonrec.metrics.computation import MetricComputationReport, RecMetricComputation
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from tritonrec.metrics.rec_metric import RecMetric

PREDICTIONS = "predictions"
LABELS = "labels"
WEIGHTS = "weights"


def compute_auc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, apply_bin: bool = False
) -> torch.Tensor:
    """[n_tasks, N] each -> [n_tasks] weighted AUC (float32, as torchrec's)."""
    if apply_bin:  # torchrec's binarisation of soft labels
        labels = (labels >= 0.039).to(labels.dtype)
    if predictions.shape[-1] == 0:
        return torch.full(predictions.shape[:-1], 0.5, device=predictions.device)
    sorted_predictions, order = torch.sort(predictions, dim=-1, descending=True)
    sorted_labels = labels.gather(-1, order)
    sorted_weights = weights.gather(-1, order)
    cum_tp = torch.cumsum(sorted_weights * sorted_labels, dim=-1)
    cum_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=-1)
    # each sample moves to the curve point at the end of its tie group: ascending -s, last index with -s <= -s_i
    ascending = (-sorted_predictions).contiguous()
    group_end = torch.searchsorted(ascending, ascending, right=True) - 1
    cum_tp = cum_tp.gather(-1, group_end)
    cum_fp = cum_fp.gather(-1, group_end)
    zero = torch.zeros_like(cum_tp[..., :1])  # the curve starts at (0, 0)
    area = torch.trapezoid(torch.cat([zero, cum_tp], dim=-1), torch.cat([zero, cum_fp], dim=-1), dim=-1)
    total = cum_fp[..., -1] * cum_tp[..., -1]
    return torch.where(total == 0, 0.5, area / torch.where(total == 0, 1.0, total))


class AUCMetricComputation(RecMetricComputation):
    """Window AUC. Option ``apply_bin``: labels >= 0.039 count as positive (torchrec's). ``grouped_auc`` is not
    supported."""

    options: ClassVar[tuple[str, ...]] = ("apply_bin", "grouped_auc")

    def __init__(self, *args: Any, apply_bin: bool = False, grouped_auc: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if grouped_auc:
            raise ValueError("grouped_auc=True is not supported")
        self._apply_bin = check_bool(apply_bin, "apply_bin")
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._add_state(name, [], add_window_state=False, dist_reduce_fx="cat", persistent=False)

    def update(self, *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        kept = [getattr(self, name) for name in (PREDICTIONS, LABELS, WEIGHTS)]
        for parts, value in zip(kept, (predictions, labels, weights), strict=True):
            parts.append(value.float())
        self._num_samples += predictions.shape[-1]
        # drop whole old batches, then the oldest samples of the next one, until the window fits
        while self._num_samples > self._window_size:
            excess = self._num_samples - self._window_size
            oldest = kept[0][0].shape[-1]
            for parts in kept:
                if excess >= oldest:
                    parts.pop(0)
                else:
                    parts[0] = parts[0][:, excess:]
            self._num_samples -= min(excess, oldest)

    def _compute(self) -> list[MetricComputationReport]:
        states = [self._local_list_state(name) for name in (PREDICTIONS, LABELS, WEIGHTS)]
        return [MetricComputationReport(MetricName.AUC, MetricPrefix.WINDOW, compute_auc(*states, self._apply_bin))]

    def reset(self) -> None:
        super().reset()
        self._num_samples = 0


class AUCMetric(RecMetric):
    _namespace = MetricNamespace.AUC
    _computation_class = AUCMetricComputation
