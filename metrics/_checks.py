"""Argument checks shared by the metrics: each raises naming the argument and the value it was given."""

from __future__ import annotations

import torch


def check_int(value: object, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bools are refused: ``True`` is not a window size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    return float(value)


def check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_same_numel(value: torch.Tensor, name: str, reference: torch.Tensor, reference_name: str) -> None:
    """Labels and weights pair up with predictions sample by sample, so their element counts must agree."""
    if value.numel() != reference.numel():
        raise ValueError(
            f"{name} has {value.numel()} elements (shape {tuple(value.shape)}) but {reference_name} has "
            f"{reference.numel()} (shape {tuple(reference.shape)}); they must match sample for sample"
        )
