"""Splitting a model's output dict into per-task labels, predictions and weights (``torchrec.metrics.model_utils``)."""

from __future__ import annotations

import torch

from tritonrec.metrics._checks import check_same_numel, check_tensor
from tritonrec.metrics.metrics_config import RecTaskInfo


def parse_model_outputs(
    label_name: str, prediction_name: str, weight_name: str, model_out: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, predictions, weights), each squeezed to [B] (a batch of one stays [1])."""
    parts = []
    for role, key in (("label", label_name), ("prediction", prediction_name), ("weight", weight_name)):
        if key not in model_out:
            raise ValueError(f"model_out has no {role} {key!r} (keys: {sorted(model_out)})")
        parts.append(check_tensor(model_out[key], f"model_out[{key!r}]").squeeze())
    labels, predictions, weights = parts
    check_same_numel(labels, f"model_out[{label_name!r}]", predictions, f"model_out[{prediction_name!r}]")
    check_same_numel(weights, f"model_out[{weight_name!r}]", predictions, f"model_out[{prediction_name!r}]")
    if labels.dim() == 0:
        labels, predictions, weights = labels.unsqueeze(0), predictions.unsqueeze(0), weights.unsqueeze(0)
    return labels, predictions, weights


def parse_task_model_outputs(
    tasks: list[RecTaskInfo], model_out: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({task: labels}, {task: predictions}, {task: weights}); tasks whose tensors are all empty are left out."""
    if not isinstance(model_out, dict):
        raise TypeError(f"model_out must be a dict of tensors, got {type(model_out).__name__}")
    labels: dict[str, torch.Tensor] = {}
    predictions: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for task in tasks:
        label, prediction, weight = parse_model_outputs(
            task.label_name, task.prediction_name, task.weight_name, model_out
        )
        if label.numel() > 0:
            labels[task.name], predictions[task.name], weights[task.name] = label, prediction, weight
    return labels, predictions, weights
