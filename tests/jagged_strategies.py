"""Hypothesis strategies for jagged inputs shared by the kernel and sparse-type tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def lengths_2d(draw: st.DrawFn, max_keys: int = 4, max_batch: int = 5, max_len: int = 5) -> torch.Tensor:
    """``[T, B]`` bag lengths with T >= 0, B >= 1, empty bags likely."""
    num_keys = draw(st.integers(0, max_keys))
    batch = draw(st.integers(1, max_batch))
    flat = draw(st.lists(st.integers(0, max_len), min_size=num_keys * batch, max_size=num_keys * batch))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(flat, dtype=dtype).reshape(num_keys, batch)


@st.composite
def jagged_values(draw: st.DrawFn, max_batch: int = 6, max_len: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [N] or [N, D], offsets [B + 1])`` with D in {1, 3, 129} or 1-D values; B >= 0."""
    batch = draw(st.integers(0, max_batch))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    offsets = torch.zeros(batch + 1, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    if batch:
        offsets[1:] = torch.tensor(lengths).cumsum(0)
    num_values = int(offsets[-1])
    width = draw(st.sampled_from([None, 1, 3, 129]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    shape = (num_values,) if width is None else (num_values, width)
    return torch.randn(shape, generator=gen), offsets
