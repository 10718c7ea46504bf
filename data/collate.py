"""Collating: elements or an :class:`ElementChunk` -> one padded :class:`Batch` (dense, KJT, labels, valid mask).

Kept apart from :mod:`tritonrec.data.batcher` (which owns the stream position, the statistics and the state): these
functions are stateless, and the loaders, the batch cache and the benchmarks call them directly. A chunk whose ids
are key-major rows, an id matrix or jagged per-sample ids is turned into the KJT without one Python object per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tritonrec.data.batch import Batch
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec, RecElement
from tritonrec.data.id_folding import fold_ids, fold_narrow, folds_narrow
from tritonrec.data.key_major import KeyMajorRows
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


def collate(elements: list[RecElement], spec: ElementSpec, batch_size: int, first_index: int = 0) -> Batch:
    """``n <= batch_size`` elements -> one Batch of ``batch_size`` rows, the last ``batch_size - n`` padding."""
    return collate_chunk(chunk_from_elements(elements, spec, first_index), spec, batch_size)


def chunk_from_elements(elements: list[RecElement], spec: ElementSpec, first_index: int = 0) -> ElementChunk:
    """Stack elements into one :class:`ElementChunk`, naming the first bad element (its index in the stream)."""
    n = len(elements)
    for i, element in enumerate(elements):
        if not isinstance(element, RecElement):
            raise TypeError(f"element {first_index + i} must be a RecElement, got {type(element).__name__}")
    try:
        dense = np.stack([e.dense for e in elements]).astype(np.float32, copy=False)
        lengths = np.stack([e.sparse_lengths for e in elements]).astype(np.int64, copy=False)
    except ValueError:
        _raise_shape_mismatch(elements, spec, first_index)
        raise
    if dense.shape[1:] != (spec.dense_dim,) or lengths.shape[1:] != (len(spec.sparse_keys),):
        _raise_shape_mismatch(elements, spec, first_index)
    labels = np.fromiter((e.label for e in elements), dtype=np.float32, count=n)
    ids = np.concatenate([e.sparse_ids for e in elements])
    if not np.issubdtype(ids.dtype, np.integer):
        i = next(i for i, e in enumerate(elements) if not np.issubdtype(np.asarray(e.sparse_ids).dtype, np.integer))
        dtype = np.asarray(elements[i].sparse_ids).dtype
        raise TypeError(f"element {first_index + i} has sparse_ids of dtype {dtype}, not an integer dtype")
    id_counts = np.fromiter((e.sparse_ids.shape[0] for e in elements), dtype=np.int64, count=n)
    mismatch = np.flatnonzero(id_counts != lengths.sum(1))
    if mismatch.size:
        i = int(mismatch[0])
        raise ValueError(
            f"element {first_index + i} has {id_counts[i]} sparse_ids but its sparse_lengths "
            f"{elements[i].sparse_lengths.tolist()} sum to {int(lengths[i].sum())}"
        )
    if (lengths < 0).any():
        i = int(np.flatnonzero((lengths < 0).any(1))[0])
        raise ValueError(f"element {first_index + i} has negative sparse_lengths {elements[i].sparse_lengths.tolist()}")
    return ElementChunk(dense, ids.astype(np.int64, copy=False), lengths, labels)


def collate_chunk(chunk: ElementChunk, spec: ElementSpec, batch_size: int) -> Batch:
    """``n <= batch_size`` stacked samples -> one Batch of ``batch_size`` rows, the last ``batch_size - n`` padding.

    Each chunk layout has its own way to the KJT's key-major values: key-major chunks concatenate per-feature
    slices, id-matrix chunks transpose and drop the empty bags, jagged chunks gather (bag ``(f, b)`` starts at its
    sample-major offset).
    """
    n, num_keys = len(chunk), len(spec.sparse_keys)
    if n > batch_size:
        raise ValueError(f"a chunk of {n} samples does not fit batch_size={batch_size}")
    if chunk.key_major is not None:
        sparse_shape = (n, chunk.key_major.store.lengths.shape[0])
    else:
        sparse_shape = (chunk.id_matrix if chunk.id_matrix is not None else chunk.lengths).shape
    if chunk.dense.shape != (n, spec.dense_dim) or sparse_shape != (n, num_keys):
        raise ValueError(
            f"chunk arrays dense {chunk.dense.shape} and lengths/id matrix {sparse_shape} do not fit the element "
            f"spec (dense_dim={spec.dense_dim}, {num_keys} sparse keys)"
        )
    if n == batch_size:  # no padding: each part is one converting copy (the common case, every batch but a last)
        dense = np.array(chunk.dense, np.float32, order="C")
        labels = np.array(chunk.labels, np.float32)
        valid = np.ones(batch_size, np.bool_)
    else:  # padding rows are zero
        dense = np.zeros((batch_size, spec.dense_dim), np.float32)
        labels = np.zeros(batch_size, np.float32)
        dense[:n] = chunk.dense
        labels[:n] = chunk.labels
        valid = np.arange(batch_size) < n
    if chunk.key_major is not None:
        sparse = _kjt_from_key_major(chunk.key_major, spec.sparse_keys, batch_size)
    elif chunk.id_matrix is not None:
        sparse = _kjt_from_id_matrix(chunk.id_matrix, spec.sparse_keys, batch_size, chunk.fold)
    else:
        sparse = _kjt_from_jagged(chunk, spec.sparse_keys, batch_size)
    # every part was built here to the spec's shapes and dtypes (checked above): no re-validation per batch
    return Batch._trusted(torch.from_numpy(dense), sparse, torch.from_numpy(labels), torch.from_numpy(valid))


def _kjt_from_jagged(chunk: ElementChunk, keys: tuple[str, ...], batch_size: int) -> KeyedJaggedTensor:
    if not np.issubdtype(chunk.ids.dtype, np.integer):
        raise TypeError(f"chunk ids must have an integer dtype, got {chunk.ids.dtype}")
    n, num_keys = len(chunk), len(keys)
    lengths = np.zeros((batch_size, num_keys), dtype=np.int64)
    lengths[:n] = chunk.lengths
    ids = chunk.ids.astype(np.int64, copy=False)
    if ids.shape[0] != int(lengths.sum()) or (lengths < 0).any():
        raise ValueError(f"chunk holds {ids.shape[0]} ids but its lengths (some negative?) sum to {int(lengths.sum())}")
    starts = np.cumsum(lengths.reshape(-1)) - lengths.reshape(-1)  # sample-major start of bag (b, f)
    lengths_key_major = lengths.T.reshape(-1)
    starts_key_major = starts.reshape(batch_size, num_keys).T.reshape(-1)
    out_starts = np.cumsum(lengths_key_major) - lengths_key_major
    gather = np.repeat(starts_key_major - out_starts, lengths_key_major) + np.arange(ids.shape[0])
    # checked above (id count, no negative length): consistent by construction, so no re-validation
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(ids[gather]), None, torch.from_numpy(lengths_key_major.astype(np.int32)),
        batch_size, length_per_key=lengths.sum(0).tolist(),
    )  # fmt: skip


def kjt_from_id_matrix(keys: Sequence[str], ids: torch.Tensor | np.ndarray) -> KeyedJaggedTensor:
    """``ids [B, F]`` (one id per sample and feature, negative: an empty bag) -> a KJT of ``F`` keys and stride ``B``
    whose bags hold 0 or 1 id: the form of hashed Criteo-like ids kept in a batch cache. One transposing copy and,
    when some bag is empty, one compaction (vectorised numpy, no loop over rows)."""
    if not isinstance(ids, (torch.Tensor, np.ndarray)) or ids.ndim != 2:
        raise ValueError(f"ids must be a 2-D [batch, features] tensor, got {getattr(ids, 'shape', type(ids))}")
    matrix = ids.numpy(force=True) if isinstance(ids, torch.Tensor) else ids
    if not np.issubdtype(matrix.dtype, np.integer):
        raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
    keys = tuple(keys)
    if len(keys) != matrix.shape[1] or len(set(keys)) != len(keys):
        raise ValueError(f"keys must name the {matrix.shape[1]} columns of ids once each, got {list(keys)}")
    return _kjt_from_id_matrix(matrix, keys, matrix.shape[0])


_TRANSPOSE_BYTES = 65536  # ids read per block of the transposing copy (~315 rows of 26 int64 ids: measured best)


def _kjt_from_id_matrix(
    id_matrix: np.ndarray, keys: tuple[str, ...], batch_size: int, fold: np.ndarray | None = None
) -> KeyedJaggedTensor:
    """``[n, F]`` ids (negative: empty bag), ``n <= batch_size`` -> a KJT of stride ``batch_size`` (padding rows
    empty): key-major is one transposing copy (in blocks of rows that stay in the core's cache while their columns
    are written: 1.3x faster than one strided copy), and the present ids are one compaction away (``np.compress``: a
    boolean index or a strided gather is slower). Without an empty bag the transpose is the values and every length
    is 1. ``fold``: the table sizes ``[F]`` the raw ids are folded into, after the compaction (the empty bags' ids
    are never divided).

    The parts are consistent by construction (one id per present bag, lengths 0 or 1), so the KJT is built without
    re-checking them."""
    if not np.issubdtype(id_matrix.dtype, np.integer):
        raise TypeError(f"chunk id_matrix must have an integer dtype, got {id_matrix.dtype}")
    n, num_keys = id_matrix.shape[0], len(keys)
    if id_matrix.dtype == np.uint64 and id_matrix.size and int(id_matrix.max()) >= 2**63:
        # beyond int64 (the KJT's values), where the transposing copy would wrap them negative (empty bags): folded
        # here, in uint64 (a rare case: one division per id)
        if fold is None:
            raise ValueError(f"ids up to {int(id_matrix.max())} do not fit int64 and no table sizes fold them")
        id_matrix, fold = (id_matrix % fold.astype(np.uint64)).astype(np.int64), None
    highest = None
    if fold is not None and id_matrix.size:
        # One pass (it also reads the rows in order, which makes the transposing read below faster): the OR of the
        # ids is negative when an id is (an empty bag), else it bounds them from above (max <= OR < 2 * max), which
        # is all the fold needs to know (ids below every table size are not divided; below 2**32, fold as uint32).
        bits = int(np.bitwise_or.reduce(id_matrix, axis=None))
        highest = bits if bits >= 0 else int(id_matrix.max())
        if bits >= 0 and bits >= fold.min() and folds_narrow(fold, bits):
            return _kjt_folded_without_empty_bags(id_matrix, keys, batch_size, int(fold[0]))
        fold = fold if highest >= fold.min() else None  # else every id already lies in its table
    elif fold is not None:
        fold = None  # no id to fold
    # a short last batch's padding rows are empty bags
    key_major = np.empty((num_keys, batch_size), np.int64) if n == batch_size else np.full((num_keys, batch_size), -1)
    block = max(1, _TRANSPOSE_BYTES // (8 * num_keys))
    for start in range(0, n, block):
        stop = min(start + block, n)
        key_major[:, start:stop] = id_matrix[start:stop].T
    present = key_major >= 0
    length_per_key = present.sum(1, dtype=np.int32).tolist()
    if sum(length_per_key) == present.size:
        values, lengths = key_major.reshape(-1), np.ones(present.size, np.int32)
    else:
        values = np.compress(present.reshape(-1), key_major.reshape(-1))
        lengths = present.reshape(-1).astype(np.int32)
    if fold is not None and values.size:
        values = fold_ids(values, fold if (fold == fold[0]).all() else np.repeat(fold, length_per_key), highest)
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(values), None, torch.from_numpy(lengths), batch_size, None, length_per_key
    )


def _kjt_folded_without_empty_bags(
    id_matrix: np.ndarray, keys: tuple[str, ...], batch_size: int, size: int
) -> KeyedJaggedTensor:
    """:func:`_kjt_from_id_matrix` where no bag is empty (every id >= 0, as in torchrec's npy files, whose missing id
    is 0) and the ids fold by one table size, ids and size below ``2**32``: folded as uint32 in the sample-major
    matrix, then widened to int64 by the transposing copy itself. Two passes over the ids fewer than folding the
    transposed values (no mask, no narrowing copy of them): ~1.4x on a 2048 x 26 batch."""
    n, num_keys = id_matrix.shape
    folded = fold_narrow(id_matrix, size)
    values = np.empty((num_keys, n), np.int64)
    block = max(1, _TRANSPOSE_BYTES // (8 * num_keys))
    for start in range(0, n, block):
        values[:, start : start + block] = folded[start : start + block].T
    if n == batch_size:
        lengths = np.ones(num_keys * batch_size, np.int32)
    else:  # padding rows are empty bags
        lengths = np.zeros((num_keys, batch_size), np.int32)
        lengths[:, :n] = 1
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(values.reshape(-1)), None, torch.from_numpy(lengths.reshape(-1)), batch_size,
        None, [n] * num_keys,
    )  # fmt: skip


def _kjt_from_key_major(rows: KeyMajorRows, keys: tuple[str, ...], batch_size: int) -> KeyedJaggedTensor:
    """Key-major rows -> a KJT of stride ``batch_size``: the values are the rows' per-feature slices concatenated,
    the lengths their bag lengths (padding rows empty). The store was validated when opened (lengths consistent with
    the ids), so the KJT is built without re-checking."""
    values, length_per_key = rows.values()
    bag_lengths = rows.store.lengths[:, rows.start : rows.stop]
    if len(rows) == batch_size:
        lengths = bag_lengths.astype(np.int32, order="C")  # key-major whatever the file's memory order
    else:
        lengths = np.zeros((len(keys), batch_size), np.int32)
        lengths[:, : len(rows)] = bag_lengths
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(values), None, torch.from_numpy(lengths.reshape(-1)), batch_size, None,
        length_per_key,
    )  # fmt: skip


def _raise_shape_mismatch(elements: list[RecElement], spec: ElementSpec, first_index: int) -> None:
    """Name the first element whose dense or sparse_lengths shape differs from ``spec``."""
    expected_dense, expected_lengths = (spec.dense_dim,), (len(spec.sparse_keys),)
    for i, e in enumerate(elements):
        if np.shape(e.dense) != expected_dense or np.shape(e.sparse_lengths) != expected_lengths:
            raise ValueError(
                f"element {first_index + i} has dense shape {np.shape(e.dense)} and sparse_lengths shape "
                f"{np.shape(e.sparse_lengths)}; the element spec expects {expected_dense} and {expected_lengths}"
            )
