"""repeat_runs: both of its paths equal torch.repeat_interleave (the search path is CUDA's for few long runs and is
tested here on CPU), including empty runs, no runs and int32 counts."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels.runs import LONG_RUN, repeat_runs, repeat_runs_by_search


@pytest.mark.parametrize(
    "counts",
    [
        [3],
        [0, 2, 0, 0, 5, 1, 0],
        [0, 0, 0],
        [],
        [1] * 17,
        [LONG_RUN * 3, 0, LONG_RUN, 7],
    ],
)
@pytest.mark.parametrize("count_dtype", [torch.int64, torch.int32])
def test_both_paths_equal_repeat_interleave(counts: list[int], count_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(counts))
    values = torch.randint(-(2**40), 2**40, (len(counts),), generator=g)
    counts_t = torch.tensor(counts, dtype=count_dtype)
    total = sum(counts)
    expected = torch.repeat_interleave(values, counts_t.long())
    for got in (repeat_runs(values, counts_t, total), repeat_runs_by_search(values, counts_t, total)):
        assert got.dtype == values.dtype and torch.equal(got, expected)


def test_random_runs_with_float_values() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        counts[torch.rand(counts.shape, generator=g) < 0.3] = 0
        values = torch.randn(counts.numel(), generator=g)
        got = repeat_runs_by_search(values, counts, int(counts.sum()))
        assert torch.equal(got, torch.repeat_interleave(values, counts))


def test_search_path_names_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"values and counts must be 1-D of one length, got \(3,\) and \(2,\)"):
        repeat_runs_by_search(torch.zeros(3), torch.ones(2, dtype=torch.int64), 2)
