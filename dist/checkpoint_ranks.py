"""The process groups and collectives a distributed checkpoint runs on (:mod:`tritonrec.dist.checkpoint`): the ranks
of ``pg`` with broadcast / gather / run-on-rank-0 over them (trivial in a single process), and the separate gloo group
an asynchronous save's background writer uses.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tritonrec.dist.group_cache import group_cache, prune

__all__ = ["Ranks", "async_group"]


class Ranks:
    """The collectives a checkpoint needs, over ``pg`` - or trivial ones in a single process."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup or None, got {type(pg).__name__}")
        self.pg = (pg if pg is not None else dist.group.WORLD) if self.distributed else None
        self.rank = dist.get_rank(self.pg) if self.distributed else 0
        self.world = dist.get_world_size(self.pg) if self.distributed else 1

    def broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on rank 0 (``[]`` elsewhere)."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(value, out if self.rank == 0 else None, dst=dist.get_global_rank(self.pg, 0), group=self.pg)
        return out

    def on_rank0(self, fn: Any) -> Any:
        """Run ``fn`` on rank 0; every rank returns its result or raises its error."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as err:  # sent to the other ranks so that all raise the same error
                error = err
        result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result


_ASYNC_GROUPS: dict[Any, dist.ProcessGroup] = group_cache()  # entries of destroyed groups dropped at lookup


def async_group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group of the same ranks for the background writer thread, whose collectives must not interleave with
    the training step's on ``pg`` (created once per group; a collective). It keeps torch's default timeout (30
    minutes for gloo) rather than ``pg``'s: the save's last collective waits for the slowest rank's writes, which
    can take far longer than a training collective."""
    key = pg if pg is not None else dist.group.WORLD
    prune(_ASYNC_GROUPS)
    if key not in _ASYNC_GROUPS:
        ranks = dist.get_process_group_ranks(key) if pg is not None else None
        _ASYNC_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _ASYNC_GROUPS[key]
