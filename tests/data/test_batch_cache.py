"""The hydrax-style batch cache: cached batches round-trip bit-exactly (later epochs and later jobs read them instead
of calling the loader), read-only and non-persisting groups write nothing, the loader never holds more than
``depth`` batches with a slow consumer, and every error case (double cache, no cache layouts, arrays that do not
match, a cache made for another group, ...) names its cause."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data.batch_cache import Batch, DataGroup
from tritonrec.data.group_loader import GroupLoader

LOADER = {"raw": ((4,), torch.int64)}
CACHE = {"encoded": ((3,), torch.float32), "ids": ((2,), torch.int32)}


class CountingLoader:
    """Fills item ``i``'s raw row with ``i, i+1, i+2, i+3`` and counts its calls (thread-safe)."""

    def __init__(self) -> None:
        self.calls, self.seeds = 0, []
        self._lock = threading.Lock()

    def __call__(self, item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> dict[str, object]:
        arrays["raw"].copy_(torch.arange(item, item + 4))
        with self._lock:
            self.calls += 1
            self.seeds.append(seed)
        return {"name": f"item{item}"} if item % 2 == 0 else {}


def encode(batch: Batch) -> dict[str, torch.Tensor]:
    """The 'frozen encoder': an exact function of the raw ids, so cached values are checkable."""
    raw = batch.get_array("raw")
    return {"encoded": raw[:, :3].to(torch.float32) / 7, "ids": (raw[:, :2] * 3).to(torch.int32)}


def _group(tmp_path: Path, **kwargs: object) -> DataGroup:
    options = {"loader_layouts": LOADER, "cache_layouts": CACHE, "cache_location": tmp_path / "cache"}
    return DataGroup(4, list(range(10)), **{**options, **kwargs})  # 2 batches of 4; items 8, 9 are left over


def test_round_trip_is_bit_exact_and_later_epochs_skip_the_loader(tmp_path: Path) -> None:
    loader_fn = CountingLoader()
    loader = GroupLoader(loader_fn, _group(tmp_path), epochs=3, depth=1)  # depth 1: nothing is made ahead
    seen: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for batch in loader:
        with batch:
            if batch.uncached:
                assert batch.layouts == batch.group.loader_layouts and batch.epoch == 0
                encoded = encode(batch)
                batch.cache(encoded, additional={"name": batch.get_additional("name", default="odd")})
                assert not batch.uncached and batch.layouts == batch.group.cache_layouts
            seen[batch.epoch, batch.group_index] = {k: v.clone() for k, v in batch.arrays.items()}
            assert batch.get_additional("name") == [f"item{i}" if i % 2 == 0 else "odd" for i in batch.indices]
    assert loader_fn.calls == 8 and loader.loaded_batches == 2  # epochs 1 and 2 read the cache
    for (epoch, index), arrays in seen.items():
        for name, tensor in arrays.items():
            assert torch.equal(tensor, seen[0, index][name]) and tensor.dtype == CACHE[name][1], (epoch, name)

    again = CountingLoader()  # a later job: same location, a fresh group object
    batches = list(GroupLoader(again, _group(tmp_path)))
    assert again.calls == 0 and all(not b.uncached for b in batches)
    assert torch.equal(batches[1].get_array("ids"), seen[0, 1]["ids"])


def test_readonly_and_non_persisting_groups_write_nothing(tmp_path: Path) -> None:
    for group in (_group(tmp_path, persist=False), _group(tmp_path / "other", cache_location=None)):
        loader_fn = CountingLoader()
        for batch in GroupLoader(loader_fn, group, epochs=2):
            batch.cache(encode(batch))
            batch.release()
        assert loader_fn.calls == 16  # nothing stored, so every epoch loads again
    assert not _group(tmp_path).store.is_stored(0)
    for batch in GroupLoader(CountingLoader(), _group(tmp_path)):
        batch.cache(encode(batch), persist=batch.group_index == 0)  # only batch 0 is stored
    readonly = _group(tmp_path, cache_readonly=True)
    loader_fn = CountingLoader()
    batches = list(GroupLoader(loader_fn, readonly, epochs=2, depth=4))  # keeps all 4
    assert [b.uncached for b in batches] == [False, True, False, True] and loader_fn.calls == 8
    batches[1].cache(encode(batches[1]))  # converted in memory, not written: the cache is read-only
    assert readonly.store.is_stored(0) and not readonly.store.is_stored(1)
    with pytest.raises(ValueError, match="holds no cache \\(no cache.json\\) and is read-only"):
        _group(tmp_path, cache_location=tmp_path / "empty", cache_readonly=True)


def test_a_cache_this_process_cannot_write_is_refused_when_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writable group on a read-only cache (a read-only mount; simulated: tests may run as root) failed only at the
    first Batch.cache, with a raw OSError mid-epoch; now when the group is made. cache_readonly=True still reads it."""
    import tritonrec.data.batch_store as batch_store

    for batch in GroupLoader(CountingLoader(), _group(tmp_path)):
        batch.cache(encode(batch))
    real_access = batch_store.os.access
    monkeypatch.setattr(
        batch_store.os, "access", lambda path, mode: mode != batch_store.os.W_OK and real_access(path, mode)
    )
    with pytest.raises(
        ValueError, match=r"cannot write \(cache is read-only here\); open the group with cache_readonly=True"
    ):
        _group(tmp_path)
    assert all(not b.uncached for b in GroupLoader(CountingLoader(), _group(tmp_path, cache_readonly=True)))
    assert all(not b.uncached for b in GroupLoader(CountingLoader(), _group(tmp_path, persist=False)))  # never writes
    monkeypatch.setattr(batch_store.os, "access", real_access)

    def no_additional(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> dict[str, object]:
        arrays["raw"].copy_(torch.arange(item, item + 4))
        return {}

    bare = tmp_path / "bare"
    for batch in GroupLoader(no_additional, _group(tmp_path, cache_location=bare)):
        batch.cache(encode(batch))
    (bare / "additional").rmdir()  # empty, and empty folders are often lost in copies: made again, not refused
    assert all(not b.uncached for b in GroupLoader(no_additional, _group(tmp_path, cache_location=bare)))
    assert (bare / "additional").is_dir()


def test_depth_limit_holds_with_a_slow_consumer(tmp_path: Path) -> None:
    group = DataGroup(1, list(range(12)), loader_layouts=LOADER)
    loader = GroupLoader(CountingLoader(), group, depth=3)
    held = []
    for batch in loader:
        held.append(batch)
        if len(held) == 3:  # the consumer holds every slot for a while: the producer must wait
            time.sleep(0.03)
            assert loader.alive == 3 and loader._queue.empty()
            for old in held[:2]:
                old.release()
            held = held[2:]
        time.sleep(0.002)
    assert loader.max_alive == 3
    stuck = GroupLoader(CountingLoader(), group, depth=2)
    with pytest.raises(RuntimeError, match=r"all depth=2 batches are still alive, so no next batch can be loaded"):
        kept = list(stuck)  # noqa: F841 - holds every batch
    held.clear()


def test_a_slow_loader_is_not_mistaken_for_a_stalled_consumer(tmp_path: Path) -> None:
    """With depth 1 the producer holds the only slot while it makes the next batch; a loader slower than the
    consumer's polling must be waited for, not reported as "all batches are still alive" (a race seen under load)."""
    counting = CountingLoader()

    def slow(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> dict[str, object]:
        time.sleep(0.05)  # 4 rows: 0.2 s per batch, several of the consumer's 0.05 s polls
        return counting(item, arrays, seed)

    indices = []
    for batch in GroupLoader(slow, _group(tmp_path, cache_location=None), epochs=2, depth=1):
        with batch:
            indices.append((batch.epoch, batch.group_index))
    assert indices == [(0, 0), (0, 1), (1, 0), (1, 1)] and counting.calls == 16


def test_schedule_shuffles_batches_and_runs_validation_without_seeds(tmp_path: Path) -> None:
    train = DataGroup(2, list(range(12)), loader_layouts=LOADER)
    valid = DataGroup(3, list(range(100, 106)), loader_layouts=LOADER)
    loader_fn = CountingLoader()
    loader = GroupLoader(loader_fn, train, validation=valid, epochs=2, shuffle=True, seed=5)
    order = [(b.epoch, b.is_validation, b.group_index, list(b.indices), b.data) for b in loader]
    train_orders = [[o[2] for o in order if o[0] == e and not o[1]] for e in (0, 1)]
    assert sorted(train_orders[0]) == list(range(6)) and train_orders[0] != train_orders[1]
    assert [o[2] for o in order if o[1]] == [0, 1, 0, 1] and order[-1][4] == [103, 104, 105]
    assert all(o[3] == list(range(2 * o[2], 2 * o[2] + 2)) for o in order if not o[1])
    assert loader_fn.seeds.count(None) == 12 and len({s for s in loader_fn.seeds if s is not None}) == 24
    again = GroupLoader(loader_fn, train, valid, epochs=2, shuffle=True, seed=5)
    assert [(b.epoch, b.is_validation, b.group_index) for b in again] == [o[:3] for o in order]  # seeded


def test_batch_accessors(tmp_path: Path) -> None:
    batch = next(iter(GroupLoader(CountingLoader(), _group(tmp_path))))
    assert batch.is_training and not batch.is_validation and len(batch) == 4 and batch.group_index == 0
    assert batch.data == [0, 1, 2, 3] and batch.get_data(2) == 2 and batch.indices == range(0, 4)
    assert batch.get_additional("name", 0) == "item0" and batch.get_additional("name", 1, default=-1) == -1
    assert batch.get_additional("missing", 3, default="x") == "x" and list(batch.additional) == ["name"]
    assert torch.equal(batch.get_array("raw")[1], torch.arange(1, 5))
    with pytest.raises(KeyError, match="this batch has no array 'encoded'; it has \\['raw'\\]"):
        batch.get_array("encoded")
    with pytest.raises(IndexError, match="index 4 is out of range for a batch of 4 items"):
        batch.get_additional("name", 4)


def test_get_data_names_a_bad_index_and_the_batch_size(tmp_path: Path) -> None:
    """get_data indexes like a list (negatives from the end) and refuses what get_additional refuses, naming both."""
    batch = next(iter(GroupLoader(CountingLoader(), _group(tmp_path))))
    assert batch.get_data(-1) == 3 and batch.get_data(np.int64(1)) == 1
    for index in (4, -5):
        with pytest.raises(IndexError, match=f"index {index} is out of range for a batch of 4 items"):
            batch.get_data(index)
    for index in (1.0, True, "1"):
        with pytest.raises(TypeError, match=f"index must be an int, got index={index!r}"):
            batch.get_data(index)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index must be an int, got index='0'"):
        batch.get_additional("name", "0")  # type: ignore[arg-type]


def test_cache_errors(tmp_path: Path) -> None:
    batch = next(iter(GroupLoader(CountingLoader(), _group(tmp_path))))
    good = encode(batch)
    with pytest.raises(ValueError, match=r"missing \['ids'\], unexpected \['other'\]"):
        batch.cache({"encoded": good["encoded"], "other": good["ids"]})
    with pytest.raises(ValueError, match=r"array 'encoded' must be a tensor of shape \(4, 3\) and dtype torch.float32"):
        batch.cache({**good, "encoded": good["encoded"][:, :2]})
    with pytest.raises(ValueError, match=r"array 'ids' must be a tensor of shape \(4, 2\) and dtype torch.int32, got "
                       r"\(4, 2\) torch.int64"):  # fmt: skip
        batch.cache({**good, "ids": good["ids"].long()})
    with pytest.raises(ValueError, match=r"additional\['name'\] must hold one value per item \(4\)"):
        batch.cache(good, additional={"name": [1]})
    batch.cache(good)
    with pytest.raises(RuntimeError, match="batch 0 is already cached"):
        batch.cache(good)
    plain = next(iter(GroupLoader(CountingLoader(), DataGroup(2, [1, 2], loader_layouts=LOADER))))
    with pytest.raises(RuntimeError, match="group has no cache_layouts, so its batches cannot be cached"):
        plain.cache(good)


def test_group_errors(tmp_path: Path) -> None:
    _group(tmp_path)  # writes cache.json
    with pytest.raises(ValueError, match="holds a cache with batch_size=4, but this group has batch_size=5"):
        DataGroup(5, list(range(10)), LOADER, CACHE, tmp_path / "cache")
    with pytest.raises(ValueError, match="holds a cache with num_items=10, but this group has num_items=11"):
        DataGroup(4, list(range(11)), LOADER, CACHE, tmp_path / "cache")
    with pytest.raises(ValueError, match="data holds 3 items, fewer than batch_size=4: no batch"):
        DataGroup(4, [1, 2, 3], LOADER)
    with pytest.raises(ValueError, match="loader_layouts and cache_layouts are both None"):
        DataGroup(1, [1])
    with pytest.raises(ValueError, match="a group without loader_layouts is read from its cache, so it needs a"):
        DataGroup(1, [1], cache_layouts=CACHE)
    with pytest.raises(ValueError, match=r"loader_layouts\['raw'\]: shape must be a tuple of non-negative ints"):
        DataGroup(1, [1], {"raw": ((-1,), torch.int64)})
    with pytest.raises(ValueError, match=r"cache_layouts\['x'\]: dtype torch.bfloat16 cannot be stored as .npy"):
        DataGroup(1, [1], LOADER, {"x": ((1,), torch.bfloat16)}, tmp_path / "bf16")
    with pytest.raises(ValueError, match="cache_location is set but cache_layouts is None"):
        DataGroup(1, [1], LOADER, cache_location=tmp_path / "x")
    cache_only = DataGroup(4, list(range(10)), cache_layouts=CACHE, cache_location=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="batch 0 of a cache-only group is not stored in"):
        list(GroupLoader(CountingLoader(), cache_only))


def test_loader_errors_reach_the_consumer() -> None:
    def broken(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
        if item == 3:
            raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        list(GroupLoader(broken, DataGroup(2, list(range(6)), loader_layouts=LOADER)))
    with pytest.raises(TypeError, match="loader_fn must return a mapping or None, got list for item 0"):
        list(GroupLoader(lambda item, arrays, seed: [1], DataGroup(2, list(range(6)), loader_layouts=LOADER)))
    with pytest.raises(ValueError, match="depth must be an int >= 1, got depth=0"):
        GroupLoader(CountingLoader(), DataGroup(2, [1, 2], loader_layouts=LOADER), depth=0)
