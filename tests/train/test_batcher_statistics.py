"""The datarax Batcher's statistics: compute / get / set / reset, copy and clone, and their place in the state
(``computed_statistics``, ``statistics_reset``) through torch.save, JSON and a loader's state dict."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import pytest
import torch

from tests.train.test_batcher import SPEC, _element, _same_batch, _stream
from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher, BatcherConfig
from tritonrec.data.loader import ShardedBatchDataset
from tritonrec.data.synthetic import SyntheticRecSource


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
    clone.config.precomputed_stats["mean"].add_(5)  # type: ignore[index]
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


def test_statistics_handed_out_do_not_alias_the_kept_ones() -> None:
    """What compute / get / set hand over or take is the caller's: changing it in place leaves the Batcher's own
    statistics (and the config's precomputed ones) as they were."""
    stats = {"mean": torch.tensor([1.0, 2.0]), "counts": [1, 2]}
    batcher = Batcher(SPEC, BatcherConfig(batch_stats_fn=lambda _: stats))
    returned = batcher.compute_statistics(None)
    returned["counts"].append(3)
    stats["mean"] += 1
    got = batcher.get_statistics()
    got["mean"] += 10
    got["counts"].append(4)
    again = batcher.get_statistics()
    assert again["counts"] == [1, 2] and again["mean"].tolist() == [1.0, 2.0]
    mine = {"mean": torch.zeros(2)}
    batcher.set_statistics(mine)
    mine["mean"] += 5
    assert batcher.get_statistics()["mean"].tolist() == [0.0, 0.0]
    fixed = Batcher(SPEC, BatcherConfig(precomputed_stats={"mean": [1.5]}))
    fixed.get_statistics()["mean"].append(9.0)
    assert fixed.get_statistics() == {"mean": [1.5]} and fixed.config.precomputed_stats == {"mean": [1.5]}


def test_statistics_that_cannot_be_deep_copied_are_still_kept() -> None:
    """A non-leaf autograd tensor or a generator refuses deepcopy: such a value is shared, as before the copies."""
    weight = torch.ones(2, requires_grad=True)
    stats = {"scaled": weight * 2, "gen": (i for i in range(3)), "mean": [1.0]}
    batcher = Batcher(SPEC, BatcherConfig(batch_stats_fn=lambda _: stats))
    batcher.compute_statistics(None)
    got = batcher.get_statistics()
    assert got["scaled"] is stats["scaled"] and got["gen"] is stats["gen"] and got["mean"] == [1.0]
    got["mean"].append(2.0)
    assert batcher.get_statistics()["mean"] == [1.0]
    batcher.set_statistics({"scaled": weight * 3})
    assert torch.equal(batcher.get_statistics()["scaled"], weight.detach() * 3)
