"""Layouts of a :class:`~tritonrec.data.batch_cache.DataGroup`'s arrays: a dense array is ``(per-item shape,
dtype)``; a cached KeyedJaggedTensor is a :class:`KJTLayout`.

A KJT is stored the way it is held (values key-major, one run per key), so reading it back needs neither the
transposing copy nor the compaction of empty bags that an ``[B, F]`` id matrix costs. Per batch it takes a slot of
``batch_size * max_values_per_item`` ids (filled from the start, the rest a hole in the file), its ``[F, B]`` int32
lengths, its ``[F]`` per-key totals and, when weighted, a slot of float32 weights.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.kernels.checks import check_int

ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class KJTLayout:
    """A cache array that is a KeyedJaggedTensor of stride ``batch_size``.

    Args:
        keys: the KJT's keys, in order.
        max_values_per_item: at most this many ids per item, over all keys (a bag of Criteo's 26 one-id features:
            26); an item holding more is refused when cached, naming the item.
        dtype: the ids' dtype, ``torch.int64`` or ``torch.int32``.
        weighted: the KJT carries per-id float32 weights (stored beside the ids; other dtypes are refused, so a
            round trip is exact).
    """

    keys: tuple[str, ...]
    max_values_per_item: int
    dtype: torch.dtype = torch.int64
    weighted: bool = False

    def __post_init__(self) -> None:
        keys = self.keys
        if isinstance(keys, str) or not isinstance(keys, Sequence) or not keys:
            raise ValueError(f"KJTLayout keys must be a non-empty sequence of str, got keys={keys!r}")
        if not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys):
            raise ValueError(f"KJTLayout keys must be distinct non-empty str, got keys={list(keys)!r}")
        object.__setattr__(self, "keys", tuple(keys))
        count = check_int(self.max_values_per_item, "max_values_per_item", 1, context="KJTLayout")
        object.__setattr__(self, "max_values_per_item", count)
        if self.dtype not in ID_DTYPES:
            raise ValueError(f"KJTLayout dtype must be torch.int64 or torch.int32, got dtype={self.dtype!r}")
        if not isinstance(self.weighted, bool):
            raise TypeError(f"KJTLayout weighted must be a bool, got weighted={self.weighted!r}")

    def describe(self) -> list[Any]:
        """The layout as the cache descriptor records it (JSON)."""
        return ["kjt", list(self.keys), self.max_values_per_item, str(self.dtype).removeprefix("torch."), self.weighted]

    def check(self, name: str, kjt: object, batch_size: int) -> None:
        """Raise a ValueError naming array ``name`` unless ``kjt`` fits this layout for a batch of ``batch_size``."""
        if not isinstance(kjt, KeyedJaggedTensor):
            raise ValueError(f"array {name!r} must be a KeyedJaggedTensor (its layout is {self}), got {type(kjt)}")
        if kjt.keys() != list(self.keys):
            raise ValueError(f"array {name!r} must have keys {list(self.keys)} in this order, got {kjt.keys()}")
        if kjt.variable_stride_per_key() or kjt.stride() != batch_size:
            raise ValueError(
                f"array {name!r} must have stride {batch_size} (the batch size) for every key, got "
                f"{kjt.stride_per_key() if kjt.variable_stride_per_key() else kjt.stride()}"
            )
        if kjt.values().dtype != self.dtype:
            raise ValueError(f"array {name!r} must hold ids of dtype {self.dtype}, got {kjt.values().dtype}")
        weights = kjt.weights_or_none()
        if (weights is not None) != self.weighted:
            state = "weighted" if self.weighted else "unweighted"
            raise ValueError(f"array {name!r} must be {state} (KJTLayout weighted={self.weighted})")
        if weights is not None and weights.dtype != torch.float32:
            raise ValueError(f"array {name!r} must have float32 weights (as stored), got {weights.dtype}")
        per_item = kjt.lengths().view(len(self.keys), batch_size).sum(0)
        if per_item.numel() and int(per_item.max()) > self.max_values_per_item:
            item = int(per_item.argmax())
            raise ValueError(
                f"array {name!r}: item {item} of the batch holds {int(per_item[item])} ids, more than "
                f"max_values_per_item={self.max_values_per_item}"
            )


Layout = tuple[tuple[int, ...], torch.dtype] | KJTLayout
Layouts = Mapping[str, Any]
CheckedLayouts = dict[str, Layout]


@functools.cache
def numpy_torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (cached: the batch store asks once per array read)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def torch_dtype(dtype: object, where: str) -> torch.dtype:
    """A user's torch or numpy dtype as a torch dtype, or a ValueError naming ``where``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return numpy_torch_dtype(np.dtype(dtype))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: dtype must be a torch or numpy dtype, got {dtype!r}") from None


def check_layouts(layouts: Layouts | None, name: str, storable: bool, kjt_allowed: bool = False) -> CheckedLayouts:
    """``{array: (shape, dtype)}`` (or :class:`KJTLayout` where ``kjt_allowed``), checked: shapes of non-negative
    ints, dtypes as torch dtypes (bfloat16 refused where the arrays are stored, as ``.npy`` has no such type)."""
    if layouts is None:
        return {}
    if not isinstance(layouts, Mapping) or not layouts:
        raise ValueError(f"{name} must be a non-empty mapping name -> (shape, dtype) or None, got {layouts!r}")
    checked: CheckedLayouts = {}
    for key, layout in layouts.items():
        where = f"{name}[{key!r}]"
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"{name}: array names must be non-empty str without '/', got {key!r}")
        if isinstance(layout, KJTLayout):
            if not kjt_allowed:
                raise ValueError(f"{where}: a KJTLayout is a cache layout; the loader fills dense arrays only")
            checked[key] = layout
            continue
        if not isinstance(layout, (tuple, list)) or len(layout) != 2:
            raise ValueError(f"{where} must be a (shape, dtype) pair, got {layout!r}")
        shape, dtype = layout
        dims_ok = all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in shape) if (
            isinstance(shape, (tuple, list))) else False  # fmt: skip
        if not dims_ok:  # a bool is an int to Python, but never a dimension; numpy ints are fine
            raise ValueError(f"{where}: shape must be a tuple of non-negative ints, got {shape!r}")
        shape = tuple(int(d) for d in shape)
        dtype = torch_dtype(dtype, where)
        if storable and dtype == torch.bfloat16:
            raise ValueError(f"{where}: dtype torch.bfloat16 cannot be stored as .npy; cache it as float32")
        checked[key] = (tuple(shape), dtype)
    return checked
