"""``ElementChunk``: many samples stacked, in one of three layouts, and the protocol of sources that stream them.

* **jagged** (any bag lengths): ``ids [N]`` sample-major (sample ``i``'s ids, feature after feature, are
  ``ids[offsets[i]:offsets[i + 1]]``) with ``lengths [n, F]``;
* **id matrix** (each bag empty or one id, as in Criteo): ``id_matrix [n, F]`` int64 with -1 for an empty bag. The
  Batcher builds a KJT from it with a transpose and one mask instead of a gather over jagged offsets, and no
  sample-major copy of the ids ever exists. The ids may still be raw (a negative id: missing), with the table sizes
  ``fold [F]`` they are to be folded into by modulo when read: the Batcher then folds only a batch's present ids,
  after the transpose (an id matrix straight from a memory map is never copied before that);
* **key-major** (any bag lengths, ids stored the KJT's way): ``key_major``, rows of a
  :class:`~tritonrec.data.key_major.KeyMajorStore` (memory-mapped views; slicing copies nothing). The Batcher's KJT
  values are one concatenation of per-feature slices.

All hold ``dense [n, Dd]`` float and ``labels [n]`` (float32, or 0/1 integers). ``ids`` / ``lengths`` of the
id-matrix and key-major layouts are derived on first use (for per-sample access), so every consumer can read any
layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from tritonrec.data.elements import ElementSource, RecElement
from tritonrec.data.id_folding import hash_id_matrix
from tritonrec.data.key_major import KeyMajorRows


class ElementChunk:
    """``n`` samples stacked (see module docstring); ``ElementChunk(dense, ids, lengths, labels)`` is the jagged
    layout, :meth:`from_id_matrix` and :meth:`from_key_major` the others."""

    __slots__ = ("_ids", "_lengths", "_offsets", "dense", "fold", "id_matrix", "key_major", "labels")

    def __init__(
        self, dense: np.ndarray, ids: np.ndarray | None, lengths: np.ndarray | None, labels: np.ndarray
    ) -> None:
        self.dense, self.labels = dense, labels
        self._ids, self._lengths = ids, lengths
        self.id_matrix: np.ndarray | None = None
        self.fold: np.ndarray | None = None  # table sizes the id matrix's raw ids are still to be folded into
        self.key_major: KeyMajorRows | None = None
        self._offsets: np.ndarray | None = None

    @classmethod
    def from_id_matrix(
        cls, dense: np.ndarray, id_matrix: np.ndarray, labels: np.ndarray, fold: np.ndarray | None = None
    ) -> ElementChunk:
        """Samples whose every bag is empty (negative) or holds the one id in ``id_matrix [n, F]``; with ``fold``
        (int64 ``[F]``) those ids are raw, and bag ``(i, f)`` holds ``id_matrix[i, f] % fold[f]``."""
        chunk = cls(dense, None, None, labels)
        chunk.id_matrix, chunk.fold = id_matrix, fold
        return chunk

    def folded_id_matrix(self) -> np.ndarray:
        """The id matrix with its ids folded into their tables (-1 where missing): itself when already folded."""
        if self.fold is None:
            return self.id_matrix  # type: ignore[return-value]
        return hash_id_matrix(self.id_matrix, self.fold)  # type: ignore[arg-type]

    @classmethod
    def from_key_major(cls, dense: np.ndarray, key_major: KeyMajorRows, labels: np.ndarray) -> ElementChunk:
        """Samples whose ids are the rows ``key_major`` of a key-major store."""
        chunk = cls(dense, None, None, labels)
        chunk.key_major = key_major
        return chunk

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def lengths(self) -> np.ndarray:
        """``[n, F]`` int64 bag lengths."""
        if self._lengths is None:
            if self.key_major is not None:
                self._lengths = self.key_major.arrays()[1].T.astype(np.int64)
            else:
                self._lengths = (self.id_matrix >= 0).astype(np.int64)  # type: ignore[operator]
        return self._lengths

    @property
    def ids(self) -> np.ndarray:
        """``[N]`` sample-major ids."""
        if self._ids is None:
            if self.key_major is not None:
                values, lengths, _ = self.key_major.arrays()
                self._ids = values[_sample_major_order(lengths)]
            else:
                matrix = self.folded_id_matrix()
                self._ids = matrix[matrix >= 0]
        return self._ids

    @property
    def offsets(self) -> np.ndarray:
        """``[n + 1]`` start of each sample's ids in :attr:`ids`."""
        if self._offsets is None:
            offsets = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(self.lengths.sum(1), out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    def slice(self, start: int, stop: int) -> ElementChunk:
        """Samples ``[start, stop)`` (views, no copy)."""
        if self.id_matrix is not None:
            return ElementChunk.from_id_matrix(
                self.dense[start:stop], self.id_matrix[start:stop], self.labels[start:stop], self.fold
            )
        if self.key_major is not None:
            return ElementChunk.from_key_major(
                self.dense[start:stop], self.key_major.slice(start, stop), self.labels[start:stop]
            )
        offsets = self.offsets
        return ElementChunk(
            self.dense[start:stop], self.ids[offsets[start] : offsets[stop]], self.lengths[start:stop],
            self.labels[start:stop],
        )  # fmt: skip

    def take(self, rows: np.ndarray) -> ElementChunk:
        """Samples ``rows`` in that order: one gather per array (the jagged ids by their per-sample ranges)."""
        if self.id_matrix is not None:
            return ElementChunk.from_id_matrix(self.dense[rows], self.id_matrix[rows], self.labels[rows], self.fold)
        offsets = self.offsets
        counts = offsets[1:][rows] - offsets[:-1][rows]
        out_starts = np.cumsum(counts) - counts
        gather = np.repeat(offsets[:-1][rows] - out_starts, counts) + np.arange(int(counts.sum()))
        return ElementChunk(self.dense[rows], self.ids[gather], self.lengths[rows], self.labels[rows])

    @staticmethod
    def concat(chunks: list[ElementChunk]) -> ElementChunk:
        if len(chunks) == 1:
            return chunks[0]
        dense = np.concatenate([c.dense for c in chunks])
        labels = np.concatenate([c.labels for c in chunks])
        if all(c.id_matrix is not None for c in chunks):
            fold = chunks[0].fold
            if all(_same_fold(c.fold, fold) for c in chunks):
                return ElementChunk.from_id_matrix(dense, np.concatenate([c.id_matrix for c in chunks]), labels, fold)
            return ElementChunk.from_id_matrix(dense, np.concatenate([c.folded_id_matrix() for c in chunks]), labels)
        joined = _adjacent_rows([c.key_major for c in chunks])
        if joined is not None:
            return ElementChunk.from_key_major(dense, joined, labels)
        ids = np.concatenate([c.ids for c in chunks])
        return ElementChunk(dense, ids, np.concatenate([c.lengths for c in chunks]), labels)

    def elements(self) -> Iterator[RecElement]:
        offsets, ids, lengths = self.offsets, self.ids, self.lengths
        for i in range(len(self)):
            yield RecElement(self.dense[i], ids[offsets[i] : offsets[i + 1]], lengths[i], float(self.labels[i]))


def _same_fold(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _sample_major_order(lengths: np.ndarray) -> np.ndarray:
    """For key-major values with bag lengths ``[F, n]``: the gather that puts them sample-major."""
    lengths_key_major = lengths.reshape(-1).astype(np.int64)
    starts_key_major = np.cumsum(lengths_key_major) - lengths_key_major
    lengths_sample_major = lengths.T.reshape(-1).astype(np.int64)
    starts = starts_key_major.reshape(lengths.shape).T.reshape(-1)
    out_starts = np.cumsum(lengths_sample_major) - lengths_sample_major
    return np.repeat(starts - out_starts, lengths_sample_major) + np.arange(int(lengths_sample_major.sum()))


def _adjacent_rows(parts: list[KeyMajorRows | None]) -> KeyMajorRows | None:
    """Consecutive key-major rows of one store, end to end, as one range (else None)."""
    first, last = parts[0], parts[-1]
    if first is None or last is None:
        return None
    for before, after in itertools.pairwise(parts):
        if after is None or before.store is not after.store or before.stop != after.start:  # type: ignore[union-attr]
            return None
    return KeyMajorRows(first.store, first.start, last.stop, first.begin, last.end)


@runtime_checkable
class ChunkSource(ElementSource, Protocol):
    """An :class:`~tritonrec.data.elements.ElementSource` that also streams its elements as :class:`ElementChunk` s
    (the same elements, in the same order)."""

    def iter_chunks(self, position: int = 0, epoch: int = 0) -> Iterator[ElementChunk]: ...
