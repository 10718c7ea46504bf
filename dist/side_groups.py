"""Process groups over the same ranks as another, for traffic that must not share its collective order.

Why: collectives of one group are matched across ranks by the order they are launched in. A sparse input dist
launched ahead (the train pipelines start batch ``i + 1``'s while batch ``i`` runs) sits in that order before
batch ``i``'s own collectives; if one rank failed to launch it, every later collective of the group would pair up
wrongly. On a group of its own, a missing input dist can only stall that group, and the pipeline can let the
ranks agree on failures while batch ``i``'s forward runs instead of before it.

A side group whose ranks agreed that one of them failed to launch its part is renewed (:func:`renew_side_group`):
the launches the others made stay unmatched on the old group, so the next collective there would pair with them.
"""

from __future__ import annotations

import torch.distributed as dist

_GROUPS: dict[tuple[int, str], dist.ProcessGroup] = {}
# a renewed group -> its successor, so every holder of the old group moves to the same new one
_RENEWED: dict[int, dist.ProcessGroup] = {}


def same_ranks_group(group: dist.ProcessGroup, purpose: str, backend: str | None = None) -> dist.ProcessGroup:
    """A group over ``group``'s ranks with ``backend`` (default: ``group``'s), one per ``(group, purpose)``, or
    ``group`` itself when it does not span the world (``new_group`` must be entered by every rank with the same
    ranks, which only a world-spanning group guarantees) or has one rank. Every rank must get here in the same
    order, as when building a model."""
    if not dist.is_initialized() or dist.get_world_size(group) != dist.get_world_size() or dist.get_world_size() == 1:
        return group  # a one-rank group has nothing to mispair
    key = (id(group), purpose)
    if key not in _GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _GROUPS[key] = dist.new_group(ranks=ranks, backend=backend or dist.get_backend(group))
    return _GROUPS[key]


def renew_side_group(side_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A fresh group replacing ``side_group`` (one :func:`same_ranks_group` made) for every later caller, for its
    ``(group, purpose)`` and for holders of the old group that renew it too; ``side_group`` itself when it is not a
    side group. Collective like ``new_group``: every rank renews the same groups in the same order, as it does after
    the ranks agreed on a failure."""
    while id(side_group) in _RENEWED:  # renewed already (another holder of it came first)
        side_group = _RENEWED[id(side_group)]
        if side_group in _GROUPS.values():
            return side_group
    keys = [key for key, group in _GROUPS.items() if group is side_group]
    if not keys:
        return side_group
    fresh = dist.new_group(ranks=dist.get_process_group_ranks(side_group), backend=dist.get_backend(side_group))
    for key in keys:
        _GROUPS[key] = fresh
    _RENEWED[id(side_group)] = fresh
    return fresh
