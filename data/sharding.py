"""Which part of a dataset one rank (and one loader worker) reads, and the bounded-buffer shuffle of that part.

A :class:`Shard` is a chain of ``(index, count)`` levels: the first is ``(rank, world_size)``; a DataLoader worker adds
``(worker, num_workers)`` below it. Each level splits what the level above left, so the shards of one level tile
their parent exactly, and the union over all ranks (and workers) of one epoch is the dataset with no duplicates.
Sources apply a shard in one of two ways:

* **row ranges** (:meth:`Shard.range_of`): rows ``[0, n)`` are cut into ``count`` contiguous, balanced pieces per
  level (npy days, finite synthetic streams, plain TSV files by bytes);
* **stride** (:meth:`Shard.stride`): item ``i`` belongs to the shard when ``i % step == offset`` (``.gz`` TSV lines,
  which cannot be seeked; chunks of an endless synthetic stream).

The shuffle (:func:`block_shuffled`) keeps at most ``buffer_size`` rows in memory: the shard's rows are cut into
consecutive blocks of ``buffer_size`` and each block is permuted by a generator seeded with
``(shuffle_seed, epoch, shard key, block)``. The order is therefore deterministic per (seed, epoch, rank), changes every
epoch, and position ``p`` is reached by reading one block from its start: resuming mid-epoch replays at most
``buffer_size - 1`` rows instead of the whole pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import RecElement
from tritonrec.kernels.checks import check_int


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    """``world_size`` a positive int and ``0 <= rank < world_size``; returns them as ints."""
    world_size = check_int(world_size, "world_size", 1)
    return check_int(rank, "rank", 0, world_size - 1, what=f"an int in [0, world_size={world_size})"), world_size


@dataclass(frozen=True)
class Shard:
    """A nested split of a dataset: ``levels[0] = (rank, world_size)``, further levels split that part again."""

    levels: tuple[tuple[int, int], ...] = ((0, 1),)

    @classmethod
    def of(cls, rank: int = 0, world_size: int = 1) -> Shard:
        return cls((check_rank(rank, world_size),))

    def split(self, index: int, count: int) -> Shard:
        """Part ``index`` of ``count`` of this shard (a worker's part of a rank's shard)."""
        count = check_int(count, "count", 1)
        return Shard(
            (*self.levels, (check_int(index, "index", 0, count - 1, what=f"an int in [0, count={count})"), count))
        )

    @property
    def rank(self) -> int:
        return self.levels[0][0]

    @property
    def world_size(self) -> int:
        return self.levels[0][1]

    @property
    def key(self) -> tuple[int, ...]:
        """Every level's ``(index, count)`` flattened: seeds the shuffle, so each shard draws its own order."""
        return tuple(v for level in self.levels for v in level)

    def range_of(self, start: int, stop: int) -> tuple[int, int]:
        """This shard's contiguous piece of rows ``[start, stop)`` (balanced: piece sizes differ by at most 1)."""
        for index, count in self.levels:
            size = stop - start
            start, stop = start + size * index // count, start + size * (index + 1) // count
        return start, stop

    def stride(self) -> tuple[int, int]:
        """``(offset, step)``: item ``i`` belongs to this shard iff ``i % step == offset``."""
        offset, step = 0, 1
        for index, count in self.levels:
            offset, step = offset + step * index, step * count
        return offset, step


def check_shuffle_buffer(shuffle_buffer: object) -> int:
    return check_int(shuffle_buffer, "shuffle_buffer", 0, what="a non-negative int (0: no shuffle)")


def check_seed(seed: object, name: str = "seed") -> int:
    return check_int(seed, name, 0)


class ChunkReader:
    """Reads a chunk stream ``count`` rows at a time, whatever the sizes of the chunks it is made of (a chunk larger
    than ``count`` is sliced where the reader stands in it: one slice per read, the chunk itself when it fits)."""

    def __init__(self, chunks: Iterator[ElementChunk]) -> None:
        self._chunks = chunks
        self._current: ElementChunk | None = None
        self._offset = 0  # rows of the current chunk already read

    def take(self, count: int) -> ElementChunk | None:
        """The next ``count`` rows as one chunk (fewer at the end of the stream; ``None`` when it is exhausted)."""
        parts, have = [], 0
        while have < count:
            if self._current is None or self._offset == len(self._current):
                self._current, self._offset = next(self._chunks, None), 0
                if self._current is None:
                    break
                continue
            chunk, start = self._current, self._offset
            stop = min(start + count - have, len(chunk))
            parts.append(chunk if start == 0 and stop == len(chunk) else chunk.slice(start, stop))
            have, self._offset = have + stop - start, stop
        return ElementChunk.concat(parts) if parts else None


def block_shuffled(
    chunks_from: Callable[[int], Iterator[ElementChunk]],
    position: int,
    buffer_size: int,
    seed: int,
    epoch: int,
    shard: Shard,
) -> Iterator[ElementChunk]:
    """The rows of ``chunks_from(0)`` permuted within consecutive blocks of ``buffer_size``, from ``position`` on.

    ``chunks_from(p)`` streams the unshuffled shard from row ``p``. Block ``b`` (rows ``[b * S, (b + 1) * S)``) is
    permuted by ``default_rng((seed, epoch, *shard.key, b))``; the last block may be short.
    """
    block = position // buffer_size
    skip = position - block * buffer_size
    reader = ChunkReader(chunks_from(block * buffer_size))
    while True:
        rows = reader.take(buffer_size)
        if rows is None:
            return
        order = np.random.default_rng([seed, epoch, *shard.key, block]).permutation(len(rows))
        shuffled = rows.take(order[skip:]) if skip else rows.take(order)
        if len(shuffled):
            yield shuffled
        if len(rows) < buffer_size:
            return
        block, skip = block + 1, 0


def elements_of(chunks: Iterator[ElementChunk]) -> Iterator[RecElement]:
    """Per-sample view of a chunk stream (the :class:`~tritonrec.data.elements.ElementSource` protocol)."""
    for chunk in chunks:
        yield from chunk.elements()
