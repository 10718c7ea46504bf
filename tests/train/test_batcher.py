"""Batcher: collation into key-major KJTs, padding + valid_mask of the last batch, exact resume, datarax's module
API (statistics, copy, clone, __call__), bad input."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher, BatcherConfig
from tritonrec.data.elements import ElementSpec, RecElement
from tritonrec.data.loader import ShardedBatchDataset
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
            r"state\['position'\] must be a non-negative int, got -1",
        ),
        (
            {"epoch": 0.5, "position": 0, "batches": 0},
            ValueError,
            r"state\['epoch'\] must be a non-negative int, got 0.5",
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
def _positive_rate(batch: Batch) -> dict[str, float]:
    return {"positive_rate": float(batch.labels[batch.valid_mask].mean()), "rows": batch.num_valid()}


def test_statistics_compute_get_set_reset() -> None:
    elements = [_element(i) for i in range(6)]
    batcher = Batcher(SPEC, BatcherConfig(batch_stats_fn=_positive_rate))
    assert batcher.get_statistics() is None
    batch = next(batcher(elements, 4))  # __call__ is process
    assert batcher.compute_statistics(batch) == {"positive_rate": 0.5, "rows": 4}
    assert batcher.get_statistics() == {"positive_rate": 0.5, "rows": 4}
    batcher.reset_statistics()
    assert batcher.get_statistics() is None
    batcher.set_statistics({"rows": 9})
    assert batcher.get_statistics() == {"rows": 9}
    assert Batcher(SPEC).compute_statistics(batch) is None  # no batch_stats_fn: nothing to compute

    fixed = Batcher(SPEC, BatcherConfig(precomputed_stats={"mean": 1.5}))
    assert fixed.get_statistics() == {"mean": 1.5}
    fixed.reset_statistics()
    assert fixed.get_statistics() is None  # a reset hides the precomputed statistics too
    fixed.set_statistics({"mean": 2.0})
    assert fixed.get_statistics() == {"mean": 2.0}


def test_copy_and_clone() -> None:
    elements = [_element(i) for i in range(10)]
    batcher = Batcher(SPEC, BatcherConfig(batch_stats_fn=_positive_rate))
    stream = batcher(elements, 4)
    batcher.compute_statistics(next(stream))
    clone = batcher.clone()
    assert clone.get_state() == batcher.get_state()
    assert _stream(batcher.get_state()) == {"epoch": 0, "position": 4, "batches": 1}
    assert clone.get_statistics() == batcher.get_statistics() and clone.config is batcher.config
    assert _same_batch(next(clone(elements, 4)), next(stream))  # the clone continues where the original was
    clone.set_statistics({"other": 1})
    assert batcher.get_statistics() == {"positive_rate": 0.5, "rows": 4}  # independent statistics

    other = BatcherConfig(precomputed_stats={"fixed": 3})
    copied = batcher.copy(config=other)
    assert copied.config is other and copied.get_statistics() == {"fixed": 3}
    assert _stream(copied.get_state()) == _stream(batcher.get_state()) and copied.element_spec == batcher.element_spec
    assert batcher.copy().get_statistics() is None  # computed statistics stay with the original


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: BatcherConfig(batch_stats_fn=5), TypeError, "batch_stats_fn must be callable or None, got int"),
        (lambda: BatcherConfig(precomputed_stats=[1]), TypeError, "precomputed_stats must be a mapping or None"),
        (
            lambda: BatcherConfig(batch_stats_fn=len, precomputed_stats={}),
            ValueError,
            "batch_stats_fn and precomputed_stats are exclusive",
        ),
        (lambda: Batcher(SPEC, config={}), TypeError, "config must be a BatcherConfig or None, got dict"),
        (lambda: Batcher(SPEC).set_statistics([1]), TypeError, "stats must be a mapping, got list"),
        (
            lambda: Batcher(SPEC, BatcherConfig(batch_stats_fn=len)).compute_statistics([1, 2]),
            TypeError,
            "batch_stats_fn must return a mapping, got int",
        ),
    ],
)
def test_statistics_bad_input(make: Callable[[], object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        make()


def test_clone_owns_its_precomputed_statistics() -> None:
    """The clone shared the config's precomputed statistics: an in-place change to a clone's tensor changed the
    original's."""
    original = Batcher(SPEC, BatcherConfig(precomputed_stats={"mean": torch.zeros(2)}))
    clone = original.clone()
    clone.get_statistics()["mean"].add_(5)
    assert original.get_statistics()["mean"].tolist() == [0.0, 0.0]
    assert clone.get_statistics()["mean"].tolist() == [5.0, 5.0]


def test_set_statistics_keeps_the_config() -> None:
    """set_statistics replaced the config by one without its precomputed statistics, so copy() (same config) lost
    them."""
    config = BatcherConfig(precomputed_stats={"mean": 1.5})
    batcher = Batcher(SPEC, config)
    batcher.set_statistics({"mean": 2.0})
    assert batcher.config is config and batcher.get_statistics() == {"mean": 2.0}
    assert batcher.copy().get_statistics() == {"mean": 1.5}  # set statistics stay behind, the config's come along
    assert batcher.clone().get_statistics() == {"mean": 2.0}
    batcher.reset_statistics()
    assert batcher.get_statistics() is None and batcher.clone().get_statistics() is None


# ------------------------------------------------------------------ statistics in get_state / set_state (datarax)
def _round_trips(state: dict[str, object]) -> list[dict[str, object]]:
    """``state`` itself, through torch.save / torch.load(weights_only=True) (the training checkpoint) and, when the
    statistics hold no tensor, through JSON."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    copies = [state, torch.load(buffer, weights_only=True)]
    stats = state["computed_statistics"]
    if not any(isinstance(v, torch.Tensor) for v in (stats or {}).values()):  # type: ignore[union-attr]
        copies.append(json.loads(json.dumps(state)))
    return copies


def test_state_round_trips_computed_statistics() -> None:
    """get_state() held only the stream position: a resumed Batcher had lost its computed statistics."""
    config = BatcherConfig(batch_stats_fn=_positive_rate)
    batcher = Batcher(SPEC, config)
    batcher.compute_statistics(next(batcher([_element(i) for i in range(6)], 4)))
    state = batcher.get_state()
    assert state["computed_statistics"] == {"positive_rate": 0.5, "rows": 4} and state["statistics_reset"] is False
    for saved in _round_trips(state):
        restored = Batcher(SPEC, config)
        restored.set_state(saved)
        assert restored.get_statistics() == {"positive_rate": 0.5, "rows": 4} and restored.get_state() == state


def test_state_round_trips_set_statistics_over_precomputed_ones() -> None:
    """Set statistics come back; the config's precomputed ones are not in the state and never change."""
    config = BatcherConfig(precomputed_stats={"mean": 1.5})
    batcher = Batcher(SPEC, config)
    assert batcher.get_state()["computed_statistics"] is None  # the precomputed statistics stay in the config
    fresh_state = batcher.get_state()
    batcher.set_statistics({"mean": torch.tensor([2.0, 3.0])})
    for saved in _round_trips(batcher.get_state()):
        restored = Batcher(SPEC, config)
        restored.set_state(saved)
        assert restored.get_statistics()["mean"].tolist() == [2.0, 3.0]
        restored.set_state(fresh_state)  # no set statistics: the config's show again
        assert restored.get_statistics() == {"mean": 1.5}
    assert config.precomputed_stats == {"mean": 1.5}


def test_state_round_trips_a_reset() -> None:
    config = BatcherConfig(precomputed_stats={"mean": 1.5})
    batcher = Batcher(SPEC, config)
    batcher.reset_statistics()
    state = batcher.get_state()
    assert state["computed_statistics"] is None and state["statistics_reset"] is True
    for saved in _round_trips(state):
        restored = Batcher(SPEC, config)
        restored.set_statistics({"mean": 9.0})
        restored.set_state(saved)
        assert restored.get_statistics() is None and restored.get_state() == state  # precomputed ones hidden too
        assert restored.config.precomputed_stats == {"mean": 1.5}


def test_state_from_before_the_statistics_keeps_them() -> None:
    """A three-key state (saved before the statistics were kept) moves the stream and leaves the statistics."""
    batcher = Batcher(SPEC)
    batcher.set_statistics({"rows": 9})
    batcher.set_state({"epoch": 2, "position": 4, "batches": 1})
    assert batcher.get_state() == {
        "epoch": 2, "position": 4, "batches": 1, "computed_statistics": {"rows": 9}, "statistics_reset": False,
    }  # fmt: skip
    batcher.reset_statistics()
    batcher.set_state({"epoch": 0, "position": 0, "batches": 0})
    assert batcher.get_statistics() is None and batcher.get_state()["statistics_reset"] is True


def test_state_does_not_alias_the_live_statistics() -> None:
    batcher = Batcher(SPEC, BatcherConfig(batch_stats_fn=lambda data: {"mean": torch.zeros(2), "seen": [data]}))
    batcher.compute_statistics(1)
    state = batcher.get_state()
    state["computed_statistics"]["mean"].add_(5)  # type: ignore[index]
    state["computed_statistics"]["seen"].append(2)  # type: ignore[index]
    assert batcher.get_statistics()["mean"].tolist() == [0.0, 0.0] and batcher.get_statistics()["seen"] == [1]
    batcher.compute_statistics(7)  # a later compute leaves the returned state alone
    assert state["computed_statistics"]["seen"] == [1, 2]  # type: ignore[index]

    restored = Batcher(SPEC)
    restored.set_state(state)
    state["computed_statistics"]["mean"].add_(1)  # type: ignore[index]
    state["computed_statistics"]["seen"].clear()  # type: ignore[index]
    assert restored.get_statistics()["mean"].tolist() == [5.0, 5.0] and restored.get_statistics()["seen"] == [1, 2]


_GOOD = {"epoch": 0, "position": 0, "batches": 0, "computed_statistics": None, "statistics_reset": False}


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        (
            {"computed_statistics": [1]},
            TypeError,
            r"state\['computed_statistics'\] must be a mapping or None, got \[1\]",
        ),
        ({"computed_statistics": 0.5}, TypeError, r"state\['computed_statistics'\] must be a mapping or None, got 0.5"),
        ({"statistics_reset": None}, TypeError, r"state\['statistics_reset'\] must be a bool, got None"),
        ({"statistics_reset": 1}, TypeError, r"state\['statistics_reset'\] must be a bool, got 1"),
        (
            {"computed_statistics": {"a": 1}, "statistics_reset": True},
            ValueError,
            r"state\['statistics_reset'\] is True but state\['computed_statistics'\] is \{'a': 1\}, not None",
        ),
    ],
)
def test_bad_statistics_in_state(change: dict[str, object], error: type[Exception], pattern: str) -> None:
    batcher = Batcher(SPEC)
    batcher.set_statistics({"rows": 3})
    before = batcher.get_state()
    with pytest.raises(error, match=pattern):
        batcher.set_state({**_GOOD, "position": 8, **change})
    assert batcher.get_state() == before  # a refused state changes nothing
    incomplete = {k: v for k, v in _GOOD.items() if k != "statistics_reset"}
    with pytest.raises(ValueError, match=r"got \['batches', 'computed_statistics', 'epoch', 'position'\]"):
        batcher.set_state(incomplete)


def test_loader_state_round_trips_the_statistics() -> None:
    """ShardedBatchDataset nests the Batcher state in its state_dict (what StatefulDataLoader snapshots)."""
    source = SyntheticRecSource([50, 20], num_dense=3, keys=["a", "b"], num_samples=12, chunk_size=4)
    dataset = ShardedBatchDataset(source, 4)
    dataset.batcher.set_statistics({"rows": 3})
    restored = ShardedBatchDataset(source, 4)
    restored.load_state_dict(dataset.state_dict())
    assert restored.batcher.get_statistics() == {"rows": 3}
    restored.load_state_dict({"batcher": {"epoch": 1, "position": 4, "batches": 1}})  # a state from before
    assert restored.batcher.get_statistics() == {"rows": 3} and restored.batcher.get_state()["position"] == 4
