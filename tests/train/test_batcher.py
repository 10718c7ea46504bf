"""Batcher: collation into key-major KJTs, padding + valid_mask of the last batch, exact resume, datarax's module
API (statistics, copy, clone, __call__), bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.data.elements import ElementSpec, RecElement
from tritonrec.data.synthetic import SyntheticRecSource

SPEC = ElementSpec(dense_dim=3, sparse_keys=("a", "b"))


def _element(i: int, lengths: tuple[int, int] = (1, 2)) -> RecElement:
    ids = np.arange(sum(lengths), dtype=np.int64) + 100 * i
    return RecElement(np.full(3, float(i), dtype=np.float32), ids, np.asarray(lengths), float(i % 2))


def _bags(element: RecElement) -> list[list[int]]:
    ends = np.cumsum(element.sparse_lengths)
    return [element.sparse_ids[end - n : end].tolist() for n, end in zip(element.sparse_lengths, ends, strict=True)]


def _assert_batch_holds(batch: Batch, elements: list[RecElement]) -> None:
    """Rows 0..n-1 are the elements (every bag of every key exact), the rest is padding."""
    n = len(elements)
    per_key = {key: batch.sparse_features[key].to_dense() for key in SPEC.sparse_keys}
    for row, element in enumerate(elements):
        assert torch.equal(batch.dense_features[row], torch.from_numpy(element.dense))
        assert batch.labels[row].item() == element.label
        assert [per_key[k][row].tolist() for k in SPEC.sparse_keys] == _bags(element)
    assert batch.valid_mask.tolist() == [True] * n + [False] * (batch.batch_size - n)
    assert not batch.dense_features[n:].any() and not batch.labels[n:].any()
    assert all(per_key[k][row].numel() == 0 for k in SPEC.sparse_keys for row in range(n, batch.batch_size))


def test_padded_last_batch_is_masked() -> None:
    elements = [_element(i, (i % 3, 1)) for i in range(10)]
    batches = list(Batcher(SPEC).process(elements, batch_size=4))
    assert [b.batch_size for b in batches] == [4, 4, 4]
    assert [b.num_valid() for b in batches] == [4, 4, 2]
    for k, batch in enumerate(batches):
        _assert_batch_holds(batch, elements[4 * k : 4 * k + 4])
        assert batch.sparse_features.stride() == 4


def test_drop_remainder_drops_the_short_batch() -> None:
    batches = list(Batcher(SPEC).process([_element(i) for i in range(10)], 4, drop_remainder=True))
    assert len(batches) == 2 and all(b.valid_mask.all() for b in batches)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=9), st.integers(1, 5))
def test_collation_is_exact_for_any_bag_lengths(lengths: list[tuple[int, int]], batch_size: int) -> None:
    elements = [_element(i, pair) for i, pair in enumerate(lengths)]
    batches = list(Batcher(SPEC).process(elements, batch_size))
    assert len(batches) == -(-len(elements) // batch_size)
    for k, batch in enumerate(batches):
        _assert_batch_holds(batch, elements[k * batch_size : (k + 1) * batch_size])


def test_batch_spec_matches_the_batches() -> None:
    batcher = Batcher(SPEC)
    spec = batcher.batch_spec(SPEC, 4)
    batch = next(batcher.process([_element(0)], 4))
    assert spec.dense_features.shape == tuple(batch.dense_features.shape)
    assert spec.dense_features.dtype == batch.dense_features.dtype
    assert spec.labels.shape == tuple(batch.labels.shape) and spec.valid_mask.dtype == batch.valid_mask.dtype
    assert spec.sparse_keys == tuple(batch.sparse_features.keys())
    assert spec.sparse_values_dtype == batch.sparse_features.values().dtype
    assert spec.sparse_lengths_dtype == batch.sparse_features.lengths().dtype


def _stream(state: dict[str, object]) -> dict[str, object]:
    """The stream position part of a Batcher state."""
    return {key: state[key] for key in ("epoch", "position", "batches")}


def _same_batch(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.valid_mask, b.valid_mask)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


@pytest.mark.parametrize("kind", ["source", "list"])
def test_resume_from_state_yields_the_identical_next_batches(kind: str) -> None:
    """ElementSource jumps to the position; a plain iterable is replayed and skipped."""
    source = SyntheticRecSource([50, 20], num_dense=3, keys=["a", "b"], num_samples=45, chunk_size=7)
    elements = source if kind == "source" else list(source)
    uninterrupted = list(Batcher(SPEC).process(elements, 6))  # 8 batches, the last padded (3 valid)

    first = Batcher(SPEC)
    stream = first.process(elements, 6)
    for _ in range(3):
        next(stream)
    state = first.get_state()
    assert state == {"epoch": 0, "position": 18, "batches": 3, "computed_statistics": None, "statistics_reset": False}

    resumed = Batcher(SPEC)
    resumed.set_state(state)
    rest = list(resumed.process(elements, 6))
    assert len(rest) == 5 and all(_same_batch(a, b) for a, b in zip(rest, uninterrupted[3:], strict=True))
    assert rest[-1].num_valid() == 3
    assert _stream(resumed.get_state()) == {"epoch": 1, "position": 0, "batches": 0}


def test_state_at_the_end_of_a_pass_resumes_into_the_next_epoch() -> None:
    elements = [_element(i) for i in range(5)]
    batcher = Batcher(SPEC)
    batches = list(batcher.process(elements, 5))
    assert len(batches) == 1 and batcher.get_state()["epoch"] == 1
    restored = Batcher(SPEC)
    restored.set_state({"epoch": 0, "position": 5, "batches": 1})  # taken right after the last batch
    assert list(restored.process(elements, 5)) == []
    assert _stream(restored.get_state()) == {"epoch": 1, "position": 0, "batches": 0}


@pytest.mark.parametrize("batch_size", [0, -2, 2.5, True, "4"])
def test_bad_batch_size(batch_size: object) -> None:
    with pytest.raises(ValueError, match=f"batch_size must be a positive int, got batch_size={batch_size!r}"):
        Batcher(SPEC).process([_element(0)], batch_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        Batcher(SPEC).batch_spec(SPEC, batch_size)  # type: ignore[arg-type]


def test_bad_process_arguments() -> None:
    with pytest.raises(TypeError, match="drop_remainder must be a bool, got drop_remainder=1"):
        Batcher(SPEC).process([_element(0)], 2, drop_remainder=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="elements must be an iterable"):
        Batcher(SPEC).process(5, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="element_spec must be an ElementSpec, got dict"):
        Batcher({"dense_dim": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        ("not an element", TypeError, "element 2 must be a RecElement, got str"),
        (
            RecElement(np.zeros(4, np.float32), np.zeros(3, np.int64), np.array([1, 2]), 0.0),
            ValueError,
            r"element 2 has dense shape \(4,\) and sparse_lengths shape \(2,\); the element spec expects \(3,\)",
        ),
        (
            RecElement(np.zeros(3, np.float32), np.zeros(2, np.int64), np.array([1, 2]), 0.0),
            ValueError,
            r"element 2 has 2 sparse_ids but its sparse_lengths \[1, 2\] sum to 3",
        ),
        (
            RecElement(np.zeros(3, np.float32), np.zeros(3), np.array([1, 2]), 0.0),
            TypeError,
            "element 2 has sparse_ids of dtype float64, not an integer dtype",
        ),
        (
            RecElement(np.zeros(3, np.float32), np.zeros(0, np.int64), np.array([1, -1]), 0.0),
            ValueError,
            r"element 2 has negative sparse_lengths \[1, -1\]",
        ),
    ],
)
def test_bad_element_names_its_index(bad: object, error: type[Exception], pattern: str) -> None:
    elements = [_element(0), _element(1), bad]
    with pytest.raises(error, match=pattern):
        list(Batcher(SPEC).process(elements, 4))


@pytest.mark.parametrize(
    ("state", "error", "pattern"),
    [
        (
            {"epoch": 0, "position": 1},
            ValueError,
            r"must have exactly the keys \['epoch', 'position', 'batches', 'computed_statistics', "
            r"'statistics_reset'\] \(or \['epoch', 'position', 'batches'\], from before the statistics were kept\), "
            r"got \['epoch', 'position'\]",
        ),
        (
            {"epoch": 0, "position": -1, "batches": 0},
            ValueError,
            r"state\['position'\] must be a non-negative int, got .*=-1",
        ),
        (
            {"epoch": 0.5, "position": 0, "batches": 0},
            ValueError,
            r"state\['epoch'\] must be a non-negative int, got .*=0.5 \(a float\)",
        ),
        ([0, 1, 2], TypeError, "state must be a mapping from get_state"),
    ],
)
def test_bad_state(state: object, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        Batcher(SPEC).set_state(state)  # type: ignore[arg-type]


def test_state_past_the_end_of_a_plain_iterable() -> None:
    batcher = Batcher(SPEC)
    batcher.set_state({"epoch": 0, "position": 7, "batches": 1})
    with pytest.raises(ValueError, match="the Batcher state says 7 elements were consumed, but elements holds only 3"):
        list(batcher.process([_element(i) for i in range(3)], 2))


def test_batch_checks_its_parts() -> None:
    kjt = KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([1, 1]))
    dense, labels, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, dtype=torch.bool)
    with pytest.raises(TypeError, match="valid_mask must be a bool tensor, got dtype torch.int64"):
        Batch(dense, kjt, labels, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must share the batch size B = labels.shape\[0\] = 3"):
        Batch(dense, kjt, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="sparse_features has stride 2 but the batch size is 1"):
        Batch(dense[:1], kjt, labels[:1], mask[:1])
    with pytest.raises(TypeError, match="sparse_features must be a KeyedJaggedTensor, got dict"):
        Batch(dense, {}, labels, mask)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dense_features must be a 2-D float tensor \[B, Dd\], got shape \(2,\)"):
        Batch(torch.zeros(2), kjt, labels, mask)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor, got list"):
        Batch(dense, kjt, [0, 1], mask)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ datarax module API: stats, copies
