"""Batch cache regressions from an audit: the depth limit holds across iterations of one loader and after a failing
``loader_fn``; a stored batch is never rewritten (a rewrite killed midway left a torn batch marked stored); a file
of another layout left in the cache location is refused by name; unpicklable additional data leaves the batch
uncached with no partial file; bad argument types are named."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.cache_layouts import KJTLayout
from tritonrec.data.group_loader import GroupLoader

LOADER = {"raw": ((2,), torch.int64)}
CACHE = {"enc": ((3,), torch.float32), "ids": KJTLayout(("a", "b"), 2)}


def fill(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
    arrays["raw"].fill_(item)


def _kjt(first_id: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["a", "b"], torch.arange(8) + first_id, lengths=torch.ones(8, dtype=torch.int32), stride=4)


def _group(location: Path | None, **kwargs: object) -> DataGroup:
    return DataGroup(4, list(range(12)), LOADER, CACHE if location else None, location, **kwargs)


def test_depth_holds_across_iterations_of_one_loader() -> None:
    """A batch kept from an abandoned iteration counts against depth in the next one (it released into a new
    per-iteration semaphore: 3 batches alive at depth=2)."""
    loader = GroupLoader(fill, _group(None), depth=2)
    first = iter(loader)
    held = next(first)
    first.close()  # the batch the producer made ahead is dropped and frees its slot
    assert loader.alive == 1
    second = iter(loader)
    batch = next(second)
    with pytest.raises(RuntimeError, match=r"all depth=2 batches are still alive"):
        next(second)
    assert loader.max_alive == 2
    held.release()
    batch.release()
    assert [b.group_index for b in loader] == [0, 1, 2] and loader.alive == 0


def test_a_failing_loader_fn_frees_its_slot() -> None:
    calls = {"n": 0}

    def failing_once(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
        calls["n"] += 1
        if calls["n"] == 6:  # the second batch's second item
            raise KeyError("broken item")
        fill(item, arrays, seed)

    loader = GroupLoader(failing_once, _group(None), depth=1)
    with pytest.raises(KeyError, match="broken item"):
        for batch in loader:
            batch.release()
    assert loader.alive == 0 and not loader._making  # the slot taken for the failed batch was leaked
    seen = []
    for batch in loader:  # depth=1 still has its one slot
        with batch:
            seen.append(batch.group_index)
    assert seen == [0, 1, 2]


class _KilledMidWrite:
    """A KJT stand-in whose parts cannot be read: the write stops after the dense rows (a simulated kill)."""

    def lengths(self) -> torch.Tensor:
        raise KeyboardInterrupt("killed")


def test_a_stored_batch_is_never_rewritten(tmp_path: Path) -> None:
    store = _group(tmp_path / "cache").store
    store.write(0, {"enc": torch.ones(4, 3), "ids": _kjt(0)}, {})
    with contextlib.suppress(KeyboardInterrupt):  # old code: new dense rows, then a stop under the old mark
        store.write(0, {"enc": torch.full((4, 3), 7.0), "ids": _KilledMidWrite()}, {})
    store.write(0, {"enc": torch.full((4, 3), 5.0), "ids": _kjt(50)}, {"x": [1, 2, 3, 4]})  # first writer wins
    arrays, additional = store.read(0)
    assert torch.equal(arrays["enc"], torch.ones(4, 3)) and arrays["ids"].values().tolist() == list(range(8))
    assert additional == {}


def test_a_later_epochs_batch_caches_without_rewriting(tmp_path: Path) -> None:
    """depth=3 with 2 batches an epoch: epoch 1's batch 0 is made before epoch 0's is cached; caching it keeps the
    stored batch (old code rewrote it in place) and still turns the batch into its cached form."""
    group = DataGroup(4, list(range(8)), LOADER, CACHE, tmp_path / "cache")
    loader = GroupLoader(fill, group, epochs=2, depth=3)
    for batch in loader:
        with batch:
            if batch.epoch == 0 and batch.group_index == 0:
                time.sleep(0.2)  # the producer makes the 3 batches depth allows meanwhile
            if batch.uncached:
                shift = 100 * batch.epoch
                batch.cache({"enc": batch.get_array("raw")[:, :1].float().repeat(1, 3) + shift, "ids": _kjt(shift)})
                assert not batch.uncached
    assert loader.loaded_batches > 2  # epoch 1 loaded (and cached) a batch again
    for index in range(2):
        arrays, _ = group.read_batch(index)
        assert arrays["enc"][:, 0].tolist() == [float(i) for i in range(4 * index, 4 * index + 4)]
        assert arrays["ids"].values().tolist() == list(range(8))


def test_a_file_of_another_layout_is_refused_by_name(tmp_path: Path) -> None:
    """A job killed before cache.json may leave files of another layout; they were taken as they were."""
    location = tmp_path / "cache"
    location.mkdir()
    np.lib.format.open_memmap(location / "enc.npy", mode="w+", dtype=np.float64, shape=(12, 5))
    with pytest.raises(ValueError, match=r"enc.npy' holds shape \(12, 5\) float64, but this group expects \(12, 3\) "
                       r"float32"):  # fmt: skip
        _group(location)
    (location / "enc.npy").unlink()
    _group(location)  # now created afresh
    (location / "ids.lengths.npy").write_bytes(b"not an npy")
    with pytest.raises(ValueError, match=r"ids.lengths.npy' is not a readable .npy"):
        _group(location)


def test_unpicklable_additional_data_leaves_the_batch_uncached(tmp_path: Path) -> None:
    group = _group(tmp_path / "cache")
    loader = GroupLoader(fill, group)
    batch = next(iter(loader))
    with pytest.raises(ValueError, match=r"batch 0's additional data cannot be pickled"):
        batch.cache({"enc": torch.zeros(4, 3), "ids": _kjt(0)}, additional={"f": [lambda: 1, None, None, None]})
    assert batch.uncached and not group.store.is_stored(0)
    assert list((tmp_path / "cache" / "additional").iterdir()) == []  # no partial pickle left behind
    batch.cache({"enc": torch.zeros(4, 3), "ids": _kjt(0)}, additional={"f": [1, None, None, 2]})  # retried
    assert group.store.read(0)[1] == {"f": [1, None, None, 2]}
    batch.release()
    loader.close()


def test_bad_argument_types_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cache_location must be a str, a path or None, got int: cache_location=5"):
        DataGroup(4, range(12), LOADER, CACHE, 5)
    with pytest.raises(ValueError, match=r"loader_layouts\['raw'\]: shape must be a tuple of non-negative ints"):
        DataGroup(4, range(12), {"raw": ((True,), torch.int64)})
    assert DataGroup(4, range(12), {"raw": ((np.int64(2),), torch.int64)}).loader_layouts["raw"][0] == (4, 2)
    loader = GroupLoader(fill, _group(tmp_path / "cache"))
    batch = next(iter(loader))
    good = {"enc": torch.zeros(4, 3), "ids": _kjt(0)}
    with pytest.raises(TypeError, match=r"persist must be a bool, got persist='no'"):
        batch.cache(good, persist="no")
    with pytest.raises(ValueError, match=r"additional\['k'\] must hold one value per item \(4\) in a sequence, got a "
                       r"str of length 4"):  # fmt: skip
        batch.cache(good, additional={"k": "abcd"})
    assert batch.uncached
    batch.release()
    loader.close()
