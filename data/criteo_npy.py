"""Criteo in a preprocessed numpy format: arrays per day, read with random access.

For each ``prefix`` (e.g. ``/data/criteo/day_0``, torchrec's file naming):

* ``{prefix}_dense.npy``  ``[N, Dd]`` float32 dense features, already transformed (``log(1 + x)``, see
  :mod:`tritonrec.data.criteo`);
* ``{prefix}_labels.npy`` ``[N]`` or ``[N, 1]`` labels, 0 or 1;
* the categorical ids, in one of two layouts:

  - **rows** (torchrec's layout): ``{prefix}_sparse.npy`` ``[N, F]`` integer raw ids, a negative id marking a
    missing value (empty bag). Ids are folded into ``num_embeddings`` by modulo when read (torchrec's ``hashes``),
    so one file serves any table size: the Batcher folds a batch's present ids after putting them key-major (the
    missing ones are never divided), and skips the modulo when every id of the batch is below the smallest table
    size (it would change nothing);
  - **key-major, hashed** (:mod:`tritonrec.data.key_major`): ids already folded into the ``num_embeddings`` given
    to :func:`criteo_tsv_to_npy`, stored the KJT's way, so a batch's values are one copy. Read with those table
    sizes, or with sizes that divide them (the ids are then folded again, which gives the ids the raw file would
    give); another size is an error. Its files are validated once, when the source opens them (ids in range, index
    consistent with the bag lengths, labels 0 or 1), and batches are not checked again. A prefix with any key-major
    file is read key-major.

Arrays are memory-mapped: opening a day reads no rows (beyond the key-major validation) and ``iter_from(position)``
jumps straight to a row. Across ranks (``rank``, ``world_size``) the rows of all days, end to end, are cut into
contiguous balanced ranges (:mod:`tritonrec.data.sharding`); ``shuffle_buffer > 1`` permutes each rank's rows within
blocks of that many, differently every epoch. :func:`criteo_tsv_to_npy` writes these files from raw TSV.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonrec.data.criteo import CriteoTSVSource, resolve_num_embeddings
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec, RecElement, check_position
from tritonrec.data.id_folding import hash_id_matrix
from tritonrec.data.key_major import KeyMajorStore, key_major_paths, write_key_major
from tritonrec.data.sharding import Shard, block_shuffled, check_seed, check_shuffle_buffer, elements_of

_READ_ROWS = 4096  # rows converted per vectorised read (key-major ids folded again)
# rows-layout rows per chunk: views of the maps (only the labels are converted), so the Batcher slices a batch out of
# one chunk instead of concatenating (copying) several; a multiple of the usual batch sizes
_VIEW_ROWS = 32768


def npy_paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    """The ``(dense, sparse, labels)`` files of one day."""
    return tuple(Path(f"{prefix}_{part}.npy") for part in ("dense", "sparse", "labels"))  # type: ignore[return-value]


@dataclass
class _Day:
    """One day's memory-mapped arrays (plain ndarray views: slicing an np.memmap runs Python code)."""

    prefix: str
    dense: np.ndarray
    labels: np.ndarray
    sparse: np.ndarray | None  # the rows layout
    store: KeyMajorStore | None  # the key-major layout

    @property
    def num_sparse(self) -> int:
        return self.store.lengths.shape[0] if self.store is not None else self.sparse.shape[1]  # type: ignore[union-attr]


def check_day_files(prefix: str | Path) -> bool:
    """Whether day ``prefix`` is key-major; a ``ValueError`` names the first of its files that is missing. Reads no
    array (opening the day validates every id: a whole read of the day)."""
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    ids_files = key_major_paths(prefix)
    key_major = any(path.is_file() for path in ids_files)
    needed = (dense_path, labels_path, *ids_files) if key_major else (dense_path, sparse_path, labels_path)
    for path in needed:
        if not path.is_file():
            raise ValueError(f"prefixes: prefix {str(prefix)!r} has no file {str(path)!r}")
    return key_major


def _load_day(prefix: str | Path) -> _Day:
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    key_major = check_day_files(prefix)
    dense = np.load(dense_path, mmap_mode="r").view(np.ndarray)
    labels = np.load(labels_path, mmap_mode="r").view(np.ndarray)
    store = KeyMajorStore.open(prefix) if key_major else None
    sparse = None if key_major else np.load(sparse_path, mmap_mode="r").view(np.ndarray)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels.reshape(-1)
    if dense.ndim != 2 or not np.issubdtype(dense.dtype, np.floating):
        raise ValueError(f"{dense_path} must hold a 2-D float array [N, Dd], got shape {dense.shape} {dense.dtype}")
    if sparse is not None and (sparse.ndim != 2 or not np.issubdtype(sparse.dtype, np.integer)):
        raise ValueError(f"{sparse_path} must hold a 2-D integer array [N, F], got shape {sparse.shape} {sparse.dtype}")
    if labels.ndim != 1:
        raise ValueError(f"{labels_path} must hold labels [N] or [N, 1], got shape {labels.shape}")
    sparse_rows = store.num_rows if store is not None else sparse.shape[0]  # type: ignore[union-attr]
    if not dense.shape[0] == sparse_rows == labels.shape[0]:
        raise ValueError(
            f"day {str(prefix)!r} has {dense.shape[0]} dense rows, {sparse_rows} sparse rows and "
            f"{labels.shape[0]} labels; they must match"
        )
    if store is not None:  # validated once here, like the ids (module docstring)
        _check_labels(labels, 0, str(prefix))
    return _Day(str(prefix), dense, labels, sparse, store)


def _check_labels(labels: np.ndarray, first_row: int, prefix: str) -> None:
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if bad.size:
        raise ValueError(
            f"{prefix}_labels.npy row {first_row + int(bad[0])}: labels must be 0 or 1, got {labels[bad[0]]}"
        )


class CriteoNPYSource:
    """Streams preprocessed Criteo days (see module docstring) as :class:`RecElement` s.

    Args:
        prefixes: one day's path prefix or a list of them, read in order.
        num_embeddings: hash size of every categorical feature, or one per feature.
        rank, world_size: this process's shard of the rows.
        shuffle_buffer: shuffle each epoch within blocks of this many rows (0 or 1: file order).
        shuffle_seed: seeds the shuffle (with the epoch and the shard).
    """

    def __init__(
        self,
        prefixes: str | Path | Sequence[str | Path],
        num_embeddings: int | Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        shuffle_seed: int = 0,
    ) -> None:
        prefix_list = [prefixes] if isinstance(prefixes, (str, Path)) else list(prefixes)
        if not prefix_list:
            raise ValueError(f"prefixes must name at least one day, got prefixes={prefixes!r}")
        self.days = [_load_day(p) for p in prefix_list]
        self.prefixes = [str(p) for p in prefix_list]
        dense_dims = {day.dense.shape[1] for day in self.days}
        sparse_dims = {day.num_sparse for day in self.days}
        if len(dense_dims) > 1 or len(sparse_dims) > 1:
            raise ValueError(
                f"prefixes: days disagree on feature counts (dense {sorted(dense_dims)}, sparse {sorted(sparse_dims)})"
            )
        num_sparse = sparse_dims.pop()
        self._num_rows = resolve_num_embeddings(num_embeddings, num_sparse)
        self._hash_sizes = np.asarray(self._num_rows, dtype=np.int64)
        for day in self.days:
            if day.store is not None and (day.store.num_embeddings % self._hash_sizes).any():
                raise ValueError(
                    f"prefixes: day {day.prefix!r} holds ids hashed into num_embeddings "
                    f"{day.store.num_embeddings.tolist()}; read it with those sizes or sizes that divide them, "
                    f"got num_embeddings={num_embeddings!r}"
                )
        self.element_spec = ElementSpec(dense_dims.pop(), tuple(f"cat_{i}" for i in range(num_sparse)))
        self._day_starts = np.cumsum([0] + [day.labels.shape[0] for day in self.days])
        self.shuffle_buffer = check_shuffle_buffer(shuffle_buffer)
        self.shuffle_seed = check_seed(shuffle_seed, "shuffle_seed")
        self._set_shard(Shard.of(rank, world_size))

    def _set_shard(self, shard: Shard) -> None:
        self.shard = shard
        self.rank, self.world_size = shard.rank, shard.world_size
        self._rows = shard.range_of(0, int(self._day_starts[-1]))

    def sub_shard(self, index: int, count: int) -> CriteoNPYSource:
        """This source's part ``index`` of ``count`` (a loader worker's share of the rank's rows)."""
        part = copy.copy(self)
        part._set_shard(self.shard.split(index, count))
        return part

    @property
    def num_embeddings(self) -> dict[str, int]:
        return dict(zip(self.element_spec.sparse_keys, self._num_rows, strict=True))

    def __len__(self) -> int:
        """Rows of this shard."""
        return self._rows[1] - self._rows[0]

    def __iter__(self) -> Iterator[RecElement]:
        return self.iter_from(0)

    def iter_from(self, position: int = 0, epoch: int = 0) -> Iterator[RecElement]:
        """Rows of this shard from ``position`` on (``epoch`` only changes the order when shuffling)."""
        return elements_of(self.iter_chunks(position, epoch))

    def iter_chunks(self, position: int = 0, epoch: int = 0) -> Iterator[ElementChunk]:
        """The rows of :meth:`iter_from` as chunks."""
        check_position(position, epoch)
        if position > len(self):
            raise ValueError(f"position={position} is past the end of the data ({len(self)} rows)")
        if self.shuffle_buffer > 1:
            return block_shuffled(self._row_chunks, position, self.shuffle_buffer, self.shuffle_seed, epoch, self.shard)
        return self._row_chunks(position)

    def _row_chunks(self, position: int) -> Iterator[ElementChunk]:
        """Global rows ``[first + position, last)`` of this shard, across days: a key-major day's rows as one chunk
        of views (the Batcher copies each batch's slices), a rows-layout day ``_VIEW_ROWS`` at a time (views too),
        a key-major day whose ids need folding ``_READ_ROWS`` at a time."""
        row, stop = self._rows[0] + position, self._rows[1]
        while row < stop:
            day_index = int(np.searchsorted(self._day_starts, row, side="right")) - 1
            day, day_start = self.days[day_index], int(self._day_starts[day_index])
            begin = row - day_start
            if day.store is not None and (day.store.num_embeddings == self._hash_sizes).all():
                end = min(day.labels.shape[0], stop - day_start)
                rows = day.store.rows(begin, end)
                yield ElementChunk.from_key_major(day.dense[begin:end], rows, day.labels[begin:end])
            else:
                step = _READ_ROWS if day.store is not None else _VIEW_ROWS
                end = min(begin + step, day.labels.shape[0], stop - day_start)
                yield self._read_rows(day, begin, end)
            row += end - begin

    def _read_rows(self, day: _Day, begin: int, end: int) -> ElementChunk:
        """Rows ``[begin, end)`` of a day whose ids need folding into the tables (rows layout, or key-major hashed
        into a multiple of the table sizes), as an id-matrix or jagged chunk."""
        dense = np.asarray(day.dense[begin:end], dtype=np.float32)
        labels = np.asarray(day.labels[begin:end], dtype=np.float32)
        if day.store is not None:
            stored = ElementChunk.from_key_major(dense, day.store.rows(begin, end), labels)
            keys = np.repeat(np.tile(np.arange(len(self._num_rows)), end - begin), stored.lengths.reshape(-1))
            return ElementChunk(dense, stored.ids % self._hash_sizes[keys], stored.lengths, labels)
        _check_labels(labels, begin, day.prefix)
        # raw ids, a view of the map: the Batcher folds each batch's present ids (module docstring)
        ids = np.asarray(day.sparse[begin:end], dtype=np.int64)  # type: ignore[index]
        return ElementChunk.from_id_matrix(dense, ids, labels, fold=self._hash_sizes)


def criteo_tsv_to_npy(
    tsv_paths: str | Path | Sequence[str | Path],
    prefix: str | Path,
    malformed: str = "error",
    num_embeddings: int | Sequence[int] | None = None,
) -> int:
    """Convert Criteo TSV file(s) into one npy day at ``prefix`` (see module docstring); returns the row count.

    Without ``num_embeddings`` the rows layout is written: raw ids (no modulo) with -1 for a missing value, so the
    day serves any table size. With it (one size or one per feature), the key-major layout: ids folded into those
    tables once, here, and stored the way batches need them (the fast way to read; the day is then read with those
    table sizes, or sizes that divide them). Malformed lines follow ``malformed`` as in
    :class:`~tritonrec.data.criteo.CriteoTSVSource`.
    """
    sizes = None if num_embeddings is None else np.asarray(resolve_num_embeddings(num_embeddings), np.int64)
    reader = CriteoTSVSource(tsv_paths, num_embeddings=1, malformed=malformed)
    dense_rows, sparse_rows, labels = [], [], []
    for dense, raw_ids, label in reader.iter_parsed_chunks():
        dense_rows.append(dense)
        sparse_rows.append(raw_ids if sizes is None else hash_id_matrix(raw_ids, sizes))
        labels.append(label)
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    dense_path.parent.mkdir(parents=True, exist_ok=True)
    num_dense, num_sparse = reader.element_spec.dense_dim, len(reader.element_spec.sparse_keys)
    np.save(dense_path, np.concatenate([np.zeros((0, num_dense), np.float32), *dense_rows]))
    sparse = np.concatenate([np.zeros((0, num_sparse), np.int64), *sparse_rows])
    # The other layout's files, left by an earlier conversion to this prefix, would be read instead of (key-major
    # wins) or beside the ones written now: remove them.
    for stale in key_major_paths(prefix) if sizes is None else (sparse_path,):
        stale.unlink(missing_ok=True)
    if sizes is None:
        np.save(sparse_path, sparse)
    else:
        write_key_major(prefix, sparse, sizes)
    np.save(labels_path, np.concatenate([np.zeros(0, np.float32), *labels]).astype(np.int32))
    return sum(len(chunk) for chunk in labels)
