"""The key-major npy layout (``criteo_tsv_to_npy(..., num_embeddings=...)``): its batches are bit-equal to those of
the rows layout written from the same TSV (missing ids, short batches, batch sizes that do not divide 64, two days,
shuffling, ranks, resume mid-block), it reads with table sizes that divide its own, and every inconsistency in its
files is rejected when opened, naming the file and the row."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy, npy_paths
from tritonrec.data.key_major import INDEX_ROWS, KeyMajorStore, key_major_paths

HASH = 1000
ROWS = (150, 71)  # two days; 150 and 71 are not multiples of 64


def _lines(count: int, rng: np.random.Generator) -> list[str]:
    counts = rng.integers(-3, 10**6, (count, 13))
    ids = rng.integers(0, 2**40, (count, 26))
    missing = rng.random((count, 26)) < rng.choice([0.0, 0.1, 0.9], (1, 26))  # some features never, some mostly
    return [
        "\t".join([str(i % 2), *(str(c) if c % 7 else "" for c in counts[i]),
                   *("" if m else f"{v:x}" for v, m in zip(ids[i], missing[i], strict=True))])
        for i in range(count)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("key_major")
    rng = np.random.default_rng(7)
    out: dict[str, list[Path]] = {"rows": [], "hashed": [], "tsv": []}
    for day, count in enumerate(ROWS):
        tsv = root / f"day_{day}.tsv"
        tsv.write_text("\n".join(_lines(count, rng)) + "\n")
        out["tsv"].append(tsv)
        for layout, sizes in (("rows", None), ("hashed", HASH)):
            prefix = root / layout / f"day_{day}"
            assert criteo_tsv_to_npy(tsv, prefix, num_embeddings=sizes) == count
            out[layout].append(prefix)
    return out


def _assert_batches_equal(mine: list[Batch], want: list[Batch]) -> None:
    assert len(mine) == len(want) > 0
    for a, b in zip(mine, want, strict=True):
        for name in ("dense_features", "labels", "valid_mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        sa, sb = a.sparse_features, b.sparse_features
        assert sa.keys() == sb.keys() and sa.stride() == sb.stride()
        assert torch.equal(sa.values(), sb.values()) and sa.values().dtype == torch.int64
        assert torch.equal(sa.lengths(), sb.lengths()) and sa.lengths().dtype == torch.int32
        assert sa.length_per_key() == sb.length_per_key() == sa.lengths().view(26, -1).sum(1).tolist()


def _batches(source: CriteoNPYSource, batch_size: int) -> list[Batch]:
    return list(Batcher(source.element_spec).process(source, batch_size))


@pytest.mark.parametrize("batch_size", [64, 100, 7, 256])
@pytest.mark.parametrize(("world_size", "shuffle_buffer"), [(1, 0), (2, 0), (1, 50), (3, 33)])
def test_batches_equal_the_rows_layout(
    days: dict[str, list[Path]], batch_size: int, world_size: int, shuffle_buffer: int
) -> None:
    for rank in range(world_size):
        options = dict(rank=rank, world_size=world_size, shuffle_buffer=shuffle_buffer, shuffle_seed=3)
        hashed = CriteoNPYSource(days["hashed"], HASH, **options)
        assert all(day.store is not None for day in hashed.days)
        _assert_batches_equal(
            _batches(hashed, batch_size), _batches(CriteoNPYSource(days["rows"], HASH, **options), batch_size)
        )


def test_positions_of_any_row_sequence(days: dict[str, list[Path]]) -> None:
    """``positions`` keeps the last row that is not a multiple of 64 (a batch's end is the next one's start): any
    order of rows, repeats included, gives each feature's count of ids before the row, in arrays nobody can change."""
    store = KeyMajorStore.open(days["hashed"][0])
    before = np.concatenate([np.zeros((26, 1), np.int64), np.cumsum(store.lengths, 1, dtype=np.int64)], 1)
    first = store.index[:, 0]
    for row in (5, 5, 64, 70, 5, 70, 70, 149, 0, 150, 128, 149):
        got = store.positions(row)
        assert np.array_equal(got, first + before[:, row]) and not got.flags.writeable


def test_elements_and_resume_mid_block(days: dict[str, list[Path]]) -> None:
    hashed, rows = CriteoNPYSource(days["hashed"], HASH), CriteoNPYSource(days["rows"], HASH)
    for position in (0, 1, INDEX_ROWS - 1, INDEX_ROWS, INDEX_ROWS + 5, ROWS[0], ROWS[0] + 3, sum(ROWS)):
        mine, want = list(hashed.iter_from(position)), list(rows.iter_from(position))
        assert len(mine) == len(want) == sum(ROWS) - position
        for a, b in zip(mine, want, strict=True):
            assert np.array_equal(a.dense, b.dense) and np.array_equal(a.sparse_ids, b.sparse_ids)
            assert np.array_equal(a.sparse_lengths, b.sparse_lengths) and a.label == b.label


def test_table_sizes_that_divide_the_written_ones(days: dict[str, list[Path]]) -> None:
    for sizes in (HASH // 4, [HASH // 2] * 25 + [HASH]):
        hashed = CriteoNPYSource(days["hashed"], sizes)
        _assert_batches_equal(_batches(hashed, 64), _batches(CriteoNPYSource(days["rows"], sizes), 64))
    with pytest.raises(ValueError, match=re.escape("holds ids hashed into num_embeddings [1000, 1000,")):
        CriteoNPYSource(days["hashed"], 300)


def test_tables_over_2_pow_31_rows_store_int64_ids(days: dict[str, list[Path]], tmp_path: Path) -> None:
    criteo_tsv_to_npy(days["tsv"][0], tmp_path / "day", num_embeddings=2**40)
    assert np.load(key_major_paths(tmp_path / "day")[0]).dtype == np.int64
    assert np.load(key_major_paths(days["hashed"][0])[0]).dtype == np.int32
    mine = _batches(CriteoNPYSource(tmp_path / "day", 2**40), 64)
    _assert_batches_equal(mine, _batches(CriteoNPYSource(days["rows"][0], 2**40), 64))


def _copy_day(source: Path, target: Path) -> Path:
    for src, dst in zip((*npy_paths(source), *key_major_paths(source)), (*npy_paths(target), *key_major_paths(target)),
                        strict=True):  # fmt: skip
        if src.is_file():
            np.save(dst, np.load(src))
    return target


def test_bad_files_are_rejected_when_opened(days: dict[str, list[Path]], tmp_path: Path) -> None:
    prefix = _copy_day(days["hashed"][0], tmp_path / "day")
    ids_path, lengths_path, index_path, limits_path = key_major_paths(prefix)
    ids, lengths, index = np.load(ids_path), np.load(lengths_path), np.load(index_path)
    feature = 3
    rows_of_feature = np.flatnonzero(lengths[feature])
    row = int(rows_of_feature[10])  # the 11th id of feature 3
    for value in (HASH, -2):
        bad = ids.copy()
        bad[index[feature, 0] + 10] = value
        np.save(ids_path, bad)
        message = f"{ids_path}: feature {feature} has id {value} at row {row}, outside [0, {HASH})"
        with pytest.raises(ValueError, match=re.escape(message)):
            CriteoNPYSource(prefix, HASH)
    np.save(ids_path, ids)
    bad_lengths = lengths.copy()
    bad_lengths[feature, 70] ^= 1  # row 70 gains or loses an id: the index of rows [64, 128) no longer agrees
    np.save(lengths_path, bad_lengths)
    with pytest.raises(ValueError, match=re.escape(f"{lengths_path} and {index_path} disagree: feature {feature} has")):
        CriteoNPYSource(prefix, HASH)
    with pytest.raises(ValueError, match=re.escape("in rows [64, 128) by its lengths")):
        CriteoNPYSource(prefix, HASH)
    np.save(lengths_path, lengths.astype(np.int32))
    with pytest.raises(ValueError, match=re.escape(f"{lengths_path} must hold uint8 bag lengths [F, N]")):
        KeyMajorStore.open(prefix)
    np.save(lengths_path, lengths)
    bad_index = index.copy()
    bad_index[0, 0] = 1
    np.save(index_path, bad_index)
    with pytest.raises(ValueError, match=re.escape(f"{index_path} is not an index of {ids_path}")):
        CriteoNPYSource(prefix, HASH)
    np.save(index_path, index[:, :-1])
    with pytest.raises(ValueError, match=re.escape(f"{index_path} must hold int64 [26, 4]")):
        CriteoNPYSource(prefix, HASH)
    np.save(index_path, index)
    labels = np.load(npy_paths(prefix)[2])
    labels[5] = 2
    np.save(npy_paths(prefix)[2], labels)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}_labels.npy row 5: labels must be 0 or 1, got 2")):
        CriteoNPYSource(prefix, HASH)
    labels[5] = 1
    np.save(npy_paths(prefix)[2], labels)
    assert len(CriteoNPYSource(prefix, HASH)) == ROWS[0]  # repaired
    limits_path.unlink()
    with pytest.raises(ValueError, match=re.escape(f"prefix '{prefix}' has no file '{limits_path}'")):
        CriteoNPYSource(prefix, HASH)
