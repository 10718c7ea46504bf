"""Process groups over the same ranks as another, for traffic that must not share its collective order.

Why: collectives of one group are matched across ranks by the order they are launched in. A sparse input dist
launched ahead (the train pipelines start batch ``i + 1``'s while batch ``i`` runs) sits in that order before
batch ``i``'s own collectives; if one rank failed to launch it, every later collective of the group would pair up
wrongly. On a group of its own, a missing input dist can only stall that group, and the pipeline can let the
ranks agree on failures while batch ``i``'s forward runs instead of before it.

When the ranks agree that one of them failed to launch its part, the side groups of that purpose are renewed
(:func:`renew_side_groups`): the launches the others made stay unmatched on the old group, so the next collective
there would pair with them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tritonrec.dist.group_cache import group_cache, prune

INPUT_DIST = "input_dist"  # the purpose of the sparse input dists' side groups
# (id(parent), purpose) -> (parent, side group). The parent is held so that its id cannot be reused by a later group
# while the entry stands; an entry naming a destroyed group is dropped at the next lookup (group_cache.prune).
_GROUPS: dict[tuple[int, str], tuple[dist.ProcessGroup, dist.ProcessGroup]] = group_cache()
# id(renewed side group) -> (that group, the group that replaced it), held for the same reason.
_SUCCESSORS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = group_cache()


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """``group``'s own collective timeout (what ``init_process_group(timeout=...)`` set), or None when torch does not
    expose it (then ``new_group`` falls back to torch's default, 30 minutes for gloo). A side group gets its parent's:
    without it, a rank waiting there for a peer that never comes (the pipelines' step agreement) waited 30 minutes
    where the model's collectives give up after the job's timeout."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def same_ranks_group(group: dist.ProcessGroup, purpose: str, backend: str | None = None) -> dist.ProcessGroup:
    """A group over ``group``'s ranks with ``backend`` (default: ``group``'s), one per ``(group, purpose)``, or
    ``group`` itself when it does not span the world (``new_group`` must be entered by every rank with the same
    ranks, which only a world-spanning group guarantees) or has one rank. Every rank must get here in the same
    order, as when building a model. Holders that keep the result see renewals through :func:`current_group`."""
    if not dist.is_initialized() or dist.get_world_size(group) != dist.get_world_size() or dist.get_world_size() == 1:
        return group  # a one-rank group has nothing to mispair
    prune(_GROUPS)
    prune(_SUCCESSORS)
    key = (id(group), purpose)
    if key not in _GROUPS:
        ranks = dist.get_process_group_ranks(group)
        side = dist.new_group(ranks=ranks, backend=backend or dist.get_backend(group), timeout=group_timeout(group))
        _GROUPS[key] = (group, side)
    return _GROUPS[key][1]


def current_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group``, or the group that replaced it when it was renewed (a dict lookup: no collective)."""
    while id(group) in _SUCCESSORS:
        group = _SUCCESSORS[id(group)][1]
    return group


def renew_side_groups(purpose: str) -> None:
    """Replace every side group made for ``purpose`` with a fresh one over the same ranks, for later callers of
    :func:`same_ranks_group` and for holders reading :func:`current_group`. Collective like ``new_group``: every
    rank calls it at the same point (after the ranks agreed on a failure), and renews its groups in the order they
    were made, which is the same on every rank."""
    prune(_GROUPS)
    for key, (parent, group) in list(_GROUPS.items()):
        if key[1] == purpose:
            fresh = dist.new_group(
                ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group), timeout=group_timeout(group)
            )
            _GROUPS[key] = (parent, fresh)
            _SUCCESSORS[id(group)] = (group, fresh)
