"""Input checks for the packers: errors name the argument and the offending value (ValueError for values, TypeError
for types), and nothing is clipped."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def integers_as_int64(array: np.ndarray, name: str) -> np.ndarray:
    """An integer array as int64, refusing unsigned values that int64 cannot hold (a cast would wrap them negative)."""
    if array.dtype.kind == "u" and array.dtype.itemsize >= 8 and array.size:
        too_big = np.flatnonzero(array > np.iinfo(np.int64).max)
        if too_big.size:
            where = int(too_big[0])
            raise ValueError(
                f"{name}[{where}] = {int(array[where])} ({array.dtype}) does not fit int64: lengths must be below 2**63"
            )
    return array.astype(np.int64, copy=False)


def as_sequence_lengths(
    sequence_lengths: Sequence[int] | np.ndarray | torch.Tensor, bin_capacity: int, name: str = "sequence_lengths"
) -> np.ndarray:
    """``sequence_lengths`` as a 1-D int64 array, each ``0 <= length <= bin_capacity``."""
    if isinstance(sequence_lengths, torch.Tensor):
        if (
            sequence_lengths.is_floating_point()
            or sequence_lengths.is_complex()
            or sequence_lengths.dtype == torch.bool
        ):
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {sequence_lengths.dtype}")
        array = sequence_lengths.detach().cpu().numpy()
    else:
        array = np.asarray(sequence_lengths)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    array = integers_as_int64(array, name)
    if array.size:
        negative = np.flatnonzero(array < 0)
        if negative.size:
            where = int(negative[0])
            raise ValueError(f"{name}[{where}] = {int(array[where])} is negative; lengths must be >= 0")
        too_long = np.flatnonzero(array > bin_capacity)
        if too_long.size:
            where = int(too_long[0])
            raise ValueError(
                f"{name}[{where}] = {int(array[where])} exceeds bin_capacity={bin_capacity}; "
                "a sequence longer than a bin cannot be packed"
            )
    return array
