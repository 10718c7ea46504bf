"""Metric key names, as torchrec spells them: ``"{namespace}-{task}|{prefix}{metric}"``, e.g. ``"ne-ctr|lifetime_ne"``.

Only the names of the metrics this package computes are listed; downstream dashboards match these strings, so their
values must stay torchrec's.
"""

from __future__ import annotations

from enum import Enum


class StrValueMixin:
    def __str__(self) -> str:
        return self.value  # type: ignore[attr-defined]


class MetricNameBase(StrValueMixin, Enum):
    pass


class MetricName(MetricNameBase):
    DEFAULT = ""
    NE = "ne"
    LOG_LOSS = "logloss"
    THROUGHPUT = "throughput"
    TOTAL_EXAMPLES = "total_examples"
    ATTEMPT_EXAMPLES = "attempt_examples"
    CTR = "ctr"
    CALIBRATION = "calibration"
    MSE = "mse"
    MAE = "mae"
    RMSE = "rmse"
    R_SQUARED = "r_squared"
    AUC = "auc"
    ACCURACY = "accuracy"


class MetricNamespaceBase(StrValueMixin, Enum):
    pass


class MetricNamespace(MetricNamespaceBase):
    DEFAULT = ""
    NE = "ne"
    THROUGHPUT = "throughput"
    CTR = "ctr"
    CALIBRATION = "calibration"
    MSE = "mse"
    AUC = "auc"
    MAE = "mae"
    ACCURACY = "accuracy"
    OPTIMIZERS = "optimizers"
    MODEL_CONFIGURATOR = "model_configurator"


class MetricPrefix(StrValueMixin, Enum):
    DEFAULT = ""
    LIFETIME = "lifetime_"
    WINDOW = "window_"
    ATTEMPT = "attempt_"


def task_wildcard_metrics_pattern(
    namespace: MetricNamespaceBase, metric_name: MetricNameBase, metric_prefix: MetricPrefix = MetricPrefix.DEFAULT
) -> str:
    """A regular expression matching ``metric_name`` of ``namespace`` for any task."""
    return rf"{namespace}-.+\|{metric_prefix}{metric_name}"


def compose_metric_namespace(namespace: MetricNamespaceBase, task_name: str) -> str:
    """``"{namespace}-{task_name}"``."""
    return f"{namespace}-{task_name}"


def compose_customized_metric_key(namespace: str, metric_name: str, description: str | None = None) -> str:
    """``"{namespace}|{metric_name}{description}"`` for free-form names (state metrics)."""
    return f"{namespace}|{metric_name}{description or ''}"


def compose_metric_key(
    namespace: MetricNamespaceBase,
    task_name: str,
    metric_name: MetricNameBase,
    metric_prefix: MetricPrefix = MetricPrefix.DEFAULT,
    description: str | None = None,
) -> str:
    """The key a metric value is reported under, e.g. ``"ne-ctr|window_ne"``."""
    return compose_customized_metric_key(
        compose_metric_namespace(namespace, task_name), f"{metric_prefix}{metric_name}", description
    )
