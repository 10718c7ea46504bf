"""KeyedJaggedTensor cache arrays (``KJTLayout``): stored as values + key-major lengths + per-key totals, read back
bit-exact as copies or views (empty bags, int32 / int64 ids, weights), and every misfit refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.cache_layouts import KJTLayout
from tritonrec.data.group_loader import GroupLoader

KEYS = ("a", "b", "c")
B = 4


def item_bags(item: int) -> list[list[int]]:
    """Item ``item``'s ids per key: 0-3 ids each (some bags empty), deterministic per item."""
    rng = np.random.default_rng(item)
    return [rng.integers(0, 1000, int(rng.integers(0, 4))).tolist() for _ in KEYS]


def expected_kjt(items: range, dtype: torch.dtype, weighted: bool) -> KeyedJaggedTensor:
    """The batch's KJT built straight from the per-item bags, key-major, through the checked constructor."""
    bags = [item_bags(i) for i in items]
    values = [v for k in range(len(KEYS)) for bag in bags for v in bag[k]]
    lengths = [len(bag[k]) for k in range(len(KEYS)) for bag in bags]
    weights = torch.tensor([v / 7.0 for v in values], dtype=torch.float32) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), torch.tensor(values, dtype=dtype), torch.tensor(lengths, dtype=torch.int32), weights, stride=B
    )


def fill(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
    arrays["item"].fill_(item)


def make_group(location: Path | None, layout: KJTLayout, **kwargs: object) -> DataGroup:
    cache = {"sparse": layout, "label": ((), torch.float32)}
    return DataGroup(B, list(range(3 * B + 1)), {"item": ((), torch.int64)}, cache, location, **kwargs)


def cache_all(group: DataGroup, layout: KJTLayout) -> None:
    for batch in GroupLoader(fill, group):
        with batch:
            assert batch.uncached
            kjt = expected_kjt(batch.indices, layout.dtype, layout.weighted)
            batch.cache({"sparse": kjt, "label": batch.get_array("item").float()})


def assert_same(mine: KeyedJaggedTensor, theirs: KeyedJaggedTensor) -> None:
    assert mine.keys() == theirs.keys() and mine.stride() == theirs.stride()
    assert mine.values().dtype == theirs.values().dtype and torch.equal(mine.values(), theirs.values())
    assert torch.equal(mine.lengths().long(), theirs.lengths().long())
    assert mine.length_per_key() == theirs.length_per_key()
    if theirs.weights_or_none() is None:
        assert mine.weights_or_none() is None
    else:
        assert torch.equal(mine.weights(), theirs.weights())
    for key in KEYS:  # the per-key views derived from the parts agree too
        assert torch.equal(mine[key].values(), theirs[key].values())


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize(("dtype", "weighted"), [(torch.int64, False), (torch.int32, True)])
def test_a_cached_kjt_reads_back_bit_exact(tmp_path: Path, views: bool, dtype: torch.dtype, weighted: bool) -> None:
    layout = KJTLayout(KEYS, max_values_per_item=9, dtype=dtype, weighted=weighted)
    cache_all(make_group(tmp_path, layout), layout)
    reread = make_group(tmp_path, layout, cache_views=views)
    seen = []
    for batch in GroupLoader(fill, reread, epochs=2, shuffle=True):
        with batch:
            assert not batch.uncached and batch.layouts["sparse"] == layout
            assert_same(batch.get_array("sparse"), expected_kjt(batch.indices, dtype, weighted))
            assert torch.equal(batch.get_array("label"), torch.arange(batch.indices.start, batch.indices.stop).float())
            seen.append(batch.group_index)
    assert sorted(seen) == [0, 0, 1, 1, 2, 2]  # 13 items: 3 whole batches an epoch


def test_files_hold_each_batch_from_the_start_of_its_slot(tmp_path: Path) -> None:
    layout = KJTLayout(KEYS, max_values_per_item=9)
    cache_all(make_group(tmp_path, layout), layout)
    values, lengths = np.load(tmp_path / "sparse.values.npy"), np.load(tmp_path / "sparse.lengths.npy")
    totals = np.load(tmp_path / "sparse.length_per_key.npy")
    assert values.shape == (3, B * 9) and lengths.shape == (3, 3, B) and lengths.dtype == np.int32
    for index in range(3):
        kjt = expected_kjt(range(index * B, (index + 1) * B), torch.int64, False)
        count = kjt.values().numel()
        assert np.array_equal(values[index, :count], kjt.values().numpy()) and not values[index, count:].any()
        assert np.array_equal(lengths[index].reshape(-1), kjt.lengths().numpy())
        assert totals[index].tolist() == kjt.length_per_key()
    assert not (tmp_path / "sparse.weights.npy").exists()


def test_copies_are_the_callers_and_views_share_the_mapping(tmp_path: Path) -> None:
    layout = KJTLayout(KEYS, max_values_per_item=9)
    cache_all(make_group(tmp_path, layout), layout)
    for views in (False, True):
        group = make_group(tmp_path, layout, cache_views=views)
        first = next(iter(GroupLoader(fill, group)))
        first.get_array("sparse").values().add_(1)
        first.release()
        again = next(iter(GroupLoader(fill, group)))
        expected = expected_kjt(range(B), torch.int64, False).values()
        assert torch.equal(again.get_array("sparse").values(), expected + 1 if views else expected)


def test_values_past_the_last_bag_are_not_stored(tmp_path: Path) -> None:
    """A KJT may carry a slack tail of values past its last bag; the cache keeps only the bags' values."""
    layout = KJTLayout(KEYS, max_values_per_item=9)
    for batch in GroupLoader(fill, make_group(tmp_path, layout)):
        with batch:
            exact = expected_kjt(batch.indices, torch.int64, False)
            slack = torch.cat([exact.values(), torch.full((5,), -7, dtype=torch.int64)])
            padded = KeyedJaggedTensor(list(KEYS), slack, lengths=exact.lengths(), stride=B)
            batch.cache({"sparse": padded, "label": torch.zeros(B)})
    for batch in GroupLoader(fill, make_group(tmp_path, layout)):
        with batch:
            assert_same(batch.get_array("sparse"), expected_kjt(batch.indices, torch.int64, False))


def test_without_a_location_the_kjt_lives_in_the_batch() -> None:
    layout = KJTLayout(KEYS, max_values_per_item=9)
    group = make_group(None, layout, persist=False)
    batch = next(iter(GroupLoader(fill, group)))
    kjt = expected_kjt(batch.indices, torch.int64, False)
    batch.cache({"sparse": kjt, "label": torch.zeros(B)})
    assert batch.get_array("sparse") is kjt


def test_kjts_that_do_not_fit_the_layout_are_refused_by_name(tmp_path: Path) -> None:
    layout = KJTLayout(KEYS, max_values_per_item=9)
    batch = next(iter(GroupLoader(fill, make_group(tmp_path, layout))))
    good = expected_kjt(batch.indices, torch.int64, False)
    label = torch.zeros(B)

    def refused(sparse: object, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            batch.cache({"sparse": sparse, "label": label})
        assert batch.uncached

    refused(torch.zeros(B, 3, dtype=torch.int64), r"array 'sparse' must be a KeyedJaggedTensor")
    refused(good.permute([1, 0, 2]), r"array 'sparse' must have keys \['a', 'b', 'c'\] in this order, got \['b'")
    short = KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), torch.zeros(0, dtype=torch.int64), torch.zeros(6, dtype=torch.int32), stride=2
    )
    refused(short, "array 'sparse' must have stride 4 \\(the batch size\\) for every key, got 2")
    as_int32 = KeyedJaggedTensor.from_lengths_sync(list(KEYS), good.values().int(), good.lengths(), stride=B)
    refused(as_int32, "array 'sparse' must hold ids of dtype torch.int64, got torch.int32")
    weighted = expected_kjt(batch.indices, torch.int64, True)
    refused(weighted, r"array 'sparse' must be unweighted \(KJTLayout weighted=False\)")
    batch64 = next(iter(GroupLoader(fill, make_group(tmp_path / "w", KJTLayout(KEYS, 9, weighted=True)))))
    doubles = KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), good.values(), good.lengths(), torch.ones(good.values().numel(), dtype=torch.float64), stride=B
    )
    with pytest.raises(ValueError, match="array 'sparse' must have float32 weights \\(as stored\\), got torch.float64"):
        batch64.cache({"sparse": doubles, "label": label})
    lengths = torch.zeros(3 * B, dtype=torch.int32)
    lengths[[2, 6, 10]] = torch.tensor([3, 4, 3], dtype=torch.int32)  # item 2 holds 10 ids, one more than allowed
    crowded = KeyedJaggedTensor.from_lengths_sync(list(KEYS), torch.zeros(10, dtype=torch.int64), lengths, stride=B)
    refused(crowded, "array 'sparse': item 2 of the batch holds 10 ids, more than max_values_per_item=9")
    batch.cache({"sparse": good, "label": label})  # the same batch caches once it fits
    assert_same(batch.get_array("sparse"), good)


def test_bad_layouts_and_mismatched_caches_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keys must be a non-empty sequence of str"):
        KJTLayout((), 3)
    with pytest.raises(ValueError, match=r"keys must be distinct non-empty str, got keys=\['a', 'a'\]"):
        KJTLayout(("a", "a"), 3)
    with pytest.raises(ValueError, match="max_values_per_item must be a positive int, got max_values_per_item=0"):
        KJTLayout(KEYS, 0)
    with pytest.raises(ValueError, match="dtype must be torch.int64 or torch.int32, got dtype=torch.float32"):
        KJTLayout(KEYS, 3, torch.float32)
    layout = KJTLayout(KEYS, max_values_per_item=9)
    with pytest.raises(ValueError, match=r"loader_layouts\['x'\]: a KJTLayout is a cache layout"):
        DataGroup(B, range(8), {"x": layout}, {"y": ((), torch.float32)})
    with pytest.raises(ValueError, match="cache_key_major names 'sparse', which is not a dense cache array"):
        make_group(tmp_path / "km", layout, cache_key_major=["sparse"])
    with pytest.raises(ValueError, match="cache array names collide: 'sparse''s values file is sparse.values.npy"):
        DataGroup(B, range(8), {"item": ((), torch.int64)},
                  {"sparse": layout, "sparse.values": ((), torch.float32)}, tmp_path / "collide")  # fmt: skip
    cache_all(make_group(tmp_path / "c", layout), layout)
    with pytest.raises(ValueError, match=r"holds a cache with cache_layouts=.*'kjt', \['a', 'b', 'c'\], 9"):
        make_group(tmp_path / "c", KJTLayout(KEYS, max_values_per_item=12))


def test_a_damaged_total_is_an_error_naming_the_file(tmp_path: Path) -> None:
    layout = KJTLayout(KEYS, max_values_per_item=2)
    group = make_group(tmp_path, layout)
    for batch in GroupLoader(fill, group):
        with batch:
            kjt = KeyedJaggedTensor.from_lengths_sync(
                list(KEYS), torch.arange(B, dtype=torch.int64), torch.tensor([1] * B + [0] * 2 * B), stride=B
            )
            batch.cache({"sparse": kjt, "label": torch.zeros(B)})
    totals = np.load(tmp_path / "sparse.length_per_key.npy", mmap_mode="r+")
    totals[1, 0] = 10 * B
    totals.flush()
    with pytest.raises(ValueError, match=r"sparse.length_per_key.npy batch 1: 40 ids do not fit its slot of 8"):
        list(GroupLoader(fill, make_group(tmp_path, layout)))
