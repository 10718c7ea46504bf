"""torchrec.metrics' common subset under torchrec's names: RecMetricModule, NE, AUC, Calibration, CTR, Accuracy,
MSE/RMSE, MAE, Throughput (see each module's docstring for its formula)."""

from tritonrec.metrics.accuracy import AccuracyMetric
from tritonrec.metrics.auc import AUCMetric
from tritonrec.metrics.calibration import CalibrationMetric
from tritonrec.metrics.ctr import CTRMetric
from tritonrec.metrics.mae import MAEMetric
from tritonrec.metrics.metric_module import (
    REC_METRICS_MAPPING,
    RecMetricModule,
    StateMetric,
    generate_metric_module,
)
from tritonrec.metrics.metrics_config import (
    DefaultMetricsConfig,
    DefaultTaskInfo,
    EmptyMetricsConfig,
    MetricsConfig,
    RecComputeMode,
    RecMetricDef,
    RecMetricEnum,
    RecTaskInfo,
    StateMetricEnum,
    ThroughputDef,
)
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix, compose_metric_key
from tritonrec.metrics.mse import MSEMetric
from tritonrec.metrics.ne import NEMetric
from tritonrec.metrics.rec_metric import RecMetric, RecMetricComputation, RecMetricException, RecMetricList
from tritonrec.metrics.throughput import ThroughputMetric

__all__ = [
    "REC_METRICS_MAPPING",
    "AUCMetric",
    "AccuracyMetric",
    "CTRMetric",
    "CalibrationMetric",
    "DefaultMetricsConfig",
    "DefaultTaskInfo",
    "EmptyMetricsConfig",
    "MAEMetric",
    "MSEMetric",
    "MetricName",
    "MetricNamespace",
    "MetricPrefix",
    "MetricsConfig",
    "NEMetric",
    "RecComputeMode",
    "RecMetric",
    "RecMetricComputation",
    "RecMetricDef",
    "RecMetricEnum",
    "RecMetricException",
    "RecMetricList",
    "RecMetricModule",
    "RecTaskInfo",
    "StateMetric",
    "StateMetricEnum",
    "ThroughputDef",
    "ThroughputMetric",
    "compose_metric_key",
    "generate_metric_module",
]
