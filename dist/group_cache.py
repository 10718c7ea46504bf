"""Module-level caches of process groups that never outlive the groups torch still knows.

Why: ``destroy_process_group`` drops only torch's own references to a group. A group still held in one of our
caches keeps its gloo backend (worker and socket threads) running: after a destroy and a new
``init_process_group`` in the same process, an id-keyed cache could hand out a dead group, and a backend that lives
into interpreter finalization has C++ threads touching Python objects while the interpreter tears down. The spawned
ranks of ``scripts/dmp_example.py`` ended in a rare SIGABRT ("terminate called without an active exception") after
their last collective while a side group was still cached.

So every cache made with :func:`group_cache` drops the entries naming a destroyed group at each lookup
(:func:`prune`), and an ``atexit`` hook, which runs before finalization, empties them all and collects garbage: the
groups (also those only reference cycles held) are then freed while Python is whole, and their backends join their
threads.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["clear_group_caches", "group_cache", "is_registered", "prune"]

_CACHES: list[dict[Any, Any]] = []


def group_cache() -> dict[Any, Any]:
    """A new module-level cache whose keys and values may hold process groups (alone or in tuples)."""
    cache: dict[Any, Any] = {}
    _CACHES.append(cache)
    return cache


def is_registered(group: dist.ProcessGroup) -> bool:
    """Whether torch still knows ``group``: ``new_group`` / ``init_process_group`` registered it and no
    ``destroy_process_group`` removed it (torch keeps that registry in ``_world.pg_map``)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def _groups_in(obj: Any) -> Iterator[dist.ProcessGroup]:
    if isinstance(obj, dist.ProcessGroup):
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _groups_in(item)


def prune(cache: dict[Any, Any]) -> None:
    """Drop the entries of ``cache`` whose key or value names a group torch no longer knows."""
    for key, value in list(cache.items()):
        if not all(is_registered(group) for group in (*_groups_in(key), *_groups_in(value))):
            del cache[key]


def clear_group_caches() -> None:
    """Empty every cache (callable at any time once the groups are no longer needed; run at exit)."""
    for cache in _CACHES:
        cache.clear()


@atexit.register
def _release_at_exit() -> None:
    """Empty the caches, then collect: a model that held a group sits in reference cycles (modules, hooks, autograd
    nodes), and without this the group would be freed by the collection finalization runs, its backend joining
    threads while Python is half torn down. Only when a cache was used: a process that never cached a group pays
    nothing."""
    if any(_CACHES):
        clear_group_caches()
        gc.collect()
