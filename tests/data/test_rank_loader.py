"""Parallel loading in one process (the gloo-rank versions are in tests/distributed/test_multihost_loader.py):
ShardedBatchDataset under torchdata's StatefulDataLoader with 0 and 2 workers (workers split the shard, exact
resume mid-epoch and across epochs), and MultiHostDataLoadIterator's single-process semantics (epochs, reset, kept
batches, state round trip with stateful and plain loaders, bad input)."""

from __future__ import annotations

import io
import itertools
from collections import Counter, OrderedDict, defaultdict, namedtuple

import pytest
import torch

from tritonrec.data.batch import Batch
from tritonrec.data.loader import ShardedBatchDataset, make_rank_loader
from tritonrec.data.multihost import MultiHostDataLoadIterator, dense_shapes, pad_batch
from tritonrec.data.synthetic import SyntheticRecSource


def _source(**kwargs: object) -> SyntheticRecSource:
    return SyntheticRecSource([50, 20], num_dense=3, num_samples=101, chunk_size=16, **kwargs)


def same_batch(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.valid_mask, b.valid_mask)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def _rows(batch: Batch) -> list[bytes]:
    return [row.numpy().tobytes() for row in batch.dense_features[batch.valid_mask]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_split_the_shard_and_resume_exactly(num_workers: int) -> None:
    source = _source(rank=1, world_size=2, shuffle_buffer=24)  # 50 samples on this rank
    expected = Counter(e.dense.tobytes() for e in source.iter_from(0))
    one_pass = list(make_rank_loader(source, 8, num_workers=num_workers))
    assert Counter(r for batch in one_pass for r in _rows(batch)) == expected
    assert len(one_pass) == (7 if num_workers == 0 else 8)  # 2 workers: 25 rows each -> 4 batches each

    loader = make_rank_loader(source, 8, num_workers=num_workers, num_passes=None)
    stream = iter(loader)
    for _ in range(5):
        next(stream)
    state = loader.state_dict()
    uninterrupted = [next(stream) for _ in range(20)]  # crosses two epoch ends (reshuffled each epoch)
    del stream, loader
    resumed = make_rank_loader(source, 8, num_workers=num_workers, num_passes=None)
    resumed.load_state_dict(state)
    stream = iter(resumed)
    assert all(same_batch(a, next(stream)) for a in uninterrupted)


@pytest.mark.parametrize("snapshot_every_n_steps", [1, 4])
def test_resume_is_exact_between_worker_snapshots(snapshot_every_n_steps: int) -> None:
    """Workers send their state every ``snapshot_every_n_steps`` batches; a state taken between snapshots resumes at
    the same next batch (torchdata replays the batches since the last snapshot), at every offset from one."""
    source = _source(shuffle_buffer=24)

    def loader() -> object:
        return make_rank_loader(source, 8, num_workers=2, num_passes=None, multiprocessing_context="fork",
                                snapshot_every_n_steps=snapshot_every_n_steps)  # fmt: skip

    reference = list(itertools.islice(iter(loader()), 16))  # with 4: states taken 3, 1 and 2 batches past a snapshot
    for taken_after in (3, 5, 6):
        original = loader()
        stream = iter(original)
        for _ in range(taken_after):
            next(stream)
        state = original.state_dict()
        del stream, original
        resumed = loader()
        resumed.load_state_dict(state)
        again = list(itertools.islice(iter(resumed), 16 - taken_after))
        assert all(same_batch(a, b) for a, b in zip(reference[taken_after:], again, strict=True)), taken_after


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("left_after", "taken"), [(5, 2), (9, 11)])
def test_resume_after_an_unfinished_pass_is_exact(num_workers: int, left_after: int, taken: int) -> None:
    """A new iteration after a pass left unfinished (a ``break``) starts the next epoch; a state taken in it before
    the workers' next snapshot (default: every 16 batches) resumes at its next batch. The workers used to snapshot
    the dataset before it moved on from the unfinished pass, so the resume continued that pass."""
    source = _source(shuffle_buffer=24)

    def loader() -> object:
        return make_rank_loader(source, 4, num_workers=num_workers, multiprocessing_context="fork")

    original = loader()
    stream = iter(original)
    for _ in range(left_after):
        next(stream)
    stream = iter(original)  # the next epoch
    for _ in range(taken):
        next(stream)
    state = original.state_dict()
    uninterrupted = list(itertools.islice(stream, 10))
    del stream, original
    resumed = loader()
    resumed.load_state_dict(state)
    again = list(itertools.islice(iter(resumed), 10))
    assert len(again) == len(uninterrupted) == 10
    assert all(same_batch(a, b) for a, b in zip(uninterrupted, again, strict=True))


def test_a_worker_snapshot_on_the_last_batch_of_uneven_shares_resumes_exactly() -> None:
    """3 workers with 6 + 5 + 5 batches: the workers' snapshot (every 16 batches) lands on the pass's last batch,
    taken when the two short workers had already moved past their share. Restored, those workers took it for the end
    of the loader's iteration and made a whole new pass in it (10 batches too many; the next epoch then differed)."""
    source = SyntheticRecSource([50, 20], num_dense=3, num_samples=31, chunk_size=16, shuffle_buffer=8)

    def loader() -> object:
        return make_rank_loader(source, 2, num_workers=3, multiprocessing_context="fork")

    original = loader()
    stream = iter(original)
    assert len([next(stream) for _ in range(16)]) == 16  # the whole pass, not yet told it ended
    state = original.state_dict()
    rest, next_epoch = list(stream), list(original)
    del stream, original
    restored = loader()
    restored.load_state_dict(state)
    assert list(iter(restored)) == rest == []
    again = list(restored)
    assert len(again) == len(next_epoch) == 16
    assert all(same_batch(a, b) for a, b in zip(next_epoch, again, strict=True))


def test_a_new_iteration_is_the_next_epoch_with_or_without_workers() -> None:
    source = _source(shuffle_buffer=32)
    first_epochs = []
    for num_workers in (0, 2):
        loader = make_rank_loader(source, 101, num_workers=num_workers)  # one batch per worker and pass
        passes = [sorted(r for batch in loader for r in _rows(batch)) for _ in range(2)]
        first = [r for batch in loader for r in _rows(batch)]
        assert passes[0] == passes[1]  # every pass is the whole shard
        first_epochs.append(first)
    dataset = ShardedBatchDataset(source, 101)
    dataset.set_epoch(2)
    assert _rows(next(iter(dataset))) == first_epochs[0]  # the third iteration of the 0-worker loader was epoch 2


def test_dataset_bad_input() -> None:
    with pytest.raises(TypeError, match="source must be an ElementSource"):
        ShardedBatchDataset([1, 2, 3], 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be a positive int, got batch_size=0"):
        ShardedBatchDataset(_source(), 0)
    with pytest.raises(ValueError, match="num_passes must be a positive int or None, got num_passes=0"):
        ShardedBatchDataset(_source(), 4, num_passes=0)
    with pytest.raises(ValueError, match="num_workers must be a non-negative int, got num_workers=-1"):
        make_rank_loader(_source(), 4, num_workers=-1)
    with pytest.raises(ValueError, match="snapshot_every_n_steps must be a positive int, got snapshot_every_n_steps=0"):
        make_rank_loader(_source(), 4, num_workers=1, snapshot_every_n_steps=0)
    with pytest.raises(ValueError, match=r"state must be a ShardedBatchDataset.state_dict\(\)"):
        ShardedBatchDataset(_source(), 4).load_state_dict({"epoch": 1})


# --------------------------------------------------------------------------------------- MultiHostDataLoadIterator
def test_iterator_length_cuts_an_endless_stream_into_epochs() -> None:
    loader = list(range(5))  # a finite loader: with a length and no reset it is cycled
    iterator = MultiHostDataLoadIterator(loader, iterator_length=3)
    assert [list(iterator) for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    assert len(iterator) == 3 and iterator.get_dataset_size() is None


def test_reset_after_epoch_restarts_and_no_reset_continues() -> None:
    validation = MultiHostDataLoadIterator(list(range(5)), iterator_length=3, reset_after_epoch=True)
    assert [list(validation) for _ in range(2)] == [[0, 1, 2], [0, 1, 2]]
    stream = MultiHostDataLoadIterator(list(range(5)), dataset_size=5)  # no length: epochs end with the loader
    assert [list(stream) for _ in range(2)] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert stream.get_dataset_size() == 5
    half = iter(stream)
    assert [next(half), next(half)] == [0, 1]
    stream.reset()  # no reset_after_epoch: a new epoch at step 0 that continues the loader
    assert stream.step == 0 and next(stream) == 2


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_state_round_trip(kind: str) -> None:
    def make() -> object:
        return make_rank_loader(_source(), 6, num_passes=None) if kind == "stateful" else list(range(40))

    iterator = MultiHostDataLoadIterator(make(), iterator_length=7)
    stream = iter(iterator)
    for _ in range(4):
        next(stream)
    state = iterator.get_state()
    assert state["step"] == 4 and state["iterator_length"] == 7 and state["world_size"] == 1
    rest = [next(stream) for _ in range(3)]  # (list(stream) would call iter(), which starts a new epoch)
    with pytest.raises(StopIteration):
        next(stream)
    rest += list(iterator)  # a whole epoch
    restored = MultiHostDataLoadIterator(make(), iterator_length=7)
    restored.set_state(state)
    again = list(restored) + list(restored)  # iter() right after set_state continues the interrupted epoch
    assert len(again) == len(rest) == 10
    check = same_batch if kind == "stateful" else (lambda a, b: a == b)
    assert all(check(a, b) for a, b in zip(rest, again, strict=True))


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_state_taken_after_an_epoch_ended_resumes_at_the_next_epoch(kind: str) -> None:
    """A state saved after StopIteration (step == iterator_length) restores to "that epoch is over": the next iter()
    starts the next epoch, as it would have on the saved iterator (not an empty epoch that shifts every later one)."""

    def make() -> MultiHostDataLoadIterator:
        loader = make_rank_loader(_source(), 6, num_passes=None) if kind == "stateful" else list(range(10))
        return MultiHostDataLoadIterator(loader, iterator_length=3)

    iterator = make()
    for _ in range(2):
        list(iterator)
    state = iterator.get_state()
    assert state["step"] == 3
    uninterrupted = [list(iterator) for _ in range(2)]
    restored = make()
    restored.set_state(state)
    resumed = [list(restored) for _ in range(2)]
    assert [len(epoch) for epoch in resumed] == [3, 3]
    check = same_batch if kind == "stateful" else (lambda a, b: a == b)
    assert all(check(a, b) for x, y in zip(uninterrupted, resumed, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle_buffer", [0, 24])
def test_a_state_taken_after_a_reset_epoch_ended_starts_a_new_pass(num_workers: int, shuffle_buffer: int) -> None:
    """With ``reset_after_epoch`` each epoch is a new pass of the loader (its next epoch); a state saved after an
    epoch ended restores to the same: the restored loader's pass (which its first iter() would continue) is left."""

    def make() -> MultiHostDataLoadIterator:
        loader = make_rank_loader(_source(shuffle_buffer=shuffle_buffer), 4, num_workers=num_workers,
                                  multiprocessing_context="fork")  # fmt: skip
        return MultiHostDataLoadIterator(loader, iterator_length=3, reset_after_epoch=True)

    iterator = make()
    list(iterator)
    state = iterator.get_state()
    uninterrupted = [list(iterator) for _ in range(2)]
    restored = make()
    restored.set_state(state)
    resumed = [list(restored) for _ in range(2)]
    assert [len(epoch) for epoch in resumed] == [3, 3]
    assert all(same_batch(a, b) for x, y in zip(uninterrupted, resumed, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_when_the_loader_ran_out_restores_its_next_pass(num_workers: int) -> None:
    """reset_after_epoch and no iterator_length: the epoch ends when the loader's pass does. Its state restored
    starts the loader's next pass, not one after it (the restored loader's first iter() already starts it, and the
    extra iteration that leaves an unfinished pass skipped it). The old loader's workers are gone first: while they
    were still exiting the race often went the other way."""
    import gc
    import time

    def make() -> MultiHostDataLoadIterator:
        loader = make_rank_loader(_source(shuffle_buffer=24), 8, num_workers=num_workers,
                                  multiprocessing_context="fork")  # fmt: skip
        return MultiHostDataLoadIterator(loader, reset_after_epoch=True)

    iterator = make()
    list(iterator)
    state = iterator.get_state()
    uninterrupted = list(iterator)
    del iterator
    gc.collect()
    time.sleep(1.5 if num_workers else 0)
    restored = make()
    restored.set_state(state)
    again = list(restored)
    assert len(again) == len(uninterrupted) > 0
    assert all(same_batch(a, b) for a, b in zip(uninterrupted, again, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_reset_epoch_that_has_not_started_leaves_the_restored_pass(num_workers: int) -> None:
    """With reset_after_epoch an epoch starts a new pass of the loader at its first batch. A state taken at step 0
    (after iter(), before that batch), and a restored mid-epoch state followed by reset(), resumed the old pass."""

    def make() -> MultiHostDataLoadIterator:
        loader = make_rank_loader(_source(), 8, num_workers=num_workers, num_passes=None,
                                  multiprocessing_context="fork")  # fmt: skip
        return MultiHostDataLoadIterator(loader, iterator_length=3, reset_after_epoch=True)

    iterator = make()
    stream = iter(iterator)
    next(stream)
    mid = iterator.get_state()  # step 1 of epoch 0
    iter(iterator)  # a new epoch, not started
    at_start = iterator.get_state()
    uninterrupted = list(iterator)  # (iter() again: the same not-started epoch)
    assert at_start["step"] == 0 and len(uninterrupted) == 3
    restored = make()
    restored.set_state(at_start)
    assert all(same_batch(a, b) for a, b in zip(uninterrupted, list(restored), strict=True))
    reset = make()
    reset.set_state(mid)
    reset.reset()  # leave the restored epoch: the next starts a new pass, as on the saved iterator
    assert all(same_batch(a, b) for a, b in zip(uninterrupted, list(reset), strict=True))


def test_set_epoch_between_iter_and_the_first_batch_starts_the_iteration_there() -> None:
    """The iteration's first pass was settled at iter(): a set_epoch() after it left a stale first_epoch, and its
    state did not load (first_epoch above the epoch)."""
    loader = make_rank_loader(_source(shuffle_buffer=24), 8, num_passes=None)
    stream = iter(loader)
    for _ in range(15):  # into the second epoch
        next(stream)
    stream = iter(loader)
    loader.dataset.set_epoch(0)
    first = [next(stream) for _ in range(2)]
    state = loader.state_dict()
    rest = [next(stream) for _ in range(3)]
    resumed = make_rank_loader(_source(shuffle_buffer=24), 8, num_passes=None)
    resumed.load_state_dict(state)
    again = list(itertools.islice(iter(resumed), 3))
    assert all(same_batch(a, b) for a, b in zip(rest, again, strict=True))
    epoch_zero = list(itertools.islice(iter(make_rank_loader(_source(shuffle_buffer=24), 8)), 2))
    assert all(same_batch(a, b) for a, b in zip(first, epoch_zero, strict=True))


def test_a_state_holding_a_batch_from_a_worker_saves_with_torch_save() -> None:
    """A batch from a loader worker is views of one shared buffer in several dtypes, which torch.save refuses: the
    state's kept batch is copied into tensors of its own (a rank that ran out later than another keeps one)."""
    loader = make_rank_loader(_source(), 4, num_workers=2, multiprocessing_context="fork")
    iterator = MultiHostDataLoadIterator(loader, iterator_length=3)
    batch = next(iter(iterator))
    iterator._pending = batch  # what __next__ keeps when another rank's loader ran out
    buffer = io.BytesIO()
    torch.save(iterator.get_state(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)["pending"]
    assert same_batch(saved, batch) and saved.dense_features.untyped_storage().data_ptr() != (
        batch.dense_features.untyped_storage().data_ptr()
    )
    nested = {"batch": batch, "extra": (batch.labels, None)}
    iterator._pending = nested
    torch.save(iterator.get_state(), io.BytesIO())


@pytest.mark.parametrize(
    ("patch", "pattern"),
    [
        ({"step": -5}, r"state\['step'\] must be an int in \[0, iterator_length=3\], got state\['step'\]=-5"),
        ({"step": 4}, r"state\['step'\] must be an int in \[0, iterator_length=3\], got state\['step'\]=4"),
        ({"step": 1.7}, r"got state\['step'\]=1.7"),
        ({"step": "2"}, r"got state\['step'\]='2'"),
        ({"step": True}, r"got state\['step'\]=True"),
        ({"loader": {"replay": -4}}, r"state\['loader'\]\['replay'\] must be an int >= 0, got .*=-4"),
        ({"loader": {"replay": 2.9}}, r"state\['loader'\]\['replay'\] must be an int >= 0, got .*=2.9"),
        ({"loader": {"replay": "x"}}, r"state\['loader'\]\['replay'\] must be an int >= 0, got .*='x'"),
    ],
)
def test_set_state_refuses_a_bad_step_or_replay_count(patch: dict, pattern: str) -> None:
    good = MultiHostDataLoadIterator(list(range(10)), iterator_length=3).get_state()
    iterator = MultiHostDataLoadIterator(list(range(10)), iterator_length=3)
    with pytest.raises(ValueError, match=pattern):
        iterator.set_state({**good, **patch})
    assert [list(iterator) for _ in range(2)] == [[0, 1, 2], [3, 4, 5]]  # a refused state changes nothing
    endless = MultiHostDataLoadIterator(list(range(10)))  # no iterator_length: any step >= 0
    endless.set_state({**endless.get_state(), "step": 99})
    assert endless.step == 99


def test_loader_state_from_another_num_workers_is_refused() -> None:
    """torchdata fails only at the next iter(), with a bare AssertionError about a missing key."""

    def loader(num_workers: int) -> object:
        return make_rank_loader(_source(), 8, num_workers=num_workers, multiprocessing_context="fork")

    states = {}
    for num_workers in (0, 2):
        stream = iter(source := loader(num_workers))
        next(stream)
        states[num_workers] = source.state_dict()
    for saved, now in ((2, 0), (0, 2), (2, 1)):
        with pytest.raises(ValueError, match=f"state_dict was taken with num_workers={saved}, but this loader has "
                           f"num_workers={now}"):  # fmt: skip
            loader(now).load_state_dict(states[saved])
    with pytest.raises(ValueError, match="state_dict is not a StatefulDataLoader state_dict"):
        loader(0).load_state_dict({"epoch": 1})
    with pytest.raises(TypeError, match="state_dict must be a mapping from state_dict\\(\\), got list"):
        loader(0).load_state_dict([])  # type: ignore[arg-type]
    resumed = loader(2)
    resumed.load_state_dict(states[2])  # the same num_workers: accepted
    assert len(list(resumed)) == 13  # 2 workers: 7 + 7 batches of 8 from 101 rows, one already read


def test_set_state_refuses_another_length_or_world_size() -> None:
    state = MultiHostDataLoadIterator(list(range(4)), iterator_length=2).get_state()
    with pytest.raises(ValueError, match="state was taken with iterator_length=2, but this iterator has "
                       "iterator_length=3"):  # fmt: skip
        MultiHostDataLoadIterator(list(range(4)), iterator_length=3).set_state(state)
    with pytest.raises(ValueError, match="state was taken on world_size=4 ranks, but this iterator runs on "
                       "world_size=1"):  # fmt: skip
        MultiHostDataLoadIterator(list(range(4)), iterator_length=2).set_state({**state, "world_size": 4})
    assert state["rank"] == 0
    with pytest.raises(ValueError, match="state was taken on rank 1, but this iterator is rank 0 of its group"):
        MultiHostDataLoadIterator(list(range(4)), iterator_length=2).set_state({**state, "rank": 1})
    for old_keys in ({"rank"}, {"rank", "epoch_ended"}):  # states saved before these were kept still load
        older = MultiHostDataLoadIterator(list(range(4)), iterator_length=2)
        older.set_state({k: v for k, v in state.items() if k not in old_keys})
        assert list(older) == [0, 1]
    with pytest.raises(ValueError, match="state must be a get_state"):
        MultiHostDataLoadIterator(list(range(4))).set_state({"step": 1})


Pair = namedtuple("Pair", "x y")


def test_pad_batch_rebuilds_namedtuples_and_mappings_as_their_own_type() -> None:
    """Containers are rebuilt as what they were: a namedtuple from its fields, a defaultdict with its factory."""
    batch = {
        "pair": Pair(torch.ones(2), torch.zeros(1, 2)),
        "by_key": defaultdict(list, {"z": torch.ones(1)}),
        "ordered": OrderedDict([("b", torch.ones(1)), ("a", (torch.ones(2),))]),
        "plain": [torch.ones(1), 7],
    }
    targets = {path: tuple(n + 1 for n in shape) for path, shape in dense_shapes(batch)}
    padded = pad_batch(batch, targets, -1)
    assert type(padded["pair"]) is Pair and padded["pair"].x.tolist() == [1, 1, -1]
    assert padded["pair"].y.shape == (2, 3)
    assert type(padded["by_key"]) is defaultdict and padded["by_key"].default_factory is list
    assert padded["by_key"]["z"].tolist() == [1, -1] and padded["by_key"]["new"] == []
    assert type(padded["ordered"]) is OrderedDict and list(padded["ordered"]) == ["b", "a"]
    assert padded["ordered"]["a"][0].tolist() == [1, 1, -1] and padded["plain"][1] == 7
    assert list(batch["by_key"]) == ["z"] and batch["pair"].x.shape == (2,)  # the input is left as it was
    one_rank = MultiHostDataLoadIterator([Pair(torch.ones(2), torch.ones(1))], pad_shapes=True)
    assert [type(b) for b in one_rank] == [Pair]


def test_pad_batch_pads_masks_with_false() -> None:
    """A bool tensor is a mask: its padding is False whatever ``pad_value`` is (-1 made it True)."""
    batch = {"mask": torch.ones(2, dtype=torch.bool), "ids": torch.ones(2, dtype=torch.int64)}
    padded = pad_batch(batch, {"batch['mask']": (4,), "batch['ids']": (4,)}, -1)
    assert padded["mask"].tolist() == [True, True, False, False] and padded["ids"].tolist() == [1, 1, -1, -1]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"dataloader": 5}, TypeError, "dataloader must be iterable, got int"),
        ({"iterator_length": 0}, ValueError, "iterator_length must be a positive int or None, got iterator_length=0"),
        ({"dataset_size": -1}, ValueError, "dataset_size must be a non-negative int or None, got dataset_size=-1"),
        ({"reset_after_epoch": 1}, TypeError, "reset_after_epoch must be a bool, got reset_after_epoch=1"),
        ({"pad_shapes": "yes"}, TypeError, "pad_shapes must be a bool, got pad_shapes='yes'"),
        ({"pad_value": None}, TypeError, "pad_value must be a number, got pad_value=None"),
        ({"process_group": object()}, ValueError, "process_group was given but torch.distributed is not initialised"),
    ],
)
def test_iterator_bad_input(kwargs: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        MultiHostDataLoadIterator(**{"dataloader": [1], **kwargs})
    with pytest.raises(TypeError, match="has no iterator_length, so no length"):
        len(MultiHostDataLoadIterator([1]))


def test_in_process_batches_skip_the_profiler_range_only_while_no_profiler_runs() -> None:
    """Without workers the loader skips torch's per-batch ``record_function`` (loader._InProcessIterator) unless a
    profiler runs: the same batches and state either way, and a profile still shows one range per batch."""
    source = _source()
    plain = list(make_rank_loader(source, 8))
    loader = make_rank_loader(source, 8, num_passes=None)
    stream = iter(loader)
    first = [next(stream) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        profiled = [next(stream) for _ in range(4)]
    rest = [next(stream) for _ in range(6)]  # to the epoch's end: 13 batches of 8 for 101 samples
    assert all(same_batch(a, b) for a, b in zip(plain, first + profiled + rest, strict=True))
    ranges = [e for e in profile.events() if e.name.startswith("enumerate(DataLoader)")]
    assert len(ranges) == 4
    state = loader.state_dict()
    assert state["_num_yielded"] == 13
    resumed = make_rank_loader(source, 8, num_passes=None)
    resumed.load_state_dict(state)
    assert same_batch(next(iter(resumed)), next(stream))
