"""Per-key value helpers of :class:`~tritonrec.data.batched_data_dict.BatchedDataDict`: a value's row count
(``row_count``), the rows at some indices (``take_rows``) and one key of ``from_batches`` stacked across
batches (``stack_values``).
Values are tensors (batch on dim 0; sequences on dim 1 where there is one) or Python lists, one entry per sample.

Separate from :mod:`tritonrec.data.batched_data_dict` to keep that module small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

Indices = Sequence[int] | np.ndarray | torch.Tensor


def row_count(value: Any, key: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"value for key {key!r} must have a batch dimension, got a 0-d tensor")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(f"values must be tensors or lists, got {type(value).__name__} for key {key!r}")


def take_rows(value: Any, rows: Indices) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(rows, dtype=torch.int64, device=value.device)]
    positions = rows.tolist() if isinstance(rows, (torch.Tensor, np.ndarray)) else rows
    return [value[i] for i in positions]


def stack_values(values: list[Any], key: str, pad_value: float) -> Any:
    """One key of ``from_batches``: lists flatten, 1-D tensors concatenate, others pad dim 1 and concatenate."""
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError(f"key {key!r} mixes types {sorted({type(v).__name__ for v in values})}; use tensors or lists")
    ranks = {v.dim() for v in values}
    if ranks == {1}:
        return torch.cat(values)
    if len(ranks) > 1 or 0 in ranks:
        raise ValueError(f"key {key!r} has tensors of ranks {sorted(ranks)}; they must share one rank >= 1")
    trailing = {tuple(v.shape[2:]) for v in values}
    if len(trailing) > 1:
        raise ValueError(f"key {key!r} has tensors whose dims after the sequence dim differ: {sorted(trailing)}")
    longest = max(v.shape[1] for v in values)
    dims_after = 2 * (values[0].dim() - 2)
    padded = [
        torch.nn.functional.pad(v, (0,) * dims_after + (0, longest - v.shape[1]), value=pad_value) for v in values
    ]
    return torch.cat(padded)
