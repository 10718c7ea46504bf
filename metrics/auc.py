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


def roc_area(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted ROC core both AUROCs share (this metric's and the training job's
    ``tritonrec.dist.train.metrics.auroc``): ``predictions``, ``labels`` (0/1), ``weights``: [..., N] ->
    ``(area, positive_weight, negative_weight)``, each [...]. ``area`` is the trapezoid area under the curve of true-
    against false-positive weight (sorting by prediction, descending; tied predictions enter as one step, so a tie
    between a positive and a negative counts one half); the AUC is ``area / (positive_weight x negative_weight)``,
    left to the callers with their own convention where that product is 0. Sums accumulate in the dtype of
    ``labels * weights`` (float32 here, float64 in the job); N = 0 gives zeros."""
    if predictions.shape[-1] == 0:
        zeros = torch.zeros(predictions.shape[:-1], dtype=(labels * weights).dtype, device=predictions.device)
        return zeros, zeros.clone(), zeros.clone()
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
    return area, cum_tp[..., -1], cum_fp[..., -1]


def compute_auc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, apply_bin: bool = False
) -> torch.Tensor:
    """[n_tasks, N] each -> [n_tasks] weighted AUC (float32, as torchrec's); 0.5 where either class has no weight."""
    if apply_bin:  # torchrec's binarisation of soft labels
        labels = (labels >= 0.039).to(labels.dtype)
    if predictions.shape[-1] == 0:
        return torch.full(predictions.shape[:-1], 0.5, device=predictions.device)
    area, positive, negative = roc_area(predictions, labels, weights)
    total = negative * positive
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
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._add_state(name, [], add_window_state=False, dist_reduce_fx="cat", persistent=False)

    @property
    def _num_samples(self) -> int:
        """Samples kept, read from the list state itself, so states set by sync() or load_states() count too."""
        return sum(part.shape[-1] for part in getattr(self, PREDICTIONS))

    def update(self, *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        self._refuse_if_synced()
        nan = torch.isnan(predictions)
        if bool(nan.any()):  # the curve sorts predictions: a NaN has no place in that order (torchrec's value is
            task, sample = (int(i) for i in nan.nonzero()[0])  # an artefact of its sort), so refuse it by name
            raise ValueError(f"AUC predictions must not be NaN, got NaN at predictions[{task}, {sample}]")
        kept = [getattr(self, name) for name in (PREDICTIONS, LABELS, WEIGHTS)]
        for parts, value in zip(kept, (predictions, labels, weights), strict=True):
            parts.append(value.float())
        # drop whole old batches, then the oldest samples of the next one, until the window fits
        num_samples = self._num_samples
        while num_samples > self._window_size:
            excess = num_samples - self._window_size
            oldest = kept[0][0].shape[-1]
            for parts in kept:
                if excess >= oldest:
                    parts.pop(0)
                else:
                    parts[0] = parts[0][:, excess:]
            num_samples -= min(excess, oldest)

    def _compute(self) -> list[MetricComputationReport]:
        states = [self._local_list_state(name) for name in (PREDICTIONS, LABELS, WEIGHTS)]
        return [MetricComputationReport(MetricName.AUC, MetricPrefix.WINDOW, compute_auc(*states, self._apply_bin))]


class AUCMetric(RecMetric):
    _namespace = MetricNamespace.AUC
    _computation_class = AUCMetricComputation
