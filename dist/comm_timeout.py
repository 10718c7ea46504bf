"""Waiting for a collective with a deadline, and errors that name the collective.

A rank that never joins a collective leaves the others blocked in it. The process group's own timeout (set at
``init_process_group``, 30 minutes by default for gloo) eventually fails them with a backend message that names no
operation of ours. Here every wait of our comm layer goes through :func:`wait_for_work`, which

* applies the per-collective timeout set with :func:`set_collective_timeout` (``None``: the group's own timeout), and
* turns a backend timeout into :class:`CollectiveTimeoutError` naming the collective, the rank and the group, and any
  other backend failure into :class:`CollectiveError` with the same context.

After a timeout the group has a collective that never completed; its state is undefined, so the run should stop
(tear down the group) rather than retry on it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Iterator

import torch.distributed as dist

_collective_timeout_s: float | None = None


class CollectiveError(RuntimeError):
    """A collective of the comm layer failed (the message names it, and the backend error is the cause)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete in time: some rank of its group did not join it (or joined another one)."""


def _check_timeout(seconds: object, name: str = "seconds") -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds or None, got {name}={seconds!r}")
    return float(seconds)


def set_collective_timeout(seconds: float | None) -> None:
    """Fail any wait of a comm op after ``seconds`` (``None``: rely on the process group's timeout).

    On NCCL a finite timeout makes ``wait()`` block the host until the collective ends (that is how the deadline is
    enforced); leave it ``None`` in production GPU jobs and set the group's timeout instead.
    """
    global _collective_timeout_s
    _collective_timeout_s = _check_timeout(seconds)


def get_collective_timeout() -> float | None:
    return _collective_timeout_s


@contextlib.contextmanager
def collective_timeout(seconds: float | None) -> Iterator[None]:
    """``with collective_timeout(5.0): ...`` sets the per-collective timeout for the block, then restores it."""
    previous = _collective_timeout_s
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(previous)


def _describe_group(group: dist.ProcessGroup) -> str:
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):  # a group this process is not part of, or an already destroyed one
        ranks = list(range(group.size()))
    return f"rank {group.rank()} of a group of {group.size()} (global ranks {ranks})"


def _looks_like_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def wait_for_work(work: dist.Work, collective: str, group: dist.ProcessGroup) -> None:
    """``work.wait()`` under the per-collective timeout; backend errors become errors that name ``collective``."""
    timeout = _collective_timeout_s
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        where = _describe_group(group)
        if _looks_like_timeout(error):
            after = f"after {timeout:g} s " if timeout is not None else "(process group timeout) "
            raise CollectiveTimeoutError(
                f"{collective} timed out {after}on {where} waiting for the other ranks: a rank that never joins "
                f"this collective, or joins a different one, leaves the others here. Backend: {error}"
            ) from error
        raise CollectiveError(f"{collective} failed on {where}: {error}") from error


__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "collective_timeout",
    "get_collective_timeout",
    "set_collective_timeout",
    "wait_for_work",
]
