"""``BatchedDataDict.all_gather``: concatenate every rank's rows, in rank order, when ranks hold different numbers.

One object all-gather exchanges each rank's keys and shapes first, so mismatches fail on every rank with a clear
message instead of hanging in a tensor collective. Tensors are padded along dim 0 to the largest rank's rows,
gathered, and trimmed (works on gloo and NCCL; NCCL needs the tensors on the rank's GPU). Lists travel as objects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _describe(value: Any, key: str) -> tuple:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"all_gather needs a batch dimension, got a 0-d tensor for key {key!r}")
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, list):
        return ("list", len(value))
    raise TypeError(f"all_gather handles tensors and lists, got {type(value).__name__} for key {key!r}")


def _gather_tensor(tensor: torch.Tensor, rows_per_rank: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    widest = max(rows_per_rank)
    padded = tensor
    if tensor.shape[0] < widest:
        padded = torch.cat([tensor, tensor.new_zeros((widest - tensor.shape[0], *tensor.shape[1:]))])
    pieces = [torch.empty_like(padded) for _ in rows_per_rank]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:rows] for piece, rows in zip(pieces, rows_per_rank, strict=True)])


def all_gather_data(data: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """``{key: rows of rank 0, then rank 1, ...}`` for every key (the same keys on every rank)."""
    described = {key: _describe(value, key) for key, value in data.items()}
    everyone: list[dict[str, tuple]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, described, group=group)
    keys = sorted(described)
    for rank, theirs in enumerate(everyone):
        if sorted(theirs) != keys:
            raise ValueError(
                f"all_gather needs the same keys on every rank: this rank has {keys}, rank {rank} has {sorted(theirs)}"
            )
    gathered: dict[str, Any] = {}
    for key in keys:
        kinds = {theirs[key][0] for theirs in everyone}
        if len(kinds) > 1:
            raise TypeError(f"key {key!r} is a tensor on some ranks and a list on others")
        value = data[key]
        if isinstance(value, torch.Tensor):
            layouts = {(shape[1:], dtype) for _, shape, dtype in (theirs[key] for theirs in everyone)}
            if len(layouts) > 1:
                raise ValueError(
                    f"key {key!r} needs the same trailing shape and dtype on every rank, got {sorted(layouts)}"
                )
            rows = [theirs[key][1][0] for theirs in everyone]
            gathered[key] = _gather_tensor(value, rows, group)
        else:
            lists: list[list[Any]] = [[] for _ in everyone]
            dist.all_gather_object(lists, value, group=group)
            gathered[key] = [item for part in lists for item in part]
    return gathered
