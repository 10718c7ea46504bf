"""Metrics that are a ratio of two (or more) per-task weighted sums, lifetime and window: the shared computation.

A subclass lists its states (name -> function of (labels, predictions, weights), each [n_tasks, B] -> [n_tasks]) and
its reports (metric name -> function of the state values)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from tritonrec.metrics.computation import MetricComputationReport, RecMetricComputation
from tritonrec.metrics.metrics_namespace import MetricName, MetricPrefix

StateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ReportFn = Callable[..., torch.Tensor]


def ratio_or_zero(num: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """num / denom in float64, 0 where denom is 0 (torchrec reports 0 for a task that saw no weight)."""
    return torch.where(denom == 0.0, 0.0, num / denom).double()


class RatioMetricComputation(RecMetricComputation):
    # state name -> (labels, predictions, weights) [n_tasks, B] -> the batch's [n_tasks] contribution
    state_fns: ClassVar[dict[str, StateFn]] = {}
    # report name -> (names of the states it reads, formula over them)
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        for name in self.state_fns:
            self._add_state(
                name, torch.zeros(self._n_tasks, dtype=torch.double), True, dist_reduce_fx="sum", persistent=True
            )

    def _batch_states(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {name: fn(labels, predictions, weights) for name, fn in self.state_fns.items()}

    def update(self, *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        self._accumulate(self._batch_states(labels, predictions, weights), predictions.shape[-1])

    def _compute(self) -> list[MetricComputationReport]:
        reports = []
        for prefix in (MetricPrefix.LIFETIME, MetricPrefix.WINDOW):
            for metric_name, (state_names, formula) in self.report_fns.items():
                values = [
                    self.get_window_state(n) if prefix == MetricPrefix.WINDOW else getattr(self, n) for n in state_names
                ]
                reports.append(MetricComputationReport(metric_name, prefix, formula(*values)))
        return reports
