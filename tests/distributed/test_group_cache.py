"""Cached process groups never outlive the groups torch knows (:mod:`tritonrec.dist.group_cache`).

On 2 gloo ranks: a side group's cache entry goes once its parent is destroyed, and the parent's replacement gets a
side group of its own; after ``destroy_process_group``, the exit hook frees every group, also one that only a
reference cycle (a model) still held, so no gloo thread is left running into interpreter finalization (where one
ended a spawned rank with SIGABRT). Single-process cases check ``prune`` and ``clear_group_caches`` on plain caches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.spawned import spawn_ranks
from tritonrec.dist import group_cache, side_groups
from tritonrec.dist.group_cache import clear_group_caches, is_registered, prune

pytestmark = pytest.mark.dist


def _gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (its work loops and its socket loops)."""
    names = (Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name)


class _Cycle:
    """A holder in a reference cycle, as a module with hooks is: only the garbage collector frees it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.me = self


def _rank_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    parent = dist.new_group()
    side = side_groups.same_ranks_group(parent, "cache_test")
    out["same_side_twice"] = side_groups.same_ranks_group(parent, "cache_test") is side
    out["entries_before"] = sum(key[1] == "cache_test" for key in side_groups._GROUPS)
    dist.destroy_process_group(parent)
    prune(side_groups._GROUPS)
    out["entries_after_destroy"] = sum(key[1] == "cache_test" for key in side_groups._GROUPS)
    replacement = dist.new_group()
    fresh = side_groups.same_ranks_group(replacement, "cache_test")
    out["fresh_is_new_and_live"] = fresh is not side and is_registered(fresh)
    total = torch.ones(1)
    dist.all_reduce(total, group=fresh)
    out["fresh_works"] = total.item()

    holder = _Cycle(side_groups.same_ranks_group(dist.group.WORLD, "cache_test"))
    del holder, parent, side, replacement, fresh
    out["threads_before"] = bool(_gloo_threads())
    dist.destroy_process_group()
    out["threads_after_destroy_only"] = bool(_gloo_threads())  # the cycle and the caches still hold groups
    group_cache._release_at_exit()  # what atexit runs before finalization
    out["threads_at_exit"] = _gloo_threads()
    out["caches_empty"] = not any(group_cache._CACHES)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads thread names from /proc")
    return spawn_ranks(_rank_cases, 2, timeout=60)


def test_a_destroyed_parents_side_group_is_dropped_and_its_replacement_gets_its_own(results) -> None:
    for out in results:
        assert out["same_side_twice"] and out["entries_before"] == 1
        assert out["entries_after_destroy"] == 0
        assert out["fresh_is_new_and_live"] and out["fresh_works"] == 2.0


def test_no_gloo_thread_outlives_destroy_and_the_exit_hook(results) -> None:
    for out in results:
        assert out["threads_before"] and out["threads_after_destroy_only"]  # what the hook is there for
        assert out["threads_at_exit"] == [] and out["caches_empty"]


def test_prune_and_clear_on_plain_caches() -> None:
    """Without an initialised group every group counts as destroyed; entries without groups stay."""
    assert not dist.is_initialized()
    cache = group_cache.group_cache()
    try:
        fake = dist.ProcessGroup.__new__(dist.ProcessGroup)  # never registered with torch
        cache.update({"plain": 1, ("nested", (fake,)): 2, "value": (0, fake)})
        prune(cache)
        assert cache == {"plain": 1}
        clear_group_caches()
        assert cache == {}
    finally:
        group_cache._CACHES.remove(cache)
