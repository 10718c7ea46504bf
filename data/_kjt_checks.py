"""Checks of the optional arguments of ``KeyedJaggedTensor(...)``: the strides, ``inverse_indices`` and the per-key
metadata caches (``length_per_key``, ``offset_per_key``, ``stride_per_key``, ``index_per_key``, ``jt_dict``).

torchrec trusts these arguments; here a cache that disagrees with the tensors it describes is refused naming the
argument (it would otherwise make ``to_dict``/``split``/``__getitem__`` cut the values at the wrong places). Checks
that read tensor contents follow :func:`tritonrec.kernels.checks.value_checks_enabled`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from tritonrec.data._validation import UnknownKeyError
from tritonrec.kernels.checks import check_int, value_checks_enabled

if TYPE_CHECKING:
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


def as_strides(stride_per_key_per_rank: Sequence[Sequence[int]] | torch.Tensor | None) -> list[list[int]] | None:
    """``stride_per_key_per_rank`` (nested ints or a ``[T, W]`` integer tensor) as lists, every entry an int >= 0."""
    if stride_per_key_per_rank is None:
        return None
    if isinstance(stride_per_key_per_rank, torch.Tensor):
        if stride_per_key_per_rank.dim() != 2 or stride_per_key_per_rank.is_floating_point():
            raise ValueError(
                "stride_per_key_per_rank must be a 2-D integer tensor [T, W], got shape "
                f"{tuple(stride_per_key_per_rank.shape)} dtype {stride_per_key_per_rank.dtype}"
            )
        stride_per_key_per_rank = stride_per_key_per_rank.tolist()
    return [
        [check_int(s, f"stride_per_key_per_rank[{t}][{r}]", 0) for r, s in enumerate(row)]
        for t, row in enumerate(stride_per_key_per_rank)
    ]


def check_lengths_rows(lengths: torch.Tensor | None, keys: list[str]) -> None:
    """2-D ``lengths`` are ``[T, B]`` (one row per key), as torchrec lays them out."""
    if isinstance(lengths, torch.Tensor) and lengths.dim() == 2 and lengths.shape[0] != len(keys):
        raise ValueError(
            f"2-D lengths must be [T, B] with one row per key (T = {len(keys)}), got shape {tuple(lengths.shape)}"
        )


def _int_list(value: object, name: str, size: int, increasing: bool = False) -> list[int]:
    """``value`` as a list of ``size`` non-negative ints (non-decreasing with ``increasing``)."""
    if not isinstance(value, (list, tuple)) or len(value) != size:
        raise ValueError(f"{name} must be a list of {size} ints, got {value!r}")
    numbers = [check_int(n, f"{name}[{i}]", 0) for i, n in enumerate(value)]
    for i in range(1, len(numbers) if increasing else 0):
        if numbers[i] < numbers[i - 1]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i - 1}] = {numbers[i - 1]} > {numbers[i]}")
    return numbers


def check_cached_metadata(
    kjt: KeyedJaggedTensor,
    length_per_key: object,
    offset_per_key: object,
    stride_per_key: object,
    index_per_key: object,
    jt_dict: object,
) -> None:
    """The caches a caller passed agree with ``kjt``'s keys, strides and (with value checks) lengths."""
    keys, num_values = kjt.keys(), kjt.values().shape[0]
    if stride_per_key is not None and _int_list(stride_per_key, "stride_per_key", len(keys)) != kjt.stride_per_key():
        raise ValueError(f"stride_per_key = {stride_per_key!r} disagrees with the strides: {kjt.stride_per_key()}")
    if index_per_key is not None and index_per_key != kjt.index_per_key():
        raise ValueError(f"index_per_key = {index_per_key!r} must map each key to its position: {kjt.index_per_key()}")
    given = length_per_key is not None or offset_per_key is not None
    # the KJT's own count per key (built without the caller's caches: one host read of its offsets)
    totals = list(kjt.length_per_key()) if given and value_checks_enabled() else None
    if length_per_key is not None:
        length_per_key = _int_list(length_per_key, "length_per_key", len(keys))
        if sum(length_per_key) > num_values:
            raise ValueError(f"length_per_key = {length_per_key} sums to more than the {num_values} values")
        if totals is not None and length_per_key != totals:
            raise ValueError(f"length_per_key = {length_per_key} disagrees with the lengths' per-key totals {totals}")
    if offset_per_key is not None:
        offset_per_key = _int_list(offset_per_key, "offset_per_key", len(keys) + 1, increasing=True)
        expected = length_per_key if length_per_key is not None else totals
        if expected is not None and offset_per_key != list(accumulate(expected, initial=0)):
            raise ValueError(
                f"offset_per_key = {offset_per_key} disagrees with the per-key totals {expected} (expected "
                f"{list(accumulate(expected, initial=0))})"
            )
        if offset_per_key[0] != 0 or offset_per_key[-1] > num_values:
            raise ValueError(f"offset_per_key = {offset_per_key} must start at 0 and end by {num_values} (values)")
    if jt_dict is not None:
        _check_jt_dict(jt_dict, keys, kjt.stride_per_key())


def _check_jt_dict(jt_dict: object, keys: list[str], stride_per_key: list[int]) -> None:
    from tritonrec.data.jagged_tensor import JaggedTensor

    if not isinstance(jt_dict, dict) or set(jt_dict) != set(keys):
        raise ValueError(f"jt_dict must be a dict with the keys {keys}, got {jt_dict!r:.200}")
    bags = dict(zip(keys, stride_per_key, strict=True))
    for key, jt in jt_dict.items():
        if not isinstance(jt, JaggedTensor) or jt.lengths().numel() != bags[key]:
            raise ValueError(f"jt_dict[{key!r}] must be a JaggedTensor of {bags[key]} bags, got {jt!r:.200}")


def check_inverse_indices(inverse_indices: Any, keys: list[str]) -> None:
    """``(inverse keys, inverse [len(inverse keys), B] int)``, each inverse key one of ``keys``."""
    if not (
        isinstance(inverse_indices, tuple)
        and len(inverse_indices) == 2
        and isinstance(inverse_indices[0], (list, tuple))
        and torch.is_tensor(inverse_indices[1])
    ):
        raise TypeError("inverse_indices must be a (list[str], torch.Tensor) tuple")
    inverse_keys, inverse = inverse_indices
    if inverse.dim() != 2 or inverse.shape[0] != len(inverse_keys) or inverse.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"inverse_indices[1] must be an int32/int64 [{len(inverse_keys)}, B] tensor (one row per inverse key), "
            f"got shape {tuple(inverse.shape)} dtype {inverse.dtype}"
        )
    for key in inverse_keys:
        if key not in keys:
            raise UnknownKeyError(f"inverse_indices[0] names key {key!r}, which is not one of the keys {keys}")


def check_inverse_range(
    inverse_indices: tuple[list[str], torch.Tensor], keys: list[str], stride_per_key: list[int]
) -> None:
    """Value check: row ``k`` of the inverse indices lies in ``[0, stride_per_key[key k])``."""
    inverse_keys, inverse = inverse_indices
    if not value_checks_enabled() or inverse.numel() == 0:
        return
    index = {key: i for i, key in enumerate(keys)}
    bound = torch.tensor([stride_per_key[index[k]] for k in inverse_keys], device=inverse.device)[:, None]
    bad = (inverse < 0) | (inverse >= bound)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"inverse_indices[1][{row}, {col}] = {int(inverse[row, col])} is outside [0, {int(bound[row, 0])}), "
            f"the bags of key {inverse_keys[row]!r}"
        )


def check_members(members: object, name: str, cls: type, container: type = list) -> list[Any]:
    """``members`` (a ``container`` of ``cls``, e.g. ``concat``'s ``kjt_list``) as a list, refusing members whose
    values (or weights) differ in dtype or device: ``torch.cat`` would silently promote int ids to float."""
    if not isinstance(members, (container, tuple) if container is list else container):
        raise TypeError(f"{name} must be a {container.__name__} of {cls.__name__}, got {type(members).__name__}")
    items = list(members.items()) if isinstance(members, dict) else list(enumerate(members))
    for where, member in items:
        if not isinstance(member, cls):
            raise TypeError(f"{name}[{where!r}] must be a {cls.__name__}, got {type(member).__name__}")
    if not items:
        return []
    first_where, first = items[0]
    for where, member in items[1:]:
        for part in ("values", "weights_or_none"):
            a, b = getattr(first, part)(), getattr(member, part)()
            if a is not None and b is not None and (a.dtype, a.device) != (b.dtype, b.device):
                raise ValueError(
                    f"{name}[{where!r}].{part.split('_')[0]}() is {b.dtype} on {b.device} but {name}[{first_where!r}]'s"
                    f" is {a.dtype} on {a.device}; convert them to one dtype and device first"
                )
    return [member for _, member in items]
