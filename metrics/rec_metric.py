"""The metric base classes, with torchrec's semantics (``torchrec.metrics.rec_metric``) and without torchmetrics.

A :class:`RecMetric` maps model outputs (per-task predictions, labels, weights) onto :class:`RecMetricComputation`
objects, which hold the states and the formula. Semantics kept from torchrec:

* states are per task (shape [n_tasks]; one computation per task in ``UNFUSED_TASKS_COMPUTATION``, so each holds [1]);
* every state has a lifetime value and, when added with ``add_window_state``, a window twin: the sum of the states of
  the most recent batches whose sample count fits in the LOCAL window ``ceil(window_size / world_size)`` (at most
  ``MAX_BUFFER_COUNT`` batches), so the global window over all ranks holds about ``window_size`` samples;
* ``compute()`` reduces the states over the process group first (a collective: call it on every rank), then evaluates
  the formula; only rank 0 reports unless ``compute_on_all_ranks``; ``local_compute()`` skips the reduction;
* ``sync()`` replaces the states by their reduced values until ``unsync()`` (so ``local_compute()`` in between reports
  global values on every rank);
* keys are ``"{namespace}-{task}|{lifetime_|window_}{metric}"``; ``local_compute()``'s carry ``local_`` before the
  prefix, ``"{namespace}-{task}|local_{lifetime_|window_}{metric}"`` (torchrec's), so local and global values logged
  side by side never share a key;
* checkpoints hold the persistent lifetime states (``state_dict`` keys ``_metrics_computations.{i}.{state}``); the
  window states are not persistent, so a restored metric restarts its window.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.metrics._checks import check_bool, check_int, check_same_numel, check_tensor
from tritonrec.metrics.computation import MAX_BUFFER_COUNT as MAX_BUFFER_COUNT  # re-exported: torchrec's home
from tritonrec.metrics.computation import MetricComputationReport as MetricComputationReport
from tritonrec.metrics.computation import RecMetricComputation
from tritonrec.metrics.computation import RecMetricException as RecMetricException
from tritonrec.metrics.computation import WindowBuffer as WindowBuffer
from tritonrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
from tritonrec.metrics.metrics_namespace import (
    MetricNamespaceBase,
    compose_customized_metric_key,
    compose_metric_namespace,
)

RecModelOutput = torch.Tensor | dict[str, torch.Tensor]


def _task_dict(value: object, name: str, tasks: list[RecTaskInfo]) -> dict[str, torch.Tensor]:
    """A model output as {task name: tensor}: a dict as given; a tensor as [n_tasks, B] (or [B] for one task)."""
    if isinstance(value, dict):
        for task_name, tensor in value.items():
            check_tensor(tensor, f"{name}[{task_name!r}]")
        return value
    tensor = check_tensor(value, name)
    if len(tasks) == 1:
        return {tasks[0].name: tensor}
    if tensor.dim() == 0 or tensor.shape[0] != len(tasks):
        raise ValueError(
            f"{name} as a tensor must be [n_tasks={len(tasks)}, batch] for {len(tasks)} tasks, got shape "
            f"{tuple(tensor.shape)} (or pass a dict of tensors keyed by task name)"
        )
    return {task.name: tensor[i] for i, task in enumerate(tasks)}


class RecMetric(nn.Module, abc.ABC):
    """One metric over its tasks. Subclasses set ``_namespace`` and ``_computation_class``; extra keyword arguments
    go to the computation (``options`` lists those it takes). Unsupported torchrec options are refused by name."""

    _computation_class: type[RecMetricComputation]
    _namespace: MetricNamespaceBase

    PREDICTIONS: str = "predictions"
    LABELS: str = "labels"
    WEIGHTS: str = "weights"

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: list[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        compute_on_all_ranks: bool = False,
        should_validate_update: bool = False,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        check_int(world_size, "world_size", 1)
        check_int(my_rank, "my_rank", 0)
        if my_rank >= world_size:
            raise ValueError(f"my_rank must be < world_size={world_size}, got {my_rank}")
        check_int(batch_size, "batch_size", 1)
        check_int(window_size, "window_size", 1)
        check_bool(compute_on_all_ranks, "compute_on_all_ranks")
        self._check_tasks(tasks)
        if compute_mode not in (RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION):
            raise ValueError(f"compute_mode {compute_mode} is not supported (UNFUSED_ or FUSED_TASKS_COMPUTATION)")
        if check_int(fused_update_limit, "fused_update_limit", -(2**31)) > 1:
            raise ValueError(f"fused_update_limit > 1 (buffered updates) is not supported, got {fused_update_limit}")
        if should_validate_update:
            raise ValueError("should_validate_update=True is not supported")
        if kwargs.pop("enable_pt2_compile", False):
            raise ValueError("enable_pt2_compile=True is not supported")
        if kwargs.pop("batch_size_stages", None) is not None:
            raise ValueError("batch_size_stages is not supported")
        self._should_clone_update_inputs = check_bool(
            kwargs.pop("should_clone_update_inputs", False), "should_clone_update_inputs"
        )
        for key in kwargs:
            if key not in self._computation_class.options:
                known = list(self._computation_class.options)
                raise ValueError(f"unknown argument {key!r} for {type(self).__name__} (it takes {known})")
        self._world_size = world_size
        self._my_rank = my_rank
        self._batch_size = batch_size
        self._tasks = list(tasks)
        self._compute_mode = compute_mode
        self._fused = compute_mode == RecComputeMode.FUSED_TASKS_COMPUTATION
        # torchrec's window_size is global: each rank keeps its share
        self._window_size = math.ceil(window_size / world_size)
        if self._window_size < batch_size:
            raise ValueError(
                f"window_size {window_size} over world_size {world_size} gives a local window of {self._window_size} "
                f"samples, smaller than batch_size {batch_size}: raise window_size"
            )
        n_computations, tasks_per_computation = (1, len(tasks)) if self._fused else (len(tasks), 1)
        self._metrics_computations = nn.ModuleList(
            self._computation_class(
                my_rank,
                batch_size,
                tasks_per_computation,
                self._window_size,
                compute_on_all_ranks,
                process_group,
                **kwargs,
            )
            for _ in range(n_computations)
        )

    @staticmethod
    def _check_tasks(tasks: object) -> None:
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, RecTaskInfo) for t in tasks):
            raise TypeError(f"tasks must be a non-empty list of RecTaskInfo, got {tasks!r}")
        names = [task.name for task in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks must have distinct names, got {names}")

    def _task_inputs(
        self, predictions: RecModelOutput, labels: RecModelOutput, weights: RecModelOutput | None
    ) -> list[tuple[RecTaskInfo, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(task, predictions [B], labels [B], weights [B]) for each task present in ``predictions`` with samples."""
        preds = _task_dict(predictions, self.PREDICTIONS, self._tasks)
        labs = _task_dict(labels, self.LABELS, self._tasks)
        weis = None if weights is None else _task_dict(weights, self.WEIGHTS, self._tasks)
        out = []
        for task in self._tasks:
            if task.name not in preds:  # torchrec skips tasks the batch does not carry
                continue
            pred = preds[task.name]
            if task.name not in labs:
                raise ValueError(f"labels has no entry for task {task.name!r} (it has {sorted(labs)})")
            label = labs[task.name]
            check_same_numel(label, f"labels[{task.name!r}]", pred, f"predictions[{task.name!r}]")
            if weis is None:
                weight = torch.ones_like(pred, dtype=torch.float)
            elif task.name not in weis:
                raise ValueError(f"weights has no entry for task {task.name!r} (it has {sorted(weis)})")
            else:
                weight = weis[task.name]
                check_same_numel(weight, f"weights[{task.name!r}]", pred, f"predictions[{task.name!r}]")
            if pred.numel() == 0:
                continue
            out.append((task, pred.reshape(-1), label.reshape(-1), weight.reshape(-1)))
        return out

    def update(
        self,
        *,
        predictions: RecModelOutput,
        labels: RecModelOutput,
        weights: RecModelOutput | None,
        **kwargs: Any,
    ) -> None:
        """Accumulate one batch. Each argument is {task name: [B]} or a tensor [n_tasks, B] ([B] for one task);
        ``weights=None`` weighs every sample 1."""
        kwargs.pop("_log_tensors", None)
        if kwargs.pop("required_inputs", None):
            raise ValueError("required_inputs is not supported by this metric")
        if kwargs:
            raise ValueError(f"unknown update arguments {sorted(kwargs)}")
        with torch.no_grad():
            inputs = self._task_inputs(predictions, labels, weights)
            if self._should_clone_update_inputs:
                inputs = [(t, p.clone(), la.clone(), w.clone()) for t, p, la, w in inputs]
            if self._fused:
                if not inputs:
                    return
                if len(inputs) != len(self._tasks) or len({p.numel() for _, p, _, _ in inputs}) != 1:
                    raise ValueError("FUSED_TASKS_COMPUTATION needs every task in each batch, with equal batch sizes")
                stacked = [torch.stack([item[i] for item in inputs]) for i in (1, 2, 3)]
                self._metrics_computations[0].update(predictions=stacked[0], labels=stacked[1], weights=stacked[2])
                return
            index = {task.name: i for i, task in enumerate(self._tasks)}
            for task, pred, label, weight in inputs:
                self._metrics_computations[index[task.name]].update(
                    predictions=pred.view(1, -1), labels=label.view(1, -1), weights=weight.view(1, -1)
                )

    def _reports(self, scope: str) -> dict[str, torch.Tensor]:
        """Every computation's ``{scope}compute()`` reports by key; ``scope`` ("" or "local_") also starts the
        metric part of the key, as torchrec's ``_tasks_iter``: ``"ne-t0|local_window_ne"``."""
        ret: dict[str, torch.Tensor] = {}
        for i, computation in enumerate(self._metrics_computations):
            for report in getattr(computation, f"{scope}compute")():
                tasks = self._tasks if self._fused else [self._tasks[i]]
                for j, task in enumerate(tasks):
                    value = report.value[j] if self._fused else report.value
                    key = compose_customized_metric_key(
                        compose_metric_namespace(self._namespace, task.name),
                        f"{scope}{report.metric_prefix}{report.name}",
                        report.description,
                    )
                    ret[key] = value
        return ret

    def compute(self) -> dict[str, torch.Tensor]:
        """{key: value} over all ranks (a collective: every rank must call it; non-reporting ranks get {})."""
        return self._reports("")

    def local_compute(self) -> dict[str, torch.Tensor]:
        """{key: value} over this rank's states only, keys ``"{namespace}-{task}|local_{prefix}{metric}"``."""
        return self._reports("local_")

    def sync(self) -> None:
        """Every computation's states become their values over all ranks (collective; see
        :meth:`RecMetricComputation.sync`)."""
        for computation in self._metrics_computations:
            computation.sync()

    def unsync(self) -> None:
        """Back to the local states; computations that are not synced are left alone (torchrec's)."""
        for computation in self._metrics_computations:
            if computation._is_synced:
                computation.unsync()

    def reset(self) -> None:
        for computation in self._metrics_computations:
            computation.reset()

    def get_required_inputs(self) -> set[str]:
        return set()


class RecMetricList(nn.Module):
    """Several RecMetrics behind RecMetric's interface."""

    def __init__(self, rec_metrics: list[RecMetric]) -> None:
        super().__init__()
        self.rec_metrics = nn.ModuleList(rec_metrics)
        self.required_inputs = None

    def __len__(self) -> int:
        return len(self.rec_metrics)

    def __getitem__(self, idx: int) -> nn.Module:
        return self.rec_metrics[idx]

    def get_required_inputs(self) -> list[str] | None:
        return self.required_inputs

    def update(self, *, predictions: RecModelOutput, labels: RecModelOutput, weights: RecModelOutput | None) -> None:
        for metric in self.rec_metrics:
            metric.update(predictions=predictions, labels=labels, weights=weights)

    def compute(self) -> dict[str, torch.Tensor]:
        return {key: value for metric in self.rec_metrics for key, value in metric.compute().items()}

    def local_compute(self) -> dict[str, torch.Tensor]:
        return {key: value for metric in self.rec_metrics for key, value in metric.local_compute().items()}

    def sync(self) -> None:
        for metric in self.rec_metrics:
            metric.sync()

    def unsync(self) -> None:
        for metric in self.rec_metrics:
            metric.unsync()

    def reset(self) -> None:
        for metric in self.rec_metrics:
            metric.reset()
