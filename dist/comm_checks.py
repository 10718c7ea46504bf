"""Input checks of the comm layer: every public entry names the argument and the offending value.

Python types and dtypes raise ``TypeError``; sizes, lengths and values raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.kernels.checks import check_int, check_tensor

_CODEC_METHODS = ("encode", "decode", "calc_quantized_size", "create_context", "padded_size")


def resolve_group(group: object, name: str = "group") -> dist.ProcessGroup:
    """``group``, or the default group when it is ``None``."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(f"{name} is None and torch.distributed is not initialised: call init_process_group first")
        return dist.group.WORLD  # type: ignore[return-value]
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


def is_size(value: object) -> bool:
    try:
        check_int(value, "size", 0)
    except ValueError:  # NotAnIntError is one too
        return False
    return True


def check_sizes(values: object, name: str, length: int | None = None, what: str = "rank") -> list[int]:
    """A list (or tuple) of non-negative ints, with ``length`` entries if given (one per ``what``)."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}: {values!r}")
    sizes = [check_int(value, f"{name}[{i}]", 0, what="an int >= 0") for i, value in enumerate(values)]
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must have one entry per {what} ({length}), got {len(values)}: {name}={list(values)}")
    return sizes


def check_size_table(values: object, name: str, rows: int, row_lengths: Sequence[int] | None = None) -> list[list[int]]:
    """A list of ``rows`` lists of non-negative ints (row ``i`` with ``row_lengths[i]`` entries if given)."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of lists of ints, got {type(values).__name__}: {values!r}")
    if len(values) != rows:
        raise ValueError(f"{name} must have {rows} rows (one per rank), got {len(values)}: {name}={values!r}")
    return [
        check_sizes(row, f"{name}[{i}]", None if row_lengths is None else row_lengths[i], what="feature")
        for i, row in enumerate(values)
    ]


def check_float_tensor(t: object, name: str, ndim: int | None = None, min_ndim: int = 0) -> torch.Tensor:
    """A floating-point tensor with ``ndim`` dimensions (or at least ``min_ndim``)."""
    tensor = check_tensor(t, name, ndim=ndim)
    if tensor.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (embeddings), got dtype {tensor.dtype}")
    return tensor


def check_codecs(codecs: object, name: str = "codecs") -> Any:
    """``None`` or an object with ``forward`` and ``backward`` codecs implementing the QuantizedCommCodec methods."""
    if codecs is None:
        return None
    for direction in ("forward", "backward"):
        codec = getattr(codecs, direction, None)
        missing = [m for m in _CODEC_METHODS if not callable(getattr(codec, m, None))]
        if codec is None or missing:
            raise TypeError(
                f"{name} must be QuantizedCommCodecs (or None); {name}.{direction} = {codec!r} lacks {missing or 'all'}"
            )
    return codecs


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {name}={value!r}")
    return value


def check_same_length(a: Sequence[Any], a_name: str, b: Sequence[Any], b_name: str) -> None:
    if len(a) != len(b):
        raise ValueError(
            f"{a_name} and {b_name} must have the same length, got {len(a)} and {len(b)}: {list(a)} vs {list(b)}"
        )


__all__ = [
    "check_bool",
    "check_codecs",
    "check_float_tensor",
    "check_same_length",
    "check_size_table",
    "check_sizes",
    "is_size",
    "resolve_group",
]
