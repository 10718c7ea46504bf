"""``merge_spans`` / ``spans_out_of_range`` (the bounds checks' span reductions) against a plain per-value loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from tritonrec.kernels.checks import merge_spans, spans_out_of_range


def test_merge_spans_joins_adjacent_runs_of_equal_rows_only() -> None:
    spans = [(0, 3, 10), (3, 3, 10), (3, 5, 10), (5, 9, 7), (10, 12, 7), (12, 14, 7)]
    assert merge_spans(spans) == [(0, 5, 10), (5, 9, 7), (10, 14, 7)]
    assert merge_spans([]) == []
    assert merge_spans([(4, 4, 1)]) == []


@pytest.mark.parametrize("seed", range(6))
def test_spans_out_of_range_matches_a_per_value_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-2, 12, (40,), generator=g)
    cuts = sorted(torch.randint(0, 41, (5,), generator=g).tolist())
    bounds = [0, *cuts, 40]
    spans = [(a, b, int(torch.randint(1, 14, (1,), generator=g))) for a, b in itertools.pairwise(bounds)]
    live = [s for s in spans if s[1] > s[0]]
    expected = [k for k, (a, b, rows) in enumerate(live) if any(not 0 <= int(v) < rows for v in values[a:b])]
    assert spans_out_of_range(values, spans) == expected
    assert spans_out_of_range(values.to(torch.int32), spans) == expected


def test_spans_out_of_range_all_in_range_and_empty() -> None:
    values = torch.tensor([0, 4, 2, 9])
    assert spans_out_of_range(values, [(0, 2, 5), (2, 4, 10)]) == []
    assert spans_out_of_range(values, [(0, 2, 4), (2, 4, 9)]) == [0, 1]
    assert spans_out_of_range(values, [(1, 1, 1)]) == []
