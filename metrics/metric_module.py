"""``RecMetricModule`` and ``generate_metric_module`` (``torchrec.metrics.metric_module``): the object a training
loop holds. ``update(model_out)`` once per batch on every rank, ``compute()`` (a collective: every rank calls it;
rank 0 gets the values unless ``compute_on_all_ranks``) when ``should_compute()``, ``state_dict`` in checkpoints."""

from __future__ import annotations

import abc
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tritonrec.metrics._checks import check_float, check_int
from tritonrec.metrics._sync import group_world_size
from tritonrec.metrics.accuracy import AccuracyMetric
from tritonrec.metrics.auc import AUCMetric
from tritonrec.metrics.calibration import CalibrationMetric
from tritonrec.metrics.ctr import CTRMetric
from tritonrec.metrics.mae import MAEMetric
from tritonrec.metrics.metrics_config import MetricsConfig, RecMetricEnum, RecTaskInfo, StateMetricEnum
from tritonrec.metrics.metrics_namespace import (
    MetricNamespace,
    compose_customized_metric_key,
    compose_metric_namespace,
)
from tritonrec.metrics.model_utils import parse_task_model_outputs
from tritonrec.metrics.mse import MSEMetric
from tritonrec.metrics.ne import NEMetric
from tritonrec.metrics.rec_metric import RecMetric, RecMetricException, RecMetricList
from tritonrec.metrics.throughput import ThroughputMetric

REC_METRICS_MAPPING: dict[RecMetricEnum, type[RecMetric]] = {
    RecMetricEnum.NE: NEMetric,
    RecMetricEnum.CTR: CTRMetric,
    RecMetricEnum.CALIBRATION: CalibrationMetric,
    RecMetricEnum.AUC: AUCMetric,
    RecMetricEnum.MSE: MSEMetric,
    RecMetricEnum.MAE: MAEMetric,
    RecMetricEnum.ACCURACY: AccuracyMetric,
}

# {metric namespace: {task name: {state name: tensor or list of tensors}}}
PreComputeStates = dict[str, dict[str, dict[str, torch.Tensor | list[torch.Tensor]]]]

STATE_METRICS_NAMESPACE_MAPPING: dict[StateMetricEnum, MetricNamespace] = {
    StateMetricEnum.OPTIMIZERS: MetricNamespace.OPTIMIZERS,
    StateMetricEnum.MODEL_CONFIGURATOR: MetricNamespace.MODEL_CONFIGURATOR,
}


class StateMetric(abc.ABC):
    """A component (optimizer, ...) reporting its own numbers: ``get_metrics() -> {name: value}``."""

    @abc.abstractmethod
    def get_metrics(self) -> dict[str, torch.Tensor | float]: ...


class RecMetricModule(nn.Module):
    """Rec metrics (from model outputs), throughput (from step times) and state metrics (from components)."""

    def __init__(
        self,
        batch_size: int,
        world_size: int,
        rec_tasks: list[RecTaskInfo] | None = None,
        rec_metrics: RecMetricList | None = None,
        throughput_metric: ThroughputMetric | None = None,
        state_metrics: dict[str, StateMetric] | None = None,
        compute_interval_steps: int = 100,
        min_compute_interval: float = 0.0,
        max_compute_interval: float = float("inf"),
    ) -> None:
        super().__init__()
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.world_size = check_int(world_size, "world_size", 1)
        self.compute_interval_steps = check_int(compute_interval_steps, "compute_interval_steps", 1)
        self.min_compute_interval, self.max_compute_interval = _check_compute_interval_range(
            min_compute_interval, max_compute_interval
        )
        # torchrec's: the defaults (0, inf) mean "keep compute_interval_steps"; anything else asks for one adjustment
        self._adjust_pending = (self.min_compute_interval, self.max_compute_interval) != (0.0, math.inf)
        self.last_compute_time: float | None = None
        # a buffer so .to(device) takes it where the collective backend needs it (NCCL: the GPU)
        self.register_buffer("_compute_interval_steps", torch.zeros(1, dtype=torch.int64), persistent=False)
        if rec_metrics is not None and not isinstance(rec_metrics, RecMetricList):
            raise TypeError(f"rec_metrics must be a RecMetricList, got {type(rec_metrics).__name__}")
        self.rec_tasks = list(rec_tasks) if rec_tasks else []
        self.rec_metrics = rec_metrics if rec_metrics is not None else RecMetricList([])
        self.throughput_metric = throughput_metric
        self.state_metrics = dict(state_metrics) if state_metrics else {}
        self.trained_batches = 0
        self.compute_count = 0

    def _update_rec_metrics(self, model_out: dict[str, torch.Tensor]) -> None:
        if len(self.rec_metrics) and self.rec_tasks:
            labels, predictions, weights = parse_task_model_outputs(self.rec_tasks, model_out)
            self.rec_metrics.update(predictions=predictions, labels=labels, weights=weights)

    def update(self, model_out: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """One batch: ``model_out`` holds each task's label, prediction and weight tensors ([B]) under the names its
        RecTaskInfo gives."""
        if kwargs:
            raise ValueError(f"unknown update arguments {sorted(kwargs)}")
        self._update_rec_metrics(model_out)
        if self.throughput_metric is not None:
            self.throughput_metric.update()
        self.trained_batches += 1

    def should_compute(self) -> bool:
        return self.trained_batches % self.compute_interval_steps == 0

    def _current_time(self) -> float:
        """Seconds since the epoch: the compute-interval clock (a method so tests can pin it)."""
        return time.time()

    def _adjust_compute_interval(self) -> None:
        """torchrec's time-adjusted interval, once, at the second compute(): the seconds since the first, divided by
        ``compute_interval_steps`` (the batches a loop following :meth:`should_compute` ran in between), give the
        seconds per batch; when the interval lay outside [min_compute_interval, max_compute_interval] the steps
        become ``int((min + 1) / per_batch)`` (max infinite), ``int((max - (1 if max > 1 else 0)) / per_batch)``
        (min 0) or ``int((min + max) / 2 / per_batch)``. Every rank then takes the largest over the default group
        (an all-reduce when torch.distributed is initialised with several ranks).

        Where torchrec 1.8 fails, this keeps the steps instead: an interval inside the range (torchrec sets 0 steps
        and should_compute() divides by zero), a step count rounding to 0 (raised to 1), a clock that did not advance
        (torchrec divides by zero); and every rank joins the all-reduce, offering its current steps when it wants no
        change (in torchrec only the ranks outside the range call it, so mixed ranks hang)."""
        now = self._current_time()
        if self._adjust_pending and self.last_compute_time is not None:
            self._adjust_pending = False
            interval = now - self.last_compute_time
            low, high = self.min_compute_interval, self.max_compute_interval
            wanted = self.compute_interval_steps
            if interval > 0 and not low <= interval <= high:
                per_batch = interval / self.compute_interval_steps
                if high == math.inf:
                    target = low + 1.0  # per-batch times vary: aim past min so the interval lands above it
                elif low == 0.0:
                    target = high - (1.0 if high > 1.0 else 0.0)  # likewise below max
                else:
                    target = (low + high) / 2
                wanted = max(1, int(target / per_batch))
            self._compute_interval_steps.fill_(wanted)
            if group_world_size(None) > 1:
                dist.all_reduce(self._compute_interval_steps, op=dist.ReduceOp.MAX)
            self.compute_interval_steps = int(self._compute_interval_steps.item())
        self.last_compute_time = now

    def compute(self) -> dict[str, torch.Tensor | float]:
        """Every metric's {key: value}, over all ranks (collective). With rec metrics, the second call may adjust
        ``compute_interval_steps`` to the configured seconds (see :meth:`_adjust_compute_interval`)."""
        self.compute_count += 1
        ret: dict[str, torch.Tensor | float] = {}
        if len(self.rec_metrics):
            self._adjust_compute_interval()
            ret.update(self.rec_metrics.compute())
        if self.throughput_metric is not None:
            ret.update(self.throughput_metric.compute())
        for namespace, component in self.state_metrics.items():
            for name, value in component.get_metrics().items():
                ret[compose_customized_metric_key(namespace, name)] = value
        return ret

    def local_compute(self) -> dict[str, torch.Tensor]:
        """The rec metrics over this rank's data only (no collective), keyed as torchrec's:
        ``"{namespace}-{task}|local_{prefix}{metric}"`` (``"ne-t0|local_window_ne"``); no throughput or state
        metrics (torchrec's)."""
        return self.rec_metrics.local_compute() if len(self.rec_metrics) else {}

    def sync(self) -> None:
        """Rec metric states become their values over all ranks until :meth:`unsync` (collective)."""
        self.rec_metrics.sync()

    def unsync(self) -> None:
        self.rec_metrics.unsync()

    def reset(self) -> None:
        self.rec_metrics.reset()

    def get_required_inputs(self) -> list[str] | None:
        return self.rec_metrics.get_required_inputs()

    def get_pre_compute_states(self, pg: dist.ProcessGroup | DeviceMesh | None = None) -> PreComputeStates:
        """Every rec metric's states reduced over ``pg`` (the default group when None; a DeviceMesh's "shard"
        dimension, as torchrec), identical on every rank: ``{metric namespace: {task name: {state name: value}}}``,
        a value being a tensor [n_tasks] ("sum" states, window twins included) or ``[tensor [n_tasks, n]]`` / ``[]``
        (AUC's kept samples, every rank's in rank order). Under FUSED_TASKS_COMPUTATION one computation holds every
        task, so only the first task's name appears (torchrec's). The throughput metric adds its buffers, local
        and not reduced, under ``{"throughput": {"throughput": {buffer name: tensor}}}``.

        A collective on every rank when torch.distributed is initialised; without it, the local states (torchrec
        requires an initialised group). Ranks may hold different AUC sample counts (torchrec's plain all-gather
        needs equal ones). Refused while synced (after :meth:`sync`, before :meth:`unsync`): the states then already
        span every rank, and reducing them again counts each rank world_size times (torchrec 1.8 does)."""
        self._refuse_if_synced("get_pre_compute_states")
        group: dist.ProcessGroup | None
        if isinstance(pg, DeviceMesh):
            group = pg.get_group(mesh_dim="shard")
        elif pg is None or isinstance(pg, dist.ProcessGroup):
            group = pg if pg is not None else (dist.group.WORLD if group_world_size(None) > 1 else None)
        else:
            raise TypeError(f"pg must be a ProcessGroup, a DeviceMesh or None, got {type(pg).__name__}")
        states: PreComputeStates = {}
        for metric in self.rec_metrics.rec_metrics:
            per_task = states.setdefault(metric._namespace.value, {})
            for task, computation in zip(metric._tasks, metric._metrics_computations, strict=False):
                # torchrec reduces over pg, not over each metric's own process_group (None here: a world of one)
                per_task[task.name] = computation.reduced_states(group)
        if self.throughput_metric is not None:
            buffers = {name: buffer for name, buffer in self.throughput_metric.named_buffers()}
            namespace = self.throughput_metric._namespace.value
            states.setdefault(namespace, {})[self.throughput_metric._metric_name.value] = buffers
        return states

    def load_pre_compute_states(self, source: PreComputeStates) -> None:
        """Set the states from ``source`` (``get_pre_compute_states()``'s output, possibly from another process), on
        every rank, without collectives. Values are copied; ``compute()`` afterwards reduces them over the ranks
        again, so ranks loading the same reduced states report them world_size times (torchrec's); ``sync()`` is not
        needed: ``local_compute()`` reports the loaded (global) values. A loaded window sum leaves the window at the
        next update (it cannot be split into batches; torchrec keeps it forever); AUC's loaded samples are trimmed
        one by one as usual. Refused while synced: :meth:`unsync` would throw the loaded states away."""
        self._refuse_if_synced("load_pre_compute_states")
        if not isinstance(source, dict):
            raise TypeError(f"source must be the dict get_pre_compute_states() returns, got {type(source).__name__}")
        for metric in self.rec_metrics.rec_metrics:
            namespace = metric._namespace.value
            if namespace not in source:
                raise KeyError(f"source has no states for metric namespace {namespace!r} (it has {sorted(source)})")
            for task, computation in zip(metric._tasks, metric._metrics_computations, strict=False):
                if task.name not in source[namespace]:
                    raise KeyError(f"source[{namespace!r}] has no states for task {task.name!r}")
                computation.load_states(source[namespace][task.name])
        if self.throughput_metric is not None:
            namespace, name = self.throughput_metric._namespace.value, self.throughput_metric._metric_name.value
            if name not in source.get(namespace, {}):
                raise KeyError(f"source has no throughput states under [{namespace!r}][{name!r}]")
            for buffer_name, buffer in self.throughput_metric.named_buffers():
                buffer.copy_(source[namespace][name][buffer_name])

    def _refuse_if_synced(self, action: str) -> None:
        """Checked on every rank before any collective, so a refusal leaves no rank waiting in one."""
        for metric in self.rec_metrics.rec_metrics:
            if any(computation._is_synced for computation in metric._metrics_computations):
                raise RecMetricException(
                    f"RecMetricModule.{action} while synced (metric {metric._namespace.value!r}): call unsync() first"
                )

    def shutdown(self) -> None:
        """Nothing to release: no background work (torchrec's only logs)."""

    def async_compute(self) -> dict[str, torch.Tensor | float]:
        raise RecMetricException("async_compute is not supported in RecMetricModule")


def _check_compute_interval_range(min_compute_interval: object, max_compute_interval: object) -> tuple[float, float]:
    """torchrec refuses max <= 0 and min < 0; also refused here: NaN, an infinite min (torchrec overflows) and
    min > max (torchrec aims for their midpoint)."""
    low = check_float(min_compute_interval, "min_compute_interval")
    high = check_float(max_compute_interval, "max_compute_interval")
    if not 0.0 <= low < math.inf:
        raise ValueError(f"min_compute_interval must be a finite number of seconds >= 0, got {low}")
    if not high > 0.0:
        raise ValueError(f"max_compute_interval must be > 0 seconds (inf for no bound), got {high}")
    if low > high:
        raise ValueError(f"min_compute_interval {low} must be <= max_compute_interval {high}")
    return low, high


def _rec_metric_class(metric_enum: object) -> type[RecMetric]:
    try:
        key = RecMetricEnum(metric_enum) if isinstance(metric_enum, str) else metric_enum
    except ValueError:
        key = None
    if key not in REC_METRICS_MAPPING:
        supported = sorted(str(m) for m in REC_METRICS_MAPPING)
        raise ValueError(
            f"metrics_config.rec_metrics: metric {metric_enum!r} is not supported (supported: {supported})"
        )
    return REC_METRICS_MAPPING[key]


def _generate_rec_metrics(
    metrics_config: MetricsConfig,
    world_size: int,
    my_rank: int,
    batch_size: int,
    process_group: dist.ProcessGroup | None = None,
) -> RecMetricList:
    rec_metrics = []
    for metric_enum, metric_def in metrics_config.rec_metrics.items():
        metric_class = _rec_metric_class(metric_enum)
        if metric_def.rec_tasks and metric_def.rec_task_indices:
            raise ValueError(f"metric {metric_enum}: give only one of RecMetricDef.rec_tasks and rec_task_indices")
        if metric_def.rec_tasks:
            tasks = list(metric_def.rec_tasks)
        elif metric_def.rec_task_indices:
            tasks = [metrics_config.rec_tasks[i] for i in metric_def.rec_task_indices]
        else:
            raise ValueError(f"metric {metric_enum}: RecMetricDef.rec_tasks or rec_task_indices must be non-empty")
        rec_metrics.append(
            metric_class(
                world_size=world_size,
                my_rank=my_rank,
                batch_size=batch_size,
                tasks=tasks,
                compute_mode=metrics_config.rec_compute_mode,
                window_size=metric_def.window_size,
                fused_update_limit=metrics_config.fused_update_limit,
                compute_on_all_ranks=metrics_config.compute_on_all_ranks,
                should_validate_update=metrics_config.should_validate_update,
                process_group=process_group,
                enable_pt2_compile=metrics_config.enable_pt2_compile,
                should_clone_update_inputs=metrics_config.should_clone_update_inputs,
                **(metric_def.arguments or {}),
            )
        )
    return RecMetricList(rec_metrics)


def _generate_state_metrics(
    metrics_config: MetricsConfig, state_metrics_mapping: dict[StateMetricEnum, StateMetric]
) -> dict[str, StateMetric]:
    state_metrics: dict[str, StateMetric] = {}
    for metric_enum in metrics_config.state_metrics:
        namespace = STATE_METRICS_NAMESPACE_MAPPING.get(metric_enum)
        if namespace is None:
            raise ValueError(f"metrics_config.state_metrics: unknown state metric {metric_enum!r}")
        if metric_enum not in state_metrics_mapping:
            raise ValueError(f"state_metrics_mapping has no component for {metric_enum}")
        state_metrics[compose_metric_namespace(namespace, str(namespace))] = state_metrics_mapping[metric_enum]
    return state_metrics


def generate_metric_module(
    metric_class: type[RecMetricModule],
    metrics_config: MetricsConfig,
    batch_size: int,
    world_size: int,
    my_rank: int,
    state_metrics_mapping: dict[StateMetricEnum, StateMetric],
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
    batch_size_stages: object = None,
    module_kwargs: dict[str, Any] | None = None,
) -> RecMetricModule:
    """Build ``metric_class`` from ``metrics_config`` for this rank, on ``device``."""
    if not isinstance(metrics_config, MetricsConfig):
        raise TypeError(f"metrics_config must be a MetricsConfig, got {type(metrics_config).__name__}")
    if batch_size_stages is not None:
        raise ValueError("batch_size_stages is not supported")
    if metrics_config.use_cpu_offloaded_rec_metric_module:
        raise ValueError("metrics_config.use_cpu_offloaded_rec_metric_module is not supported")
    rec_metrics = _generate_rec_metrics(metrics_config, world_size, my_rank, batch_size, process_group)
    throughput_metric = None
    if metrics_config.throughput_metric is not None:
        throughput_metric = ThroughputMetric(
            batch_size=batch_size,
            world_size=world_size,
            window_seconds=metrics_config.throughput_metric.window_size,
            warmup_steps=metrics_config.throughput_metric.warmup_steps,
        )
    module = metric_class(
        batch_size=batch_size,
        world_size=world_size,
        rec_tasks=metrics_config.rec_tasks,
        rec_metrics=rec_metrics,
        throughput_metric=throughput_metric,
        state_metrics=_generate_state_metrics(metrics_config, state_metrics_mapping),
        compute_interval_steps=metrics_config.compute_interval_steps,
        min_compute_interval=metrics_config.min_compute_interval,
        max_compute_interval=metrics_config.max_compute_interval,
        **(module_kwargs or {}),
    )
    return module.to(device)
