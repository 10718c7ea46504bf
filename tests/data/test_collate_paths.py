"""The Batcher's three ways from a chunk to a KJT agree bit for bit, with each other and with a plain per-bag loop:
the id-matrix path (transpose + mask; without an empty bag, no mask at all), the key-major path and the jagged path
(a gather, through the validating KJT constructor). Also: the Criteo id hashing equals ``%`` with -1 for missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonrec.data.batcher import collate_chunk
from tritonrec.data.criteo import hash_id_matrix
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec
from tritonrec.data.key_major import KeyMajorStore, write_key_major

KEYS = 5
SPEC = ElementSpec(3, tuple(f"f{k}" for k in range(KEYS)))


def _reference(id_matrix: np.ndarray, batch_size: int) -> tuple[list[int], list[int]]:
    """Values and lengths of the KJT, bag by bag (key-major), padding rows empty."""
    values, lengths = [], []
    for key in range(KEYS):
        for row in range(batch_size):
            present = row < id_matrix.shape[0] and id_matrix[row, key] >= 0
            lengths.append(int(present))
            values.extend([int(id_matrix[row, key])] if present else [])
    return values, lengths


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    padding=st.sampled_from([0, 0, 3]),
    missing=st.sampled_from([0.0, 0.0, 0.2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_id_matrix_key_major_and_jagged_paths_agree(
    tmp_path_factory: pytest.TempPathFactory, rows: int, padding: int, missing: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    id_matrix = rng.integers(0, 50, (rows, KEYS))
    id_matrix[rng.random((rows, KEYS)) < missing] = -1
    dense = rng.random((rows, 3), dtype=np.float32)
    labels = rng.integers(0, 2, rows).astype(np.float32)
    batch_size = rows + padding
    present = id_matrix >= 0
    jagged = ElementChunk(dense, id_matrix[present], present.astype(np.int64), labels)
    prefix = tmp_path_factory.mktemp("collate") / "day"
    write_key_major(prefix, id_matrix, np.full(KEYS, 50))
    store = KeyMajorStore.open(prefix)
    chunks = {
        "id_matrix": ElementChunk.from_id_matrix(dense, id_matrix, labels),
        "key_major": ElementChunk.from_key_major(dense, store.rows(0, rows), labels),
        "jagged": jagged,
    }
    want_values, want_lengths = _reference(id_matrix, batch_size)
    for name, chunk in chunks.items():
        batch = collate_chunk(chunk, SPEC, batch_size)
        kjt = batch.sparse_features
        assert kjt.values().tolist() == want_values and kjt.values().dtype == torch.int64, name
        assert kjt.lengths().tolist() == want_lengths and kjt.lengths().dtype == torch.int32, name
        assert kjt.length_per_key() == np.reshape(want_lengths, (KEYS, -1)).sum(1).tolist(), name
        assert kjt.offsets().tolist() == np.concatenate([[0], np.cumsum(want_lengths)]).tolist(), name
        assert kjt.stride() == batch_size and batch.valid_mask.tolist() == [True] * rows + [False] * padding
        assert torch.equal(batch.dense_features[:rows], torch.from_numpy(dense)), name
        assert not batch.dense_features[rows:].any() and not batch.labels[rows:].any()
        assert torch.equal(batch.labels[:rows], torch.from_numpy(labels)), name


@pytest.mark.parametrize("sizes", [[1000] * KEYS, [7, 1000, 2**40, 3, 1]])
def test_hash_id_matrix_is_modulo_with_minus_one_for_missing(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(-(2**62), 2**62, (300, KEYS))
    raw[:, 0] = rng.integers(-3, 2**31, 300)
    raw[:3] = [-1, 0, 2**62, -7, 999]
    num_embeddings = np.asarray(sizes, dtype=np.int64)
    want = np.where(raw < 0, -1, raw % num_embeddings)
    assert np.array_equal(hash_id_matrix(raw, num_embeddings), want)


def test_key_major_chunks_concatenate_and_convert(tmp_path: Path) -> None:
    """Adjacent key-major slices join into one range; other mixes go through the jagged layout; ids and lengths of a
    key-major chunk are sample-major like every other chunk's."""
    rng = np.random.default_rng(1)
    id_matrix = rng.integers(0, 9, (100, KEYS))
    id_matrix[rng.random((100, KEYS)) < 0.3] = -1
    write_key_major(tmp_path / "day", id_matrix, np.full(KEYS, 9))
    store = KeyMajorStore.open(tmp_path / "day")
    dense, labels = np.zeros((100, 3), np.float32), np.zeros(100, np.float32)
    whole = ElementChunk.from_key_major(dense, store.rows(0, 100), labels)
    parts = [whole.slice(0, 30), whole.slice(30, 71), whole.slice(71, 100)]
    joined = ElementChunk.concat(parts)
    assert joined.key_major is not None and (joined.key_major.start, joined.key_major.stop) == (0, 100)
    mixed = ElementChunk.concat([parts[0], ElementChunk.from_id_matrix(dense[71:], id_matrix[71:], labels[71:])])
    assert mixed.key_major is None and mixed.id_matrix is None
    expected = ElementChunk.from_id_matrix(dense, id_matrix, labels)
    for chunk, rows in ((joined, slice(0, 100)), (parts[1], slice(30, 71)), (mixed, np.r_[0:30, 71:100])):
        reference = expected.take(np.arange(100)[rows])
        assert np.array_equal(chunk.ids, reference.ids) and np.array_equal(chunk.lengths, reference.lengths)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(0, 30), missing=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_kjt_from_id_matrix_matches_a_per_bag_loop(rows: int, missing: float, seed: int) -> None:
    """The public form the batch cache's users call: a tensor or an array in, the per-bag loop's KJT out."""
    from tritonrec.data import kjt_from_id_matrix

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, (rows, KEYS))
    ids[rng.random((rows, KEYS)) < missing] = -1
    values, lengths = _reference(ids, rows)
    for given_ids in (ids, torch.from_numpy(ids)):
        kjt = kjt_from_id_matrix(SPEC.sparse_keys, given_ids)
        assert kjt.keys() == list(SPEC.sparse_keys) and kjt.stride() == rows
        assert kjt.values().tolist() == values and kjt.lengths().tolist() == lengths


def test_kjt_from_id_matrix_bad_input() -> None:
    from tritonrec.data import kjt_from_id_matrix

    with pytest.raises(ValueError, match=r"ids must be a 2-D \[batch, features\] tensor, got torch.Size\(\[4\]\)"):
        kjt_from_id_matrix(["a"], torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"keys must name the 2 columns of ids once each, got \['a', 'a'\]"):
        kjt_from_id_matrix(["a", "a"], torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="ids must have an integer dtype, got torch.float32"):
        kjt_from_id_matrix(["a", "b"], torch.zeros(3, 2))
