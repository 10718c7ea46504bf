"""Folding raw ids into their tables: :func:`fold_ids` equals ``%`` on each of its paths (uint32, uint64, one size per
id), and an id-matrix chunk that carries raw ids with ``fold`` (how the npy rows layout is read: the Batcher folds a
batch's present ids after the transpose) gives the same elements and batches as the chunk of folded ids, whatever is
done to it on the way (slice, shuffle, concatenation, padding). The rows layout's label check names a bad row."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonrec.data.collate import collate_chunk
from tritonrec.data.criteo_npy import CriteoNPYSource, npy_paths
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec
from tritonrec.data.id_folding import fold_ids, hash_id_matrix

KEYS = 4
SPEC = ElementSpec(2, tuple(f"f{k}" for k in range(KEYS)))
SIZE_CASES = {
    "one size, 32-bit ids": ([1000] * KEYS, 2**32),
    "one size, 64-bit ids": ([1000] * KEYS, 2**62),
    "one size of 2**32": ([2**32] * KEYS, 2**40),
    "one size per key": ([7, 1000, 2**40, 1], 2**62),
}


@pytest.mark.parametrize("ids_high", [1, 2**31, 2**32, 2**32 + 1, 2**63 - 1])
@pytest.mark.parametrize("size", [1, 3, 50_000, 2**32 - 1, 2**32, 2**40])
def test_fold_ids_is_modulo(ids_high: int, size: int) -> None:
    rng = np.random.default_rng(size % 1000 + ids_high % 997)
    ids = rng.integers(0, ids_high, 500, dtype=np.int64)
    ids[:2] = [0, ids_high - 1]
    want = ids % size
    assert fold_ids(ids, np.int64(size)).tolist() == want.tolist()
    assert fold_ids(ids, np.full(KEYS, size), highest=int(ids.max())).tolist() == want.tolist()


def test_fold_ids_one_size_per_id_and_empty() -> None:
    ids = np.array([10, 11, 2**40 + 5, 7], np.int64)
    sizes = np.array([3, 5, 2**20, 7], np.int64)
    assert fold_ids(ids, sizes).tolist() == (ids % sizes).tolist()
    assert fold_ids(np.zeros(0, np.int64), np.int64(5)).shape == (0,)
    assert fold_ids(np.zeros(0, np.int64), sizes).shape == (0,)
    assert hash_id_matrix(np.zeros((0, 4), np.int64), sizes).shape == (0, 4)
    assert fold_ids(np.array([5], np.int32), np.int64(3)).dtype == np.int64


@pytest.mark.parametrize("case", SIZE_CASES)
def test_hash_id_matrix_is_modulo_with_minus_one(case: str) -> None:
    sizes, high = SIZE_CASES[case]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, high, (200, KEYS), dtype=np.int64)
    raw[rng.random(raw.shape) < 0.2] = -1
    raw[0] = [-(2**40), -2, -1, 0]  # any negative id is missing
    num_embeddings = np.asarray(sizes, np.int64)
    want = np.where(raw < 0, -1, raw % num_embeddings)
    assert np.array_equal(hash_id_matrix(raw, num_embeddings), want)
    assert np.array_equal(hash_id_matrix(raw, num_embeddings, highest=int(raw.max())), want)


def _chunks(case: str, rows: int, missing: float, seed: int) -> tuple[ElementChunk, ElementChunk]:
    """The same samples twice: raw ids with ``fold``, and the ids folded beforehand."""
    sizes, high = SIZE_CASES[case]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, high, (rows, KEYS), dtype=np.int64)
    raw[rng.random(raw.shape) < missing] = -1
    dense = rng.random((rows, SPEC.dense_dim), dtype=np.float32)
    labels = rng.integers(0, 2, rows).astype(np.float32)
    fold = np.asarray(sizes, np.int64)
    folded = ElementChunk.from_id_matrix(dense, hash_id_matrix(raw, fold), labels)
    return ElementChunk.from_id_matrix(dense, raw, labels, fold=fold), folded


def _assert_same_batch(got: ElementChunk, want: ElementChunk, batch_size: int) -> None:
    a, b = collate_chunk(got, SPEC, batch_size), collate_chunk(want, SPEC, batch_size)
    for name in ("values", "lengths", "offsets"):
        x, y = getattr(a.sparse_features, name)(), getattr(b.sparse_features, name)()
        assert torch.equal(x, y) and x.dtype == y.dtype, name
    assert a.sparse_features.length_per_key() == b.sparse_features.length_per_key()
    assert a.sparse_features.stride() == batch_size
    for name in ("dense_features", "labels", "valid_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(sorted(SIZE_CASES)),
    rows=st.integers(1, 30),
    padding=st.sampled_from([0, 0, 5]),
    missing=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_raw_chunk_with_fold_collates_like_the_folded_chunk(
    case: str, rows: int, padding: int, missing: float, seed: int
) -> None:
    raw, folded = _chunks(case, rows, missing, seed)
    _assert_same_batch(raw, folded, rows + padding)
    assert np.array_equal(raw.ids, folded.ids) and np.array_equal(raw.lengths, folded.lengths)
    assert np.array_equal(raw.offsets, folded.offsets)


def test_fold_survives_slice_take_and_concat() -> None:
    raw, folded = _chunks("one size, 32-bit ids", 40, 0.2, 0)
    order = np.random.default_rng(1).permutation(40)
    assert raw.slice(3, 17).fold is raw.fold and raw.take(order).fold is raw.fold
    _assert_same_batch(raw.slice(3, 17), folded.slice(3, 17), 16)
    _assert_same_batch(raw.take(order), folded.take(order), 40)
    joined = ElementChunk.concat([raw.slice(0, 10), raw.slice(10, 40)])
    assert joined.fold is raw.fold  # still raw ids: folded once, per batch
    _assert_same_batch(joined, folded, 40)
    # parts that fold differently (or not at all) are folded before they are joined
    mixed = ElementChunk.concat([raw.slice(0, 10), folded.slice(10, 40)])
    assert mixed.fold is None and np.array_equal(mixed.id_matrix, folded.id_matrix)
    other_sizes = ElementChunk.from_id_matrix(raw.dense, raw.id_matrix, raw.labels, fold=np.full(KEYS, 7))
    mixed = ElementChunk.concat([raw.slice(0, 10), other_sizes.slice(10, 40)])
    assert mixed.fold is None
    assert np.array_equal(mixed.id_matrix[10:], hash_id_matrix(raw.id_matrix[10:], np.full(KEYS, 7)))


def test_ids_below_every_table_are_not_divided() -> None:
    """A batch whose ids all lie below the smallest table size is handed out as read (the fold is skipped)."""
    ids = np.array([[0, 5, -1, 6]], np.int64)
    chunk = ElementChunk.from_id_matrix(np.zeros((1, 2), np.float32), ids, np.zeros(1, np.float32), np.full(KEYS, 7))
    assert collate_chunk(chunk, SPEC, 2).sparse_features.values().tolist() == [0, 5, 6]


def _write_rows_day(prefix: Path, labels: np.ndarray) -> None:
    rows = labels.shape[0]
    dense, sparse, label_path = npy_paths(prefix)
    np.save(dense, np.zeros((rows, SPEC.dense_dim), np.float32))
    np.save(sparse, np.arange(rows * KEYS, dtype=np.int64).reshape(rows, KEYS) * 1000)
    np.save(label_path, labels)


@pytest.mark.parametrize(
    ("labels", "bad"),
    [(np.array([0, 1, 2, 1], np.int32), "2.0"), (np.array([0, -1, 1, 0], np.int64), "-1.0"),
     (np.array([0.0, 1.0, 0.5, 1.0], np.float32), "0.5")],
)  # fmt: skip
def test_rows_layout_bad_label_names_its_row(tmp_path: Path, labels: np.ndarray, bad: str) -> None:
    prefix = tmp_path / "day"
    _write_rows_day(prefix, labels)
    row = int(np.flatnonzero((labels != 0) & (labels != 1))[0])
    with pytest.raises(ValueError, match=re.escape(f"{prefix}_labels.npy row {row}: labels must be 0 or 1, got {bad}")):
        list(CriteoNPYSource(prefix, 999).iter_chunks())


def test_rows_layout_batches_fold_raw_ids(tmp_path: Path) -> None:
    prefix = tmp_path / "day"
    _write_rows_day(prefix, np.array([0, 1, 1, 0, 1], np.int32))
    source = CriteoNPYSource(prefix, [999, 7, 2**40, 1])
    (chunk,) = list(source.iter_chunks())
    raw = np.load(npy_paths(prefix)[1])
    want = raw % np.array([999, 7, 2**40, 1])
    assert np.array_equal(chunk.folded_id_matrix(), want)
    values = collate_chunk(chunk, source.element_spec, 8).sparse_features.values()
    assert values.tolist() == want.T.reshape(-1).tolist()


@pytest.mark.parametrize(("rows", "padding"), [(315, 0), (316, 0), (700, 20), (945, 1)])
@pytest.mark.parametrize(
    ("ids_high", "missing"),
    [(2**40, 0.1), (2**32, 0.1), (2**32, 0.0), (2**40, 0.0)],
    ids=["64-bit ids, empty bags", "32-bit ids, empty bags", "32-bit ids, no empty bag", "64-bit ids, no empty bag"],
)
def test_blocked_transpose_spans_blocks(rows: int, padding: int, ids_high: int, missing: float) -> None:
    """26 keys: the transposing copy runs in blocks of 315 rows; rows on both sides of block ends, padding after. With
    32-bit ids and no empty bag (torchrec's files) the ids are folded before the transpose, as uint32."""
    spec = ElementSpec(1, tuple(f"cat_{k}" for k in range(26)))
    rng = np.random.default_rng(rows)
    raw = rng.integers(0, ids_high, (rows, 26), dtype=np.int64)
    raw[rng.random(raw.shape) < missing] = -1
    fold = np.full(26, 50_000, np.int64)
    chunk = ElementChunk.from_id_matrix(np.zeros((rows, 1), np.float32), raw, np.zeros(rows, np.float32), fold)
    kjt = collate_chunk(chunk, spec, rows + padding).sparse_features
    key_major = np.full((26, rows + padding), -1, np.int64)
    key_major[:, :rows] = raw.T
    present = key_major >= 0
    assert kjt.values().tolist() == (key_major[present] % 50_000).tolist()
    assert kjt.lengths().tolist() == present.reshape(-1).astype(int).tolist()


def test_uint64_ids_beyond_int64_are_folded_not_dropped() -> None:
    """uint64 ids >= 2**63 wrapped negative in the transposing copy and became empty bags."""
    raw = np.array([[2**64 - 1, 2**63, 5, 2**63 + 7]], np.uint64)
    sizes = np.array([1000, 7, 2**40, 3], np.int64)
    chunk = ElementChunk.from_id_matrix(np.zeros((1, 2), np.float32), raw, np.zeros(1, np.float32), sizes)
    kjt = collate_chunk(chunk, SPEC, 2).sparse_features
    assert kjt.values().tolist() == [int(v) % int(s) for v, s in zip(raw[0], sizes, strict=True)]
    assert kjt.lengths().tolist() == [1, 0, 1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="do not fit int64 and no table sizes fold them"):
        collate_chunk(ElementChunk.from_id_matrix(np.zeros((1, 2), np.float32), raw, np.zeros(1, np.float32)), SPEC, 1)
