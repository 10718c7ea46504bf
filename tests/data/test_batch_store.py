"""The batch cache's files: one memory-mapped ``.npy`` per array for the whole group and a mark per batch. A batch
is read only once marked (a half-written one is loaded again), copies protect the cache from in-place writes while
views share the mapping, a store opened elsewhere sees batches as they are marked, files made by another process
are never replaced, and a cache whose files do not match is refused by name."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.batch_store import FORMAT, _create_exclusive
from tritonrec.data.group_loader import GroupLoader

LOADER = {"raw": ((3,), torch.int64)}
CACHE = {"feat": ((2,), torch.float32), "ids": ((3,), torch.int64), "none": ((0,), torch.float32)}


def fill(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> dict[str, object] | None:
    arrays["raw"].copy_(torch.tensor([item, 2 * item, 3 * item]))
    return {"tag": item} if item == 1 else None


def encode(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"feat": raw[:, :2].float() / 3, "ids": raw * 5, "none": torch.empty(raw.shape[0], 0)}


def group(location: Path, **kwargs: object) -> DataGroup:
    return DataGroup(2, list(range(7)), LOADER, CACHE, location, **kwargs)  # 3 batches of 2, item 6 left over


def fill_cache(location: Path, **kwargs: object) -> DataGroup:
    made = group(location, **kwargs)
    for batch in GroupLoader(fill, made):
        with batch:
            batch.cache(encode(batch.get_array("raw")))
    return made


def test_files_hold_every_batch_in_one_array_per_name(tmp_path: Path) -> None:
    fill_cache(tmp_path)
    ids = np.load(tmp_path / "ids.npy")
    assert ids.shape == (6, 3) and np.array_equal(ids, np.arange(6)[:, None] * [5, 10, 15])
    assert np.load(tmp_path / "none.npy").shape == (6, 0)
    assert (tmp_path / "stored.bin").read_bytes() == bytes([2, 1, 1])  # batch 0 holds item 1's additional data
    with (tmp_path / "additional" / "00000000.pkl").open("rb") as handle:
        assert pickle.load(handle) == {"tag": [None, 1]}
    assert json.loads((tmp_path / "cache.json").read_text())["format"] == FORMAT
    loader = GroupLoader(fill, group(tmp_path))
    batches = [(b.group_index, b.get_additional("tag"), b.get_array("feat").clone()) for b in loader]
    assert [(i, tags) for i, tags, _ in batches] == [(0, [None, 1]), (1, [None, None]), (2, [None, None])]
    assert torch.equal(batches[2][2], torch.tensor([[4.0, 8.0], [5.0, 10.0]]) / 3)


def test_an_unmarked_batch_is_loaded_again(tmp_path: Path) -> None:
    """Rows written without their mark (a job killed mid-write) are not read: the loader makes the batch again."""
    made = group(tmp_path)
    rows = np.load(tmp_path / "ids.npy", mmap_mode="r+")
    rows[2:4] = -1  # batch 1 half written, never marked
    rows.flush()
    calls = []
    loader = GroupLoader(lambda item, arrays, seed: calls.append(item) or fill(item, arrays, seed), made)
    for batch in loader:
        with batch:
            assert batch.uncached
            batch.cache(encode(batch.get_array("raw")))
    assert calls == list(range(6)) and made.store.is_stored(1)
    again = [b.get_array("ids").clone() for b in GroupLoader(fill, group(tmp_path))]
    assert torch.equal(again[1], torch.tensor([[10, 20, 30], [15, 30, 45]]))


def test_copies_protect_the_cache_and_views_share_the_mapping(tmp_path: Path) -> None:
    fill_cache(tmp_path)
    copies = group(tmp_path)
    for _ in range(2):  # epoch 1 reads what epoch 0's consumer overwrote in its copies
        for batch in GroupLoader(fill, copies):
            with batch:
                assert torch.equal(batch.get_array("ids")[0], torch.tensor([10, 20, 30]) * batch.group_index)
                batch.get_array("ids").fill_(-7)  # the consumer's own tensor
    views = group(tmp_path, cache_views=True)
    first = views.read_batch(1)[0]["ids"]
    assert torch.equal(views.read_batch(1)[0]["ids"], first)
    first.fill_(-7)  # a copy-on-write page of this process's mapping ...
    assert int(views.read_batch(1)[0]["ids"][0, 0]) == -7  # ... which this group's later reads see
    assert int(group(tmp_path).read_batch(1)[0]["ids"][0, 0]) == 10  # but not the file
    assert int(np.load(tmp_path / "ids.npy")[2, 0]) == 10


def test_a_store_sees_batches_another_writer_marks_later(tmp_path: Path) -> None:
    reader, writer = group(tmp_path), group(tmp_path)
    assert reader.read_batch(0) is None  # maps the marks before anything is stored
    raw = torch.tensor([[0, 0, 0], [1, 2, 3]])
    writer.write_batch(0, encode(raw), {})
    arrays, additional = reader.read_batch(0)
    assert torch.equal(arrays["ids"], raw * 5) and additional == {} and reader.read_batch(1) is None
    writer.write_batch(1, encode(raw + 1), {"k": ["a", "b"]})
    arrays, additional = reader.read_batch(1)  # its array mappings were opened before batch 1 was written
    assert torch.equal(arrays["ids"], (raw + 1) * 5) and additional == {"k": ["a", "b"]}
    copied = pickle.loads(pickle.dumps(reader))  # e.g. into a DataLoader worker: it maps the files anew
    assert torch.equal(copied.read_batch(1)[0]["feat"], arrays["feat"])


def test_files_another_process_made_are_never_replaced(tmp_path: Path) -> None:
    target = tmp_path / "x.bin"

    def racing(partial: Path) -> None:  # the other process links its file in while we make ours
        partial.write_bytes(b"mine")
        target.write_bytes(b"theirs")

    _create_exclusive(target, racing)
    assert target.read_bytes() == b"theirs" and list(tmp_path.iterdir()) == [target]
    _create_exclusive(target, lambda p: p.write_bytes(b"late"))
    assert target.read_bytes() == b"theirs"


def test_mismatched_files_are_refused_by_name(tmp_path: Path) -> None:
    group(tmp_path / "a")
    (tmp_path / "a" / "feat.npy").unlink()
    with pytest.raises(ValueError, match="has cache.json but lacks feat.npy"):
        group(tmp_path / "a")
    old = tmp_path / "old"
    old.mkdir()
    (old / "cache.json").write_text(json.dumps({"format": "tritonrec-batch-cache-1"}))
    with pytest.raises(ValueError, match="holds a cache with format='tritonrec-batch-cache-1', but this group has"):
        group(old)
    with pytest.raises(TypeError, match="cache_views must be a bool, got cache_views=1"):
        group(tmp_path / "b", cache_views=1)


def test_stored_segments_keep_the_order_and_the_depth_limit(tmp_path: Path) -> None:
    """A wholly stored pass is read in the consumer's thread: same order as the schedule, never more than ``depth``
    alive, a consumer that keeps every batch is told so, and leaving early stops the waiting producer. A wholly
    stored schedule starts no producer thread at all, with the same order and limit."""
    fill_cache(tmp_path)
    valid = DataGroup(1, [10, 11], loader_layouts=LOADER)  # never stored: made by the producer between passes
    loader = GroupLoader(fill, group(tmp_path), validation=valid, epochs=2, depth=2, shuffle=True, seed=3)
    seen = []
    for batch in loader:
        with batch:
            seen.append((batch.epoch, batch.is_validation, batch.group_index, batch.uncached))
    expected = [(e, False, i, False) for e in (0, 1) for i in np.random.default_rng([3, e]).permutation(3).tolist()]
    assert [s for s in seen if not s[1]] == expected and loader.loaded_batches == 4
    assert seen[3:5] == [(0, True, 0, True), (0, True, 1, True)] and loader.max_alive <= 2
    with pytest.raises(RuntimeError, match="all depth=2 batches are still alive"):
        kept = list(GroupLoader(fill, group(tmp_path), depth=2))  # noqa: F841 - holds every batch
    # a wholly stored schedule is read without a producer thread: the same shuffled order, the same depth limit
    stored = GroupLoader(fill, group(tmp_path), epochs=2, depth=2, shuffle=True, seed=3)
    order = [(batch.epoch, batch.group_index) for batch in stored if batch.release() is None]
    assert order == [(s[0], s[2]) for s in expected] and stored._thread is None
    assert stored.loaded_batches == 0 and stored.max_alive == 1
    early = GroupLoader(fill, group(tmp_path), validation=valid, epochs=50, depth=1)
    for batch in early:
        batch.release()
        break
    early.close()
    assert not early._thread.is_alive()


def test_a_second_iteration_while_one_runs_is_refused_on_either_path(tmp_path: Path) -> None:
    """One iteration at a time: with a producer thread (a group still to load) and without one (a wholly stored
    cache), a second ``iter()`` while the first runs raises; after the first finishes or is closed, a new one runs."""
    fill_cache(tmp_path / "stored")
    for loader in (GroupLoader(fill, DataGroup(1, [10, 11, 12], loader_layouts=LOADER)),
                   GroupLoader(fill, group(tmp_path / "stored"))):  # fmt: skip
        first = iter(loader)
        next(first).release()
        with pytest.raises(RuntimeError, match="already being iterated; finish or close"):
            iter(loader)
        assert sum(1 for batch in first if batch.release() is None) == 2  # the first finishes: 3 batches in all
        assert sum(1 for batch in loader if batch.release() is None) == 3
        again = iter(loader)
        next(again).release()
        loader.close()
        assert sum(1 for batch in loader if batch.release() is None) == 3


def test_key_major_arrays_are_stored_feature_by_feature_and_read_as_transposed_views(tmp_path: Path) -> None:
    from tritonrec.data import kjt_from_id_matrix

    fill_cache(tmp_path / "rows")
    fill_cache(tmp_path / "keys", cache_key_major=["ids"])
    stored = np.load(tmp_path / "keys" / "ids.npy")
    assert stored.shape == (3, 3, 2) and np.array_equal(stored[1], (np.arange(2, 4)[:, None] * [5, 10, 15]).T)
    for views in (False, True):
        by_rows, by_keys = group(tmp_path / "rows"), group(tmp_path / "keys", cache_views=views, cache_key_major="ids")
        for index in range(3):
            rows, keys = by_rows.read_batch(index)[0], by_keys.read_batch(index)[0]
            assert keys["ids"].shape == (2, 3) and keys["ids"].stride() == (1, 2)  # a transposed [3, 2] block
            assert all(torch.equal(rows[name], keys[name]) for name in CACHE)
            a, b = kjt_from_id_matrix(["x", "y", "z"], rows["ids"]), kjt_from_id_matrix(["x", "y", "z"], keys["ids"])
            assert torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())
    with pytest.raises(ValueError, match=r"holds a cache with key_major=\['ids'\], but this group has key_major=\[\]"):
        group(tmp_path / "keys")
    with pytest.raises(ValueError, match="cache_key_major names 'none', which is not a dense cache array"):
        DataGroup(2, [1, 2], LOADER, {"none": ((1, 2), torch.float32)}, tmp_path / "other", cache_key_major=["none"])
    with pytest.raises(ValueError, match="cache_key_major names 'raw', which is not a dense cache array"):
        group(tmp_path / "third", cache_key_major=["raw"])
