"""Input checks shared by every public op and sparse type: clear errors that name the argument and the bad value.

Two kinds of check:

* metadata checks (rank, dtype, device, sizes) are free and always run;
* value checks (negative lengths, out-of-range indices, offsets that do not match values) read tensor contents, which
  costs a device sync on CUDA. They run by default everywhere; production GPU jobs that have validated their data
  pipeline may switch them off with ``TRITONREC_VALUE_CHECKS=0`` or :func:`set_value_checks`. While dynamo traces
  (``torch.compile``, ``torch.export``) they are skipped: a traced graph cannot read tensor contents. The ops' own
  value checks run inside their implementations, at run time, also in compiled graphs (see
  :mod:`tritonrec.kernels.library`).

Shape and value problems raise ``ValueError``; a wrong dtype or Python type raises ``TypeError``.

Integer arguments (sizes, counts, ranks, capacities) go through :func:`check_int`: a Python int or a numpy integer
(``operator.index``, as torchrec and NeMo-RL take them), never a bool; a wrong type raises :class:`NotAnIntError`,
both a ``TypeError`` and a ``ValueError``.
"""

from __future__ import annotations

import operator
import os
from itertools import pairwise

import numpy as np
import torch

_INT_DTYPES = (torch.int32, torch.int64)
_value_checks_override: bool | None = None


def set_value_checks(enabled: bool | None) -> None:
    """Force value checks on or off; ``None`` restores the default (``TRITONREC_VALUE_CHECKS``, on unless '0')."""
    global _value_checks_override
    _value_checks_override = enabled


def value_checks_enabled() -> bool:
    """Whether value checks run: the override, else ``TRITONREC_VALUE_CHECKS``; never while dynamo traces."""
    if torch.compiler.is_compiling():
        return False
    if _value_checks_override is not None:
        return _value_checks_override
    return os.environ.get("TRITONREC_VALUE_CHECKS", "1").lower() not in ("0", "false", "off", "no")


class NotAnIntError(TypeError, ValueError):
    """An integer argument of another type (a bool, a float, a string, a tensor). A ``TypeError`` (its type is wrong)
    and a ``ValueError`` (what the integer arguments' range checks raise), so callers catching either see it."""


def _int_kind(minimum: int | None, maximum: int | None) -> str:
    if maximum is not None:
        return f"an int in [{minimum}, {maximum}]" if minimum is not None else f"an int <= {maximum}"
    return {None: "an int", 0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")


def check_int(
    value: object,
    name: str,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    what: str | None = None,
    context: str = "",
) -> int:
    """``value`` as a Python int, within ``[minimum, maximum]`` (either bound optional, both inclusive).

    Takes what ``operator.index`` takes (an int, a numpy integer), except a bool (``True`` is no size) and a tensor
    (reading one syncs a GPU: pass ``int(t)``). ``what`` replaces the description of the accepted values in the
    error (default: from the bounds, "a positive int"); ``context`` prefixes it (``"table 't0'"``). Raises
    :class:`NotAnIntError` for another type, ``ValueError`` for an int out of range; both name the argument and the
    value.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, (bool, np.bool_, torch.Tensor)) or not hasattr(type(value), "__index__"):
        kind = "a bool" if isinstance(value, (bool, np.bool_)) else f"a {type(value).__name__}"
        raise NotAnIntError(_int_error(value, name, minimum, maximum, what, context) + f" ({kind})")
    else:
        number = operator.index(value)  # type: ignore[arg-type]
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(_int_error(value, name, minimum, maximum, what, context))
    return number


def _int_error(
    value: object, name: str, minimum: int | None, maximum: int | None, what: str | None, context: str
) -> str:
    prefix = f"{context}: " if context else ""
    return f"{prefix}{name} must be {what or _int_kind(minimum, maximum)}, got {name}={value!r}"


def check_optional_int(
    value: object,
    name: str,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    what: str | None = None,
    context: str = "",
) -> int | None:
    """:func:`check_int`, or None for None (the error says "or None")."""
    if value is None:
        return None
    what = what or f"{_int_kind(minimum, maximum)} or None"
    return check_int(value, name, minimum, maximum, what=what, context=context)


def check_tensor(
    t: object,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    integer: bool = False,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Type, rank and dtype of one argument. ``integer`` means int32 or int64 (the index dtypes kernels accept)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimension(s), got shape {tuple(t.shape)}"
            )
    if integer and t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {list(dtypes)}, got {t.dtype}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host costs no device sync (CPU tensors). Ops that batch their reads for
    accelerators skip the batching there; tests force False to exercise the accelerator path on CPU tensors."""
    return t.device.type == "cpu"


def host_ints(*scalars: torch.Tensor) -> list[int]:
    """0-d integer tensors read as Python ints together: one device sync on an accelerator instead of one each (a
    sync also drains the launch queue, so on a GPU each costs far more than its copy). On the CPU a read is free and
    each is read alone (cheaper than stacking them)."""
    if scalars and reads_are_free(scalars[0]):
        return [int(s) for s in scalars]
    return torch.stack([s.reshape(()).to(torch.int64) for s in scalars]).tolist()


def check_nonnegative(t: torch.Tensor, name: str) -> None:
    """Value check: no entry below zero (lengths, sizes, indices). One reduction; the position is only searched
    for when there is an error to report."""
    if value_checks_enabled() and t.numel() > 0 and t.min().item() < 0:  # one reduction, one host read
        where = int((t.reshape(-1) < 0).nonzero()[0].item())
        raise ValueError(f"{name} must be non-negative, got {t.reshape(-1)[where].item()} at position {where}")


def check_index_range(t: torch.Tensor, name: str, high: torch.Tensor | int, what: str = "bound") -> None:
    """Value check: ``0 <= t < high`` elementwise (``high`` may be a tensor broadcast against ``t``)."""
    if not value_checks_enabled() or t.numel() == 0:
        return
    if isinstance(high, int):
        low_value, high_value = host_ints(*torch.aminmax(t))
        if low_value >= 0 and high_value < high:
            return
    bad = (t < 0) | (t >= high)
    if bool(bad.any()):
        where = int(bad.reshape(-1).nonzero()[0].item())
        limit = high if isinstance(high, int) else torch.broadcast_to(high, t.shape).reshape(-1)[where].item()
        raise ValueError(
            f"{name} out of range: {name}[{where}] = {t.reshape(-1)[where].item()} is outside [0, {limit}) ({what})"
        )


def spans_out_of_range(values: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[int]:
    """Positions in ``spans`` (``(start, end, rows)``: ``values[start:end]`` must lie in ``[0, rows)``) of the spans
    holding an out-of-range value. One ``aminmax`` per span (a view, no copy) and one host read for all of them:
    callers merge neighbouring features that share a row count into one span and search only failing spans."""
    spans = [span for span in spans if span[1] > span[0]]
    if not spans:
        return []
    extremes = torch.stack([e for start, end, _ in spans for e in torch.aminmax(values[start:end])]).tolist()
    return [
        k
        for k, ((_, _, rows), low, high) in enumerate(zip(spans, extremes[0::2], extremes[1::2], strict=True))
        if low < 0 or high >= rows
    ]


def merge_spans(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(start, end, rows)`` spans with each run of adjacent spans (one's end is the next one's start) of equal
    ``rows`` merged into one; empty spans dropped."""
    merged: list[tuple[int, int, int]] = []
    for start, end, rows in spans:
        if end <= start:
            continue
        if merged and merged[-1][1] == start and merged[-1][2] == rows:
            merged[-1] = (merged[-1][0], end, rows)
        else:
            merged.append((start, end, rows))
    return merged


def check_offsets(
    offsets: torch.Tensor,
    name: str,
    total: int | None = None,
    capacity: int | None = None,
    read_also: torch.Tensor | None = None,
) -> list[int]:
    """Value check: offsets start at 0, never decrease, and end at ``total`` (or at most at ``capacity``).
    One host sync on the happy path; the failing position is only searched for when there is an error.
    ``read_also``: an integer tensor a caller needs on the host, read in that same sync; its values are returned
    (``[]`` without one), also when value checks are off."""
    if not value_checks_enabled() or offsets.numel() == 0:
        return [] if read_also is None else read_also.tolist()
    first, last, min_step, also = _offsets_summary(offsets, read_also)
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    if min_step < 0:
        where = int((torch.diff(offsets) < 0).nonzero()[0].item())
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{where}] = {offsets[where].item()} > "
            f"{name}[{where + 1}] = {offsets[where + 1].item()}"
        )
    if total is not None and last != total:
        raise ValueError(f"{name} must end at {total} (the number of values), got {name}[-1] = {last}")
    if capacity is not None and last > capacity:
        raise ValueError(f"{name}[-1] = {last} exceeds the number of values ({capacity})")
    return also


def _offsets_summary(offsets: torch.Tensor, read_also: torch.Tensor | None) -> tuple[int, int, int, list[int]]:
    """``(first, last, smallest step, read_also's values)`` of non-empty ``offsets`` (step 0 for a single entry),
    read the cheapest way for the device: one sync on accelerators; on CPU, where a read is free, no stack (short
    lists are walked in Python, ~4x cheaper than the tensor ops for a few dozen entries)."""
    if not reads_are_free(offsets):
        min_step = torch.diff(offsets).min() if offsets.numel() > 1 else offsets[0] * 0
        parts = [torch.stack([offsets[0], offsets[-1], min_step])]
        parts += [] if read_also is None else [read_also.reshape(-1)]
        first, last, min_step, *also = torch.cat([p.to(torch.int64) for p in parts]).tolist()
        return first, last, min_step, also
    also = [] if read_also is None else read_also.tolist()
    if offsets.numel() <= 128:
        vals = offsets.tolist()
        return vals[0], vals[-1], min((b - a for a, b in pairwise(vals)), default=0), also
    return int(offsets[0]), int(offsets[-1]), int(torch.diff(offsets).min()), also


def check_lengths_total(
    lengths: torch.Tensor, name: str, total: int, what: str = "values", allow_slack: bool = False
) -> None:
    """Value check: ``lengths`` is non-negative and sums to ``total`` (the number of ``what``); with
    ``allow_slack``, to at most ``total`` (a values buffer may be longer than the bags it holds, as in torchrec)."""
    check_nonnegative(lengths, name)
    if value_checks_enabled():
        got = int(lengths.sum().item()) if lengths.numel() else 0
        if got > total:
            raise ValueError(f"sum({name}) = {got} exceeds the number of {what} ({total})")
        if got != total and not allow_slack:
            raise ValueError(f"sum({name}) = {got} does not match the number of {what} ({total})")


__all__ = [
    "NotAnIntError",
    "check_index_range",
    "check_int",
    "check_lengths_total",
    "check_nonnegative",
    "check_offsets",
    "check_optional_int",
    "check_same_device",
    "check_tensor",
    "merge_spans",
    "set_value_checks",
    "spans_out_of_range",
    "value_checks_enabled",
]
