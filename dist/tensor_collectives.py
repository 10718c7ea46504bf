"""The tensor collectives under the names this torch prefers.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and the old names emit a ``FutureWarning`` on every call; older torch has only the old
names. Every module calls them through these two functions instead of repeating the lookup (one module that forgot
it warned on every data-parallel step). The name is looked up on ``torch.distributed`` at each call, not bound at
import, so a tool that wraps ``torch.distributed``'s functions (the benchmarks' wire counter, a tracer) sees ours.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``output [W * n] <- every rank's input [n]`` in rank order (``all_gather_single``, or
    ``all_gather_into_tensor`` on torch without it). Returns the work handle when ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``output [n] <- the sum over ranks of their input [W * n]``'s slice for this rank (``reduce_scatter_single``,
    or ``reduce_scatter_tensor`` on torch without it). Returns the work handle when ``async_op``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


__all__ = ["all_gather_tensor", "reduce_scatter_tensor"]
