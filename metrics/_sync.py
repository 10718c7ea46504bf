"""Reducing metric states across ranks, as torchmetrics does for torchrec: "sum" states are added over the ranks,
"cat" states (AUC's kept samples) are concatenated in rank order along the sample dimension.

The states of one computation are packed so a compute costs one all-reduce per dtype plus, for "cat" states, one
all-gather of the lengths and one of the padded samples (ranks hold different sample counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_world_size(process_group: dist.ProcessGroup | None) -> int:
    """Ranks in ``process_group`` (the default group when None); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def all_reduce_sums(
    states: dict[str, torch.Tensor], process_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """``{name: sum over ranks of states[name]}``; the local tensors are left untouched."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in states.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    reduced: dict[str, torch.Tensor] = {}
    for names in by_dtype.values():
        flat = torch.cat([states[name].reshape(-1) for name in names])  # a copy: the local states stay local
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        offset = 0
        for name in names:
            numel = states[name].numel()
            reduced[name] = flat[offset : offset + numel].view_as(states[name])
            offset += numel
    return reduced


def all_gather_cat(states: dict[str, torch.Tensor], process_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """``states``: {name: [rows, n_local]}, all with the same n_local and dtype. Returns {name: [rows, sum over ranks
    of n_local]}, the ranks' samples in rank order."""
    names = list(states)
    packed = torch.cat([states[name] for name in names], dim=0)  # [sum(rows), n_local]
    world = dist.get_world_size(process_group)
    length = torch.tensor([packed.shape[-1]], dtype=torch.int64, device=packed.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=process_group)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(packed.shape[0], max(sizes), dtype=packed.dtype, device=packed.device)
    padded[:, : packed.shape[-1]] = packed
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=process_group)
    union = torch.cat([part[:, :size] for part, size in zip(gathered, sizes, strict=True)], dim=-1)
    out: dict[str, torch.Tensor] = {}
    row = 0
    for name in names:
        rows = states[name].shape[0]
        out[name] = union[row : row + rows]
        row += rows
    return out
