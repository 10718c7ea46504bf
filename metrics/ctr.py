"""CTR: weighted sum of labels over sum of weights (``torchrec.metrics.ctr``); 0 where no weight was seen."""

from __future__ import annotations

from typing import ClassVar

from tritonrec.metrics._ratio import RatioMetricComputation, ReportFn, StateFn, ratio_or_zero
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace
from tritonrec.metrics.rec_metric import RecMetric

CTR_NUM = "ctr_num"
CTR_DENOM = "ctr_denom"


class CTRMetricComputation(RatioMetricComputation):
    state_fns: ClassVar[dict[str, StateFn]] = {
        CTR_NUM: lambda labels, predictions, weights: (labels * weights).sum(dim=-1),
        CTR_DENOM: lambda labels, predictions, weights: weights.sum(dim=-1),
    }
    report_fns: ClassVar[dict[MetricName, tuple[tuple[str, ...], ReportFn]]] = {
        MetricName.CTR: ((CTR_NUM, CTR_DENOM), ratio_or_zero)
    }


class CTRMetric(RecMetric):
    _namespace = MetricNamespace.CTR
    _computation_class = CTRMetricComputation
