"""Criteo in a preprocessed numpy format: three arrays per day, read with random access.

For each ``prefix`` (e.g. ``/data/criteo/day_0``, torchrec's file naming):

* ``{prefix}_dense.npy``  ``[N, Dd]`` float32 dense features, already transformed (``log(1 + x)``, see
  :mod:`tritonrec.data.criteo`);
* ``{prefix}_sparse.npy`` ``[N, F]`` integer raw categorical ids; a negative id marks a missing value (empty bag);
* ``{prefix}_labels.npy`` ``[N]`` or ``[N, 1]`` labels, 0 or 1.

Ids are folded into ``num_embeddings`` by modulo when read (torchrec's ``hashes``), so one file serves any table
size. Arrays are memory-mapped: opening a day costs nothing and ``iter_from(position)`` jumps straight to a row.
Across ranks (``rank``, ``world_size``) the rows of all days, end to end, are cut into contiguous balanced ranges
(:mod:`tritonrec.data.sharding`); ``shuffle_buffer > 1`` permutes each rank's rows within blocks of that many,
differently every epoch. :func:`criteo_tsv_to_npy` writes these files from raw TSV.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from tritonrec.data.criteo import CriteoTSVSource, hash_id_matrix, resolve_num_embeddings
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec, RecElement, check_position
from tritonrec.data.sharding import Shard, block_shuffled, check_seed, check_shuffle_buffer, elements_of

_READ_ROWS = 4096  # rows converted per vectorised read


def npy_paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    """The ``(dense, sparse, labels)`` files of one day."""
    return tuple(Path(f"{prefix}_{part}.npy") for part in ("dense", "sparse", "labels"))  # type: ignore[return-value]


def _load_day(prefix: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    for path in (dense_path, sparse_path, labels_path):
        if not path.is_file():
            raise ValueError(f"prefixes: prefix {str(prefix)!r} has no file {str(path)!r}")
    dense = np.load(dense_path, mmap_mode="r")
    sparse = np.load(sparse_path, mmap_mode="r")
    labels = np.load(labels_path, mmap_mode="r")
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels.reshape(-1)
    if dense.ndim != 2 or not np.issubdtype(dense.dtype, np.floating):
        raise ValueError(f"{dense_path} must hold a 2-D float array [N, Dd], got shape {dense.shape} {dense.dtype}")
    if sparse.ndim != 2 or not np.issubdtype(sparse.dtype, np.integer):
        raise ValueError(f"{sparse_path} must hold a 2-D integer array [N, F], got shape {sparse.shape} {sparse.dtype}")
    if labels.ndim != 1:
        raise ValueError(f"{labels_path} must hold labels [N] or [N, 1], got shape {labels.shape}")
    if not dense.shape[0] == sparse.shape[0] == labels.shape[0]:
        raise ValueError(
            f"day {str(prefix)!r} has {dense.shape[0]} dense rows, {sparse.shape[0]} sparse rows and "
            f"{labels.shape[0]} labels; they must match"
        )
    return dense, sparse, labels


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
        dense_dims = {d.shape[1] for d, _, _ in self.days}
        sparse_dims = {s.shape[1] for _, s, _ in self.days}
        if len(dense_dims) > 1 or len(sparse_dims) > 1:
            raise ValueError(
                f"prefixes: days disagree on feature counts (dense {sorted(dense_dims)}, sparse {sorted(sparse_dims)})"
            )
        num_sparse = sparse_dims.pop()
        self._num_rows = resolve_num_embeddings(num_embeddings, num_sparse)
        self._hash_sizes = np.asarray(self._num_rows, dtype=np.int64)
        self.element_spec = ElementSpec(dense_dims.pop(), tuple(f"cat_{i}" for i in range(num_sparse)))
        self._day_starts = np.cumsum([0] + [labels.shape[0] for _, _, labels in self.days])
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
        """Global rows ``[first + position, last)`` of this shard, ``_READ_ROWS`` at a time, across days."""
        row, stop = self._rows[0] + position, self._rows[1]
        while row < stop:
            day = int(np.searchsorted(self._day_starts, row, side="right")) - 1
            dense, sparse, labels = self.days[day]
            begin = row - int(self._day_starts[day])
            end = min(begin + _READ_ROWS, labels.shape[0], stop - int(self._day_starts[day]))
            label_rows = np.asarray(labels[begin:end], dtype=np.float32)
            bad = np.flatnonzero((label_rows != 0) & (label_rows != 1))
            if bad.size:
                raise ValueError(
                    f"{self.prefixes[day]}_labels.npy row {begin + int(bad[0])}: labels must be 0 or 1, "
                    f"got {label_rows[bad[0]]}"
                )
            ids = hash_id_matrix(np.asarray(sparse[begin:end], dtype=np.int64), self._hash_sizes)
            yield ElementChunk.from_id_matrix(np.asarray(dense[begin:end], dtype=np.float32), ids, label_rows)
            row += end - begin


def criteo_tsv_to_npy(
    tsv_paths: str | Path | Sequence[str | Path], prefix: str | Path, malformed: str = "error"
) -> int:
    """Convert Criteo TSV file(s) into one npy day at ``prefix`` (see module docstring); returns the row count.

    Missing categorical values are stored as -1 and raw ids are kept (no modulo), so the day serves any table size.
    Malformed lines follow ``malformed`` as in :class:`~tritonrec.data.criteo.CriteoTSVSource`.
    """
    reader = CriteoTSVSource(tsv_paths, num_embeddings=1, malformed=malformed)
    dense_rows, sparse_rows, labels = [], [], []
    for dense, raw_ids, label in reader.iter_parsed_chunks():
        dense_rows.append(dense)
        sparse_rows.append(raw_ids)
        labels.append(label)
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    dense_path.parent.mkdir(parents=True, exist_ok=True)
    num_dense, num_sparse = reader.element_spec.dense_dim, len(reader.element_spec.sparse_keys)
    np.save(dense_path, np.concatenate([np.zeros((0, num_dense), np.float32), *dense_rows]))
    np.save(sparse_path, np.concatenate([np.zeros((0, num_sparse), np.int64), *sparse_rows]))
    np.save(labels_path, np.concatenate([np.zeros(0, np.float32), *labels]).astype(np.int32))
    return sum(len(chunk) for chunk in labels)
