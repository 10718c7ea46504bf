"""Synthetic source: seeded and seekable, Zipf ids in range, pooling distributions, learnable labels, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tritonrec.data.elements import RecElement
from tritonrec.data.synthetic import SyntheticRecSource
from tritonrec.dist.train.metrics import auroc


def _same(a: RecElement, b: RecElement) -> bool:
    return (
        np.array_equal(a.dense, b.dense)
        and np.array_equal(a.sparse_ids, b.sparse_ids)
        and np.array_equal(a.sparse_lengths, b.sparse_lengths)
        and a.label == b.label
    )


def test_seeded_and_seekable_across_chunks() -> None:
    source = SyntheticRecSource([30, 40, 5], num_dense=2, num_samples=23, chunk_size=5)
    everything = list(source)
    assert len(everything) == 23 == len(source)
    again = list(SyntheticRecSource([30, 40, 5], num_dense=2, num_samples=23, chunk_size=5))
    assert all(_same(a, b) for a, b in zip(everything, again, strict=True))
    for position in (0, 4, 5, 11, 22, 23):
        tail = list(source.iter_from(position))
        assert len(tail) == 23 - position
        assert all(_same(a, b) for a, b in zip(tail, everything[position:], strict=True))
    other_stream = list(SyntheticRecSource([30, 40, 5], num_dense=2, num_samples=23, chunk_size=5, stream=1))
    assert not all(_same(a, b) for a, b in zip(everything, other_stream, strict=True))


def test_a_short_stream_is_a_prefix_of_a_longer_one() -> None:
    short = list(SyntheticRecSource([10], num_samples=7, chunk_size=4))
    long = list(SyntheticRecSource([10], num_samples=9, chunk_size=4))
    assert all(_same(a, b) for a, b in zip(short, long[:7], strict=True))


def _draw(source: SyntheticRecSource, n: int) -> tuple[np.ndarray, np.ndarray]:
    _, ids, lengths, _, _ = source.generate_chunk(0, n)
    return ids, lengths


def test_ids_follow_a_bounded_zipf_law() -> None:
    rows, alpha = 50, 1.2
    source = SyntheticRecSource([rows], num_dense=1, zipf_alpha=alpha, pooling="fixed", chunk_size=40_000)
    ids, _ = _draw(source, 40_000)
    assert ids.min() >= 0 and ids.max() < rows
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1] / ids.size
    expected = np.arange(1, rows + 1) ** -alpha
    expected /= expected.sum()
    np.testing.assert_allclose(counts[:5], expected[:5], rtol=0.05)  # the hot ranks, within sampling noise


@pytest.mark.parametrize(
    ("pooling", "factor", "low", "high", "mean"),
    [("fixed", 3.0, 3, 3, 3.0), ("poisson", 2.0, 0, 8, 2.0), ("uniform", 1.0, 1, 5, 3.0)],
)
def test_pooling_distributions(pooling: str, factor: float, low: int, high: int, mean: float) -> None:
    source = SyntheticRecSource(
        [100, 100], pooling=pooling, pooling_factor=factor, min_pooling=low if pooling != "fixed" else 0,
        max_pooling=high, chunk_size=20_000,
    )  # fmt: skip
    ids, lengths = _draw(source, 20_000)
    assert lengths.min() >= low and lengths.max() <= high
    assert lengths.mean() == pytest.approx(mean, rel=0.03)
    assert ids.size == lengths.sum()


def test_per_feature_pooling_factors() -> None:
    source = SyntheticRecSource([10, 10], pooling="fixed", pooling_factor=[1, 4], chunk_size=8)
    _, lengths = _draw(source, 8)
    assert lengths[:, 0].tolist() == [1] * 8 and lengths[:, 1].tolist() == [4] * 8


def test_labels_carry_signal_from_ids_and_dense_features() -> None:
    """The hidden model's own logit ranks the labels well, so the task is learnable (and not trivially so)."""
    source = SyntheticRecSource([200] * 4, num_dense=3, pooling="fixed", chunk_size=8192)
    dense, ids, _, _, labels = source.generate_chunk(0, 8192)
    logit = source._bias + dense @ source._dense_weights
    per_feature = ids.reshape(8192, 4)  # fixed pooling 1: one id per feature, sample-major
    for f in range(4):
        logit = logit + source._id_weights[f][per_feature[:, f]]
    score = auroc(torch.from_numpy(logit.astype(np.float64)), torch.from_numpy(labels))
    assert 0.75 < score < 0.95
    assert 0.2 < labels.mean() < 0.45


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"num_embeddings": []}, ValueError, r"num_embeddings must be a non-empty list of positive ints, got \[\]"),
        ({"num_embeddings": [10, 0]}, ValueError, r"num_embeddings\[i\] must be a positive int, got .*=0"),
        ({"keys": ["a"]}, ValueError, r"keys must name the 2 sparse features, got keys=\['a'\]"),
        ({"num_dense": -1}, ValueError, "num_dense must be a non-negative int, got num_dense=-1"),
        ({"zipf_alpha": 0}, ValueError, "zipf_alpha must be a positive number, got zipf_alpha=0"),
        ({"pooling": "zipf"}, ValueError, "pooling must be one of .* got pooling='zipf'"),
        ({"min_pooling": 3, "max_pooling": 2}, ValueError, r"max_pooling \(2\) must be >= min_pooling \(3\)"),
        ({"pooling": "fixed", "pooling_factor": 1.5}, ValueError, "pooling='fixed' needs integer pooling_factor"),
        ({"pooling_factor": [1.0]}, ValueError, r"pooling_factor must be one number or one per sparse feature \(2\)"),
        ({"pooling_factor": -1.0}, ValueError, "pooling_factor entries must be non-negative finite numbers"),
        ({"num_samples": -5}, ValueError, "num_samples must be a non-negative int or None, got num_samples=-5"),
        ({"seed": -1}, ValueError, "seed must be a non-negative int, got seed=-1"),
        ({"dense_share": 1.5}, ValueError, r"dense_share must be in \[0, 1\], got dense_share=1.5"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int, got chunk_size=0"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        SyntheticRecSource(**{"num_embeddings": [10, 10], **kwargs})


def test_bad_positions() -> None:
    source = SyntheticRecSource([10], num_samples=4)
    with pytest.raises(ValueError, match=r"position=5 is past the end of the stream \(4 samples\)"):
        source.iter_from(5)
    with pytest.raises(ValueError, match="position must be a non-negative int, got position=-1"):
        source.iter_from(-1)
    with pytest.raises(TypeError, match="streams forever"):
        len(SyntheticRecSource([10]))
