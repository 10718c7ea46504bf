"""Configuration dataclasses of the metric module, under torchrec's names (``torchrec.metrics.metrics_config``).

``RecMetricEnum`` lists every name torchrec knows, so a torchrec config ports unchanged; only those in
``tritonrec.metrics.metric_module.REC_METRICS_MAPPING`` are built, the others are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tritonrec.metrics.metrics_namespace import StrValueMixin


class RecMetricEnumBase(StrValueMixin, Enum):
    pass


class RecMetricEnum(RecMetricEnumBase):
    NE = "ne"
    NE_POSITIVE = "ne_positive"
    RECALIBRATED_NE = "recalibrated_ne"
    RECALIBRATED_CALIBRATION = "recalibrated_calibration"
    SEGMENTED_NE = "segmented_ne"
    LOG_LOSS = "log_loss"
    CTR = "ctr"
    AUC = "auc"
    AUPRC = "auprc"
    RAUC = "rauc"
    CALIBRATION = "calibration"
    MSE = "mse"
    MAE = "mae"
    MULTICLASS_RECALL = "multiclass_recall"
    RECALL_SESSION_LEVEL = "recall_session_level"
    PRECISION_SESSION_LEVEL = "precision_session_level"
    WEIGHTED_AVG = "weighted_avg"
    TOWER_QPS = "tower_qps"
    ACCURACY = "accuracy"
    NDCG = "ndcg"
    XAUC = "xauc"
    SCALAR = "scalar"
    PRECISION = "precision"
    RECALL = "recall"
    SERVING_NE = "serving_ne"
    SERVING_CALIBRATION = "serving_calibration"
    SERVING_AE_LOSS = "serving_ae_loss"
    OUTPUT = "output"
    TENSOR_WEIGHTED_AVG = "tensor_weighted_avg"
    CALI_FREE_NE = "cali_free_ne"
    UNWEIGHTED_NE = "unweighted_ne"
    HINDSIGHT_TARGET_PR = "hindsight_target_pr"
    NMSE = "nmse"
    AVERAGE = "average"
    MULTI_LABEL_PRECISION = "multi_label_precision"
    NUM_POSITIVE_SAMPLES = "num_positive_samples"
    SUM_WEIGHTS = "sum_weights"
    NUM_MISSING_LABELS = "num_missing_labels"
    WEIGHTED_SUM_PREDICTIONS = "weighted_sum_predictions"


@dataclass(unsafe_hash=True, eq=True)
class RecTaskInfo:
    """One model task: its report name and the keys of its label, prediction and weight in the model output."""

    name: str = "DefaultTask"
    label_name: str = "label"
    prediction_name: str = "prediction"
    weight_name: str = "weight"


class RecComputeMode(Enum):
    """How a metric lays out its tasks. ``UNFUSED_TASKS_COMPUTATION``: one computation (states of shape [1]) per
    task. ``FUSED_TASKS_COMPUTATION``: one computation with states of shape [n_tasks] for all tasks.
    ``FUSED_TASKS_AND_STATES_COMPUTATION`` (torchmetrics' fused state tensors) is not supported."""

    FUSED_TASKS_COMPUTATION = 1
    UNFUSED_TASKS_COMPUTATION = 2
    FUSED_TASKS_AND_STATES_COMPUTATION = 3


_DEFAULT_WINDOW_SIZE = 10_000_000
_DEFAULT_THROUGHPUT_WINDOW_SECONDS = 100
_DEFAULT_THROUGHPUT_WARMUP_STEPS = 100


@dataclass
class RecMetricDef:
    """One metric: its tasks (``rec_tasks``, or ``rec_task_indices`` into ``MetricsConfig.rec_tasks``, not both), its
    GLOBAL window in samples (each rank keeps ``ceil(window_size / world_size)``, which must be >= the batch size),
    and metric-specific ``arguments`` (e.g. ``{"include_logloss": True}``, ``{"threshold": 0.4}``)."""

    rec_tasks: list[RecTaskInfo] = field(default_factory=list)
    rec_task_indices: list[int] = field(default_factory=list)
    window_size: int = _DEFAULT_WINDOW_SIZE
    arguments: dict[str, Any] | None = None


class StateMetricEnum(StrValueMixin, Enum):
    OPTIMIZERS = "optimizers"
    MODEL_CONFIGURATOR = "model_configurator"


@dataclass
class ThroughputDef:
    """Throughput: ``window_size`` in SECONDS (time-based window) and the steps before timing starts."""

    window_size: int = _DEFAULT_THROUGHPUT_WINDOW_SECONDS
    warmup_steps: int = _DEFAULT_THROUGHPUT_WARMUP_STEPS


@dataclass
class MetricsConfig:
    """Everything ``generate_metric_module`` builds. Fields as torchrec's; those of torchrec's features this package
    does not implement (``fused_update_limit`` > 0, ``should_validate_update``, ``enable_pt2_compile``,
    ``use_cpu_offloaded_rec_metric_module``) are refused by name when set."""

    rec_tasks: list[RecTaskInfo] = field(default_factory=list)
    rec_metrics: dict[RecMetricEnum, RecMetricDef] = field(default_factory=dict)
    throughput_metric: ThroughputDef | None = None
    rec_compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION
    fused_update_limit: int = 0
    state_metrics: list[StateMetricEnum] = field(default_factory=list)
    compute_interval_steps: int = 100
    min_compute_interval: float = 0.0
    max_compute_interval: float = float("inf")
    compute_on_all_ranks: bool = False
    should_validate_update: bool = False
    enable_pt2_compile: bool = False
    should_clone_update_inputs: bool = False
    use_cpu_offloaded_rec_metric_module: bool | None = None

    def __post_init__(self) -> None:
        for metric_enum, metric_def in self.rec_metrics.items():
            for idx in metric_def.rec_task_indices:
                if not 0 <= idx < len(self.rec_tasks):
                    raise ValueError(
                        f"rec_task_indices {idx} of metric {metric_enum} is out of range of the "
                        f"{len(self.rec_tasks)} rec_tasks"
                    )


DefaultTaskInfo = RecTaskInfo(
    name="DefaultTask", label_name="label", prediction_name="prediction", weight_name="weight"
)

DefaultMetricsConfig = MetricsConfig(
    rec_tasks=[DefaultTaskInfo],
    rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[DefaultTaskInfo], window_size=_DEFAULT_WINDOW_SIZE)},
    throughput_metric=ThroughputDef(),
    state_metrics=[],
)
EmptyMetricsConfig = MetricsConfig(rec_tasks=[], rec_metrics={}, throughput_metric=None, state_metrics=[])
