"""Expanding runs: ``values[i]`` repeated ``counts[i]`` times, fast on every device for every run shape.

``torch.repeat_interleave`` on CUDA gives each run one thread, which then writes its whole run alone: fine for many
short runs (a value per bag), slow for a few long ones (a value per feature or per table over millions of values:
on an H200, the backward's two such calls for 32 runs over 5.2M values took ~0.75 ms of its ~7.5 ms of GPU time).
Few long runs are expanded instead by a binary search of every output position in the runs' ends, one position per
thread (coalesced writes): the backward then took ~0.45 ms less.
"""

from __future__ import annotations

import torch

# Mean run length from which CUDA expands by search instead of torch.repeat_interleave.
LONG_RUN = 64


def repeat_runs(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``[R]`` values, ``[R]`` non-negative counts summing to ``total`` (a host int: no device read) -> ``[total]``,
    the same as ``torch.repeat_interleave(values, counts, output_size=total)``."""
    if values.is_cuda and total >= LONG_RUN * max(counts.numel(), 1):
        return repeat_runs_by_search(values, counts, total)
    return torch.repeat_interleave(values, counts, output_size=total)


def repeat_runs_by_search(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """:func:`repeat_runs` on any device by search: output position ``p`` takes the value of the first run whose
    inclusive end exceeds ``p`` (empty runs share their end with the run before and are skipped)."""
    if values.dim() != 1 or counts.shape != values.shape:
        raise ValueError(f"values and counts must be 1-D of one length, got {tuple(values.shape)} and "
                         f"{tuple(counts.shape)}")  # fmt: skip
    ends = torch.cumsum(counts, dim=0, dtype=torch.int64)
    positions = torch.arange(total, dtype=torch.int64, device=values.device)
    run = torch.searchsorted(ends, positions, right=True)
    return values.index_select(0, run)
