"""Checks of ``block_bucketize_sparse_features``'s per-feature row boundaries (``block_bucketize_pos``): the metadata
check that also stacks them into the ``[T, num_buckets + 1]`` int64 tensor the op and its kernels take, and the value
check that names the first offending feature and entry."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tritonrec.kernels.checks import check_tensor


def boundaries_tensor(
    block_bucketize_pos: Sequence[torch.Tensor] | torch.Tensor | None,
    num_features: int,
    num_buckets: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``T`` 1-D integer tensors of ``num_buckets + 1`` entries, or one ``[T, num_buckets + 1]`` integer tensor, on
    ``device`` -> ``[T, num_buckets + 1]`` int64 (``None`` stays ``None``). Raises ``TypeError`` / ``ValueError``
    naming ``block_bucketize_pos`` and the offending entry."""
    if block_bucketize_pos is None:
        return None
    width = num_buckets + 1
    if isinstance(block_bucketize_pos, torch.Tensor):
        bounds = check_tensor(block_bucketize_pos, "block_bucketize_pos", ndim=2, integer=True)
        if tuple(bounds.shape) != (num_features, width):
            raise ValueError(
                f"block_bucketize_pos must have shape [T={num_features}, num_buckets + 1={width}] (one row of "
                f"boundaries per feature), got shape {tuple(bounds.shape)}"
            )
        rows = [bounds]
    else:
        if not isinstance(block_bucketize_pos, Sequence) or isinstance(block_bucketize_pos, str):
            raise TypeError(
                f"block_bucketize_pos must be a list of tensors or a tensor, got {type(block_bucketize_pos).__name__}"
            )
        if len(block_bucketize_pos) != num_features:
            raise ValueError(
                f"block_bucketize_pos must hold one tensor per feature ({num_features}, the entries of "
                f"block_sizes), got {len(block_bucketize_pos)}"
            )
        rows = []
        for t, row in enumerate(block_bucketize_pos):
            check_tensor(row, f"block_bucketize_pos[{t}]", ndim=1, integer=True)
            if row.numel() != width:
                raise ValueError(
                    f"block_bucketize_pos[{t}] must hold num_buckets + 1 = {width} boundaries, got {row.numel()}: "
                    f"{row.tolist()}"
                )
            rows.append(row.view(1, width))
    for t, row in enumerate(rows):
        if row.device != device:
            name = (
                "block_bucketize_pos" if isinstance(block_bucketize_pos, torch.Tensor) else f"block_bucketize_pos[{t}]"
            )
            raise ValueError(f"{name} must be on {device} like lengths, got {row.device}")
    if not rows:
        return torch.empty((0, width), dtype=torch.int64, device=device)
    return torch.cat([row.to(torch.int64) for row in rows]).contiguous()


def check_boundaries_values(bounds: torch.Tensor) -> None:
    """``bounds [T, num_buckets + 1]``: every row starts at 0 and never decreases; ``ValueError`` naming the first
    row that does not (reads the tensor: a host sync on a GPU)."""
    starts = bounds[:, 0].tolist()
    drops = (bounds.diff(dim=1) < 0).any(dim=1).tolist()
    for t, (start, drop) in enumerate(zip(starts, drops, strict=True)):
        if start != 0 or drop:
            what = "start at 0" if start != 0 else "be non-decreasing"
            raise ValueError(f"block_bucketize_pos[{t}] must {what} (row boundaries), got {bounds[t].tolist()}")


__all__ = ["boundaries_tensor", "check_boundaries_values"]
