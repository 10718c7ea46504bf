"""Process-group helpers: where a rank sits in the node topology, intra/cross-node groups, leader-only calls.

Topology follows torchrun's environment (https://pytorch.org/docs/stable/elastic/run.html): ``LOCAL_WORLD_SIZE``
ranks per node (``nproc_per_node``), ``LOCAL_RANK`` within the node; the MPI launchers' equivalents are read too.
Ranks are numbered node by node, so node ``g`` holds ranks ``[g * local_size, (g + 1) * local_size)``.

One deliberate difference from torchrec: without any of these variables, torchrec assumes 8 ranks per node when the
world size is a multiple of 8; we assume one node (``local_size == world_size``), which is what spawned CPU
processes and single-node runs are.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from tritonrec.dist.group_cache import group_cache, prune
from tritonrec.dist.side_groups import group_timeout
from tritonrec.kernels.checks import check_int, check_optional_int

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")

# intra_and_cross_node_pg's groups, "node" -> (world, intra, cross): kept with the world group they were built in, and
# dropped once any of them is destroyed (a new init_process_group in the same process builds new ones).
_NODE_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]] = group_cache()


def _env_int(names: tuple[str, ...]) -> tuple[str, int] | None:
    """First of ``names`` set in the environment, with its value (which must be a non-negative int)."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name} must be an int, got {name}={raw!r}") from None
        if value < 0:
            raise ValueError(f"environment variable {name} must be non-negative, got {name}={value}")
        return name, value
    return None


def _check_optional_int(value: object, name: str, minimum: int) -> int | None:
    return check_optional_int(value, name, minimum, what=f"an int >= {minimum} or None")


def get_local_size(world_size: int | None = None) -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE`` (or an MPI equivalent), else the whole world (one node).

    A value of 0 or one that does not divide the world size falls back to the whole world with a warning, as
    torchrec's ``get_local_size`` does: every caller (node groups, table-row-wise and grid shardings, the planner's
    topology) reads this function, so all of them see the same single node.
    """
    world_size = _check_optional_int(world_size, "world_size", 1)
    if world_size is None:
        world_size = dist.get_world_size()
    found = _env_int(_LOCAL_SIZE_VARS)
    if found is None:
        return world_size
    name, local_size = found
    if local_size == 0 or world_size % local_size:
        logger.warning(
            "%s=%d does not divide the world size %d; falling back to one node of %d ranks",
            name,
            local_size,
            world_size,
            world_size,
        )
        return world_size
    return local_size


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This rank's index within its node: ``LOCAL_RANK`` (or an MPI equivalent), else ``rank % local_size``."""
    rank = _check_optional_int(rank, "rank", 0)
    local_size = get_local_size(world_size)
    found = _env_int(_LOCAL_RANK_VARS)
    if found is not None and found[1] < local_size:
        return found[1]
    if found is not None:
        logger.warning("%s=%d is not below the local size %d; using rank %% local size", *found, local_size)
    if rank is None:
        rank = dist.get_rank()
    return rank % local_size


def get_group_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This rank's node index (torchrun's ``GROUP_RANK``), in ``[0, get_num_groups())``."""
    rank = _check_optional_int(rank, "rank", 0)
    if rank is None:
        rank = dist.get_rank()
    return rank // get_local_size(world_size)


def get_num_groups(world_size: int | None = None) -> int:
    """Number of nodes (worker groups)."""
    world_size = _check_optional_int(world_size, "world_size", 1)
    if world_size is None:
        world_size = dist.get_world_size()
    return world_size // get_local_size(world_size)


def intra_and_cross_node_pg(
    device: torch.device | None = None, backend: str | None = None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(intra, cross)``: this rank's group of same-node ranks and its group of same-local-rank ranks across nodes.

    Collective: every rank must call it (``new_group`` is collective). The groups are built once per world and
    cached, with the world's timeout (``new_group`` alone would give them torch's default, 30 minutes for gloo). A
    ``meta`` device (shape-only runs) gets ``(None, None)``.
    """
    if device is not None and not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or None, got {device!r}")
    if device is not None and device.type == "meta":
        return None, None
    world = dist.group.WORLD
    prune(_NODE_GROUPS)
    if "node" in _NODE_GROUPS and _NODE_GROUPS["node"][0] is world:
        return _NODE_GROUPS["node"][1], _NODE_GROUPS["node"][2]
    world_size, rank = dist.get_world_size(), dist.get_rank()
    local_size = get_local_size(world_size)
    num_groups = world_size // local_size
    my_node, my_local_rank = rank // local_size, rank % local_size
    backend = backend if backend is not None else dist.get_backend()
    intra = cross = None
    timeout = group_timeout(world)
    for node in range(num_groups):  # every rank creates every group, in the same order
        ranks = [node * local_size + r for r in range(local_size)]
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
        if node == my_node:
            intra = group
    for local_rank in range(local_size):
        group = dist.new_group(
            ranks=[local_rank + node * local_size for node in range(num_groups)], backend=backend, timeout=timeout
        )
        if local_rank == my_local_rank:
            cross = group
    dist.barrier()
    _NODE_GROUPS["node"] = (world, cast(dist.ProcessGroup, intra), cast(dist.ProcessGroup, cross))
    return intra, cross


def is_leader(pg: dist.ProcessGroup | None, leader_rank: int = 0) -> bool:
    """Whether this process is rank ``leader_rank`` of ``pg`` (``None``: a single-process program, rank 0)."""
    leader_rank = check_int(leader_rank, "leader_rank", 0)
    if pg is None:
        return leader_rank == 0
    return pg.rank() == leader_rank


def invoke_on_rank_and_broadcast_result(
    pg: dist.ProcessGroup, rank: int, func: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """Run ``func(*args, **kwargs)`` on group rank ``rank`` only and return its (picklable) result on every rank.

    Example::

        table_id = invoke_on_rank_and_broadcast_result(pg, 0, allocate_id)
    """
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__}")
    rank = check_int(rank, "rank", 0, pg.size() - 1, what=f"an int in [0, {pg.size()}) (the group size)")
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    result = [func(*args, **kwargs) if pg.rank() == rank else None]
    if pg.size() > 1:
        # broadcast_object_list takes a global rank.
        dist.broadcast_object_list(result, src=dist.get_global_rank(pg, rank), group=pg)
    return cast(T, result[0])


def run_on_leader(pg: dist.ProcessGroup, rank: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: the wrapped function runs on group rank ``rank`` and every rank gets its result."""

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> T:
            return invoke_on_rank_and_broadcast_result(pg, rank, func, *args, **kwargs)

        return wrapped

    return decorate


__all__ = [
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_num_groups",
    "intra_and_cross_node_pg",
    "invoke_on_rank_and_broadcast_result",
    "is_leader",
    "run_on_leader",
]
