"""Sparse ids stored key-major on disk, so that a range of rows becomes a KJT's values with one copy.

A KJT holds its values key-major (every id of feature 0 in the batch, then feature 1's, ...). Row-major storage
(``[N, F]``, one row per sample) makes every batch pay a transpose, a mask of the missing ids and a compaction; this
layout pays them once, when the files are written (:func:`write_key_major`). For a day ``prefix``:

* ``{prefix}_ids.npy`` ``[P]`` int32 (int64 for tables over ``2**31`` rows): the present ids, feature after feature
  (feature ``f``'s ids in row order);
* ``{prefix}_id_lengths.npy`` ``[F, N]`` uint8: how many ids row ``r`` holds for feature ``f`` (0: an empty bag);
* ``{prefix}_id_index.npy`` ``[F, ceil(N / 64) + 1]`` int64: where feature ``f``'s ids for row ``min(64 j, N)``
  start in the ids file (row ``N``: where they end);
* ``{prefix}_num_embeddings.npy`` ``[F]`` int64: every id of feature ``f`` lies in ``[0, num_embeddings[f])``.

Rows ``[start, stop)`` then hold, for feature ``f``, the ids between two positions (:meth:`KeyMajorStore.positions`:
one index entry, plus the lengths of at most 63 rows when ``start`` is not a multiple of 64), and a batch's values
are those 26 slices concatenated. :meth:`KeyMajorStore.open` memory-maps the files and validates them once, in one
vectorised pass per array: ids in range, index consistent with the lengths (so every range's lengths sum to its
number of ids), shapes and dtypes. Batches read from a validated store are not checked again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

INDEX_ROWS = 64  # rows between two entries of the index


def key_major_paths(prefix: str | Path) -> tuple[Path, Path, Path, Path]:
    """The ``(ids, id_lengths, id_index, num_embeddings)`` files of one day."""
    parts = ("ids", "id_lengths", "id_index", "num_embeddings")
    return tuple(Path(f"{prefix}_{part}.npy") for part in parts)  # type: ignore[return-value]


def write_key_major(prefix: str | Path, id_matrix: np.ndarray, num_embeddings: np.ndarray) -> None:
    """Write ``id_matrix [N, F]`` (ids already in ``[0, num_embeddings[f])``, -1 for an empty bag) key-major; the
    ids as int32 when every table has at most ``2**31`` rows (half the bytes to read per batch), else int64."""
    present = np.ascontiguousarray(id_matrix.T >= 0)  # [F, N], each feature's rows contiguous
    narrow = int(np.max(num_embeddings, initial=1)) <= 2**31
    ids = id_matrix.T[present].astype(np.int32 if narrow else np.int64)
    lengths = present.astype(np.uint8)
    num_rows = id_matrix.shape[0]
    checkpoints = np.minimum(np.arange(_index_columns(num_rows)) * INDEX_ROWS, num_rows)
    totals = np.zeros((lengths.shape[0], num_rows + 1), np.int64)  # ids of feature f in rows [0, r)
    np.cumsum(lengths, axis=1, dtype=np.int64, out=totals[:, 1:])
    feature_starts = np.cumsum(totals[:, -1]) - totals[:, -1]
    index = feature_starts[:, None] + totals[:, checkpoints]
    for array, path in zip((ids, lengths, index, num_embeddings), key_major_paths(prefix), strict=True):
        np.save(path, array)


def _index_columns(num_rows: int) -> int:
    return -(-num_rows // INDEX_ROWS) + 1


class KeyMajorStore:
    """One day's ids in the key-major layout (module docstring), memory-mapped and validated by :meth:`open`."""

    def __init__(self, prefix: str, ids: np.ndarray, lengths: np.ndarray, index: np.ndarray, limits: np.ndarray):
        self.prefix, self.ids, self.lengths, self.index, self.num_embeddings = prefix, ids, lengths, index, limits
        self._last: tuple[int, np.ndarray] | None = None  # the last row :meth:`positions` summed lengths for

    @property
    def num_rows(self) -> int:
        return self.lengths.shape[1]

    @classmethod
    def open(cls, prefix: str | Path) -> KeyMajorStore:
        ids_path, lengths_path, index_path, limits_path = key_major_paths(prefix)
        for path in key_major_paths(prefix):
            if not path.is_file():
                raise ValueError(f"prefixes: prefix {str(prefix)!r} has no file {str(path)!r}")
        # plain ndarray views of the maps: slicing an np.memmap goes through Python code
        ids, lengths, index = (np.load(p, mmap_mode="r").view(np.ndarray) for p in (ids_path, lengths_path, index_path))
        limits = np.load(limits_path)
        if ids.ndim != 1 or ids.dtype not in (np.int32, np.int64):
            raise ValueError(f"{ids_path} must hold int32 or int64 ids [P], got shape {ids.shape} {ids.dtype}")
        if lengths.ndim != 2 or lengths.dtype != np.uint8:
            raise ValueError(
                f"{lengths_path} must hold uint8 bag lengths [F, N], got shape {lengths.shape} {lengths.dtype}"
            )
        num_keys, num_rows = lengths.shape
        if index.shape != (num_keys, _index_columns(num_rows)) or index.dtype != np.int64:
            raise ValueError(
                f"{index_path} must hold int64 [{num_keys}, {_index_columns(num_rows)}] (F, ceil(N / {INDEX_ROWS}) + 1 "
                f"for {num_rows} rows), got shape {index.shape} {index.dtype}"
            )
        if limits.shape != (num_keys,) or not np.issubdtype(limits.dtype, np.integer) or (limits < 1).any():
            raise ValueError(f"{limits_path} must hold {num_keys} positive ints, got {limits!r}")
        store = cls(str(prefix), ids, lengths, index, limits.astype(np.int64))
        store._validate()
        return store

    def _validate(self) -> None:
        """One vectorised pass per array (module docstring); errors name the file and the first bad row."""
        ids_path, lengths_path, index_path, _ = key_major_paths(self.prefix)
        index, lengths = self.index, self.lengths
        num_keys, num_rows = lengths.shape
        ends = np.concatenate([index[1:, 0], [self.ids.shape[0]]])
        if index[0, 0] != 0 or (index[:, -1] != ends).any() or (np.diff(index, axis=1) < 0).any():
            raise ValueError(
                f"{index_path} is not an index of {ids_path}: each feature's positions must rise from where the "
                f"previous feature's end, starting at 0 and ending at the {self.ids.shape[0]} ids"
            )
        full = num_rows // INDEX_ROWS
        sums = lengths[:, : full * INDEX_ROWS].reshape(num_keys, full, INDEX_ROWS).sum(2, dtype=np.int64)
        if num_rows % INDEX_ROWS:
            sums = np.concatenate([sums, lengths[:, full * INDEX_ROWS :].sum(1, dtype=np.int64)[:, None]], 1)
        mismatch = np.argwhere(sums != np.diff(index, axis=1))
        if mismatch.size:
            key, block = (int(v) for v in mismatch[0])
            raise ValueError(
                f"{lengths_path} and {index_path} disagree: feature {key} has {int(sums[key, block])} ids in rows "
                f"[{block * INDEX_ROWS}, {min((block + 1) * INDEX_ROWS, num_rows)}) by its lengths, "
                f"{int(index[key, block + 1] - index[key, block])} by the index"
            )
        self._check_id_range()

    def _check_id_range(self) -> None:
        starts = self.index[:, 0]
        counts = np.concatenate([starts[1:], [self.ids.shape[0]]]) - starts
        keys = np.flatnonzero(counts > 0)
        if not keys.size:
            return
        highest = np.maximum.reduceat(self.ids, starts[keys])
        lowest = np.minimum.reduceat(self.ids, starts[keys])
        bad = np.flatnonzero((lowest < 0) | (highest >= self.num_embeddings[keys]))
        if bad.size:
            key = int(keys[bad[0]])
            segment = self.ids[starts[key] : starts[key] + counts[key]]
            where = int(np.flatnonzero((segment < 0) | (segment >= self.num_embeddings[key]))[0])
            row = int(np.searchsorted(np.cumsum(self.lengths[key], dtype=np.int64), where, side="right"))
            raise ValueError(
                f"{key_major_paths(self.prefix)[0]}: feature {key} has id {int(segment[where])} at row {row}, outside "
                f"[0, {int(self.num_embeddings[key])}) (the num_embeddings of {key_major_paths(self.prefix)[3]})"
            )

    def positions(self, row: int) -> np.ndarray:
        """``[F]`` int64: where each feature's ids for ``row`` (and later rows) start in :attr:`ids`."""
        block, within = divmod(row, INDEX_ROWS)
        if not within:
            return self.index[:, block]  # a view of the read-only map
        last = self._last  # one batch's end is the next one's start: sum its lengths once (one read: thread-safe)
        if last is not None and last[0] == row:
            return last[1]
        start = self.index[:, block] + self.lengths[:, block * INDEX_ROWS : row].sum(1, dtype=np.int64)
        start.flags.writeable = False  # shared by the rows that end and start here
        self._last = (row, start)
        return start

    def rows(self, start: int, stop: int) -> KeyMajorRows:
        return KeyMajorRows(self, start, stop, self.positions(start), self.positions(stop))


class KeyMajorRows:
    """Rows ``[start, stop)`` of a :class:`KeyMajorStore` (views, nothing copied), with each feature's first and
    one-past-last position in the store's ids (``begin``, ``end`` ``[F]``)."""

    __slots__ = ("begin", "end", "start", "stop", "store")

    def __init__(self, store: KeyMajorStore, start: int, stop: int, begin: np.ndarray, end: np.ndarray) -> None:
        self.store, self.start, self.stop, self.begin, self.end = store, start, stop, begin, end

    def __len__(self) -> int:
        return self.stop - self.start

    def slice(self, start: int, stop: int) -> KeyMajorRows:
        """Rows ``[start, stop)`` of these rows."""
        begin = self.begin if start == 0 else self.store.positions(self.start + start)
        end = self.end if self.start + stop == self.stop else self.store.positions(self.start + stop)
        return KeyMajorRows(self.store, self.start + start, self.start + stop, begin, end)

    def values(self) -> tuple[np.ndarray, list[int]]:
        """``(values [N] int64 key-major, length_per_key)``: the values are one copy (the features' slices
        concatenated, widened to int64 as they are copied), ``length_per_key`` each feature's number of ids."""
        ids = self.store.ids
        segments = [ids[b:e] for b, e in zip(self.begin.tolist(), self.end.tolist(), strict=True)]
        return np.concatenate(segments, dtype=np.int64), (self.end - self.begin).tolist()

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values [N] int64 key-major, lengths [F, n] uint8, length_per_key [F] int64)``: the values are one copy
        (:meth:`values`), the lengths a view of the map."""
        values, _ = self.values()
        return values, self.store.lengths[:, self.start : self.stop], self.end - self.begin
