"""AUROC in torch against the pairwise definition (ties, weights), the streaming window, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.dist.train.metrics import AUROCMetric, auroc


def _pairwise_auroc(scores: list[float], labels: list[int], weights: list[float]) -> float:
    """The definition: P(score of a positive > score of a negative), ties one half, pairs weighted."""
    num, den = 0.0, 0.0
    for s_p, y_p, w_p in zip(scores, labels, weights, strict=True):
        for s_n, y_n, w_n in zip(scores, labels, weights, strict=True):
            if y_p == 1 and y_n == 0:
                den += w_p * w_n
                num += w_p * w_n * (1.0 if s_p > s_n else 0.5 if s_p == s_n else 0.0)
    return num / den if den else math.nan


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 1), st.sampled_from([0.0, 0.5, 1.0, 3.0])), max_size=30))
def test_matches_the_pairwise_definition(rows: list[tuple[int, int, float]]) -> None:
    scores = [float(s) for s, _, _ in rows]  # few distinct values: many ties
    labels = [y for _, y, _ in rows]
    weights = [w for _, _, w in rows]
    expected = _pairwise_auroc(scores, labels, weights)
    got = auroc(torch.tensor(scores), torch.tensor(labels), torch.tensor(weights))
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(expected, abs=1e-12)


def test_reference_points() -> None:
    labels = torch.tensor([0, 0, 1, 1])
    assert auroc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auroc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auroc(torch.zeros(4), labels) == 0.5
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), labels) == 0.75
    assert math.isnan(auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


def test_zero_weight_rows_drop_out() -> None:
    scores, labels = torch.randn(50), torch.randint(0, 2, (50,))
    mask = torch.rand(50) < 0.6
    assert auroc(scores, labels, mask) == pytest.approx(auroc(scores[mask], labels[mask]), abs=1e-12)


def test_streaming_window_and_state() -> None:
    scores, labels = torch.randn(40), torch.randint(0, 2, (40,))
    metric = AUROCMetric(window=15)
    for part in range(4):
        metric.update(scores[10 * part : 10 * part + 10], labels[10 * part : 10 * part + 10])
    assert metric.compute() == pytest.approx(auroc(scores[-15:], labels[-15:]), abs=1e-12)
    restored = AUROCMetric(window=15)
    restored.load_state_dict(metric.state_dict())
    assert restored.compute() == metric.compute()
    everything = AUROCMetric()
    everything.update(scores, labels)
    assert everything.compute() == pytest.approx(auroc(scores, labels), abs=1e-12)
    everything.reset()
    assert math.isnan(everything.compute())


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((torch.zeros(3), torch.tensor([0, 2, 1])), ValueError, r"labels must be 0 or 1, got labels\[1\] = 2"),
        ((torch.zeros(3), torch.zeros(4)), ValueError, r"labels must match scores' shape \(3,\), got \(4,\)"),
        ((torch.zeros(3, 1), torch.zeros(3)), ValueError, r"scores must be 1-D \[N\], got shape \(3, 1\)"),
        (([0.1, 0.2], torch.zeros(2)), TypeError, "scores must be a torch.Tensor, got list"),
        ((torch.tensor([1, 2]), torch.zeros(2)), TypeError, "scores must be a float tensor, got dtype torch.int64"),
        ((torch.tensor([0.1, math.nan]), torch.zeros(2)), ValueError, r"must not be NaN, got NaN at scores\[1\]"),
        ((torch.zeros(2), torch.zeros(2), -torch.ones(2)), ValueError, r"non-negative, got weights\[0\] = -1.0"),
        # NaN / infinite weights made the AUROC NaN silently: refused at the first bad position, as NaN scores are
        (
            (torch.zeros(3), torch.zeros(3), torch.tensor([1.0, 1.0, math.nan])),
            ValueError,
            r"weights must be finite and non-negative, got weights\[2\] = nan",
        ),
        (
            (torch.zeros(3), torch.zeros(3), torch.tensor([1.0, math.inf, math.nan])),
            ValueError,
            r"weights must be finite and non-negative, got weights\[1\] = inf",
        ),
        ((torch.zeros(2), torch.zeros(2), torch.tensor([-math.inf, 1.0])), ValueError, r"got weights\[0\] = -inf"),
        (
            (torch.zeros(3), torch.zeros(3), torch.tensor([0.5, math.nan, -1.0], dtype=torch.float16)),
            ValueError,
            r"got weights\[1\] = nan",
        ),
        ((torch.zeros(2), torch.zeros(2), torch.ones(3)), ValueError, r"weights must match scores' shape \(2,\)"),
    ],
)
def test_bad_input(args: tuple, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        auroc(*args)
    with pytest.raises(error, match=pattern):
        AUROCMetric().update(*args)


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="window must be a positive int or None, got window=0"):
        AUROCMetric(window=0)
