"""The engine under the decreasing-order packers: unplaced items kept as counts per length, and a record of placements.

Sequence lengths are integers in ``[0, capacity]``, so 16,384 sequences hold at most ``capacity + 1`` distinct lengths
(about 750 for lengths in [50, 800]). The packers therefore work on counts per length rather than on items: a greedy
fill asks "largest unplaced length <= room" once per (bin, length) and places every copy that fits at once, instead of
scanning bins for every item as the textbook loops do.

Availability is a Python int used as a bitset (bit ``v`` set while an item of length ``v`` is unplaced), so a query
costs O(capacity / 64) machine words; a mirrored bitset (bit ``capacity - v``) finds two lengths summing to a target
with one AND.

Items of one length are interchangeable for packing quality. :class:`Placements` hands them out in ascending index
order (descending on request, which is the order NeMo-RL's first-fit decreasing places equal lengths in), which
makes every packer deterministic and lets :meth:`Placements.to_bins` turn the (bin, length, count) records into
index lists with a few numpy calls.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np


def _bitset(present: np.ndarray) -> int:
    """Python int whose bit ``i`` is ``present[i]``."""
    return int.from_bytes(np.packbits(present, bitorder="little").tobytes(), "little")


def _stable_order(values: np.ndarray, bound: int) -> np.ndarray:
    """``argsort(values, kind="stable")`` for ``0 <= values < bound``; 16-bit keys take numpy's radix sort (6x faster
    than the int64 merge sort on 16K lengths)."""
    return np.argsort(values.astype(np.int16) if bound <= np.iinfo(np.int16).max else values, kind="stable")


def split_into_bins(flat: list[int], ends: Sequence[int]) -> list[list[int]]:
    """``flat[ends[b - 1]:ends[b]]`` for every bin ``b`` (``ends`` are exclusive, ascending).

    The cyclic garbage collector is paused while the lists are built: creating ~100K small lists otherwise triggers
    collections that rescan every live object, which more than doubles the cost; these lists hold ints and form no
    reference cycles.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return [flat[start:end] for start, end in zip([0, *ends], ends, strict=False)]  # bin b: ends[b-1]:ends[b]
    finally:
        if was_enabled:
            gc.enable()


class LengthPool:
    """The multiset of unplaced lengths in ``[1, capacity]`` (zero lengths never enter; see :class:`Placements`)."""

    __slots__ = ("_counts", "_mirrored", "_present", "capacity", "remaining")

    def __init__(self, counts: np.ndarray, capacity: int) -> None:
        """``counts[v]`` items of length ``v`` for ``v`` in ``[0, capacity]``; ``counts[0]`` is ignored."""
        counts = counts.astype(np.int64, copy=True)
        counts[0] = 0
        self.capacity = capacity
        self._counts: list[int] = counts.tolist()
        present = counts > 0
        self._present = _bitset(present)
        self._mirrored = _bitset(present[::-1])
        self.remaining = int(counts.sum())

    def largest_at_most(self, limit: int) -> int:
        """Largest unplaced length ``<= limit``, or -1 when there is none."""
        if limit <= 0:
            return -1
        return (self._present & ((2 << limit) - 1)).bit_length() - 1

    def smallest_at_least(self, floor: int) -> int:
        """Smallest unplaced length ``>= floor``, or -1 when there is none."""
        above = self._present >> max(floor, 0)
        if not above:
            return -1
        return max(floor, 0) + (above & -above).bit_length() - 1

    def second_smallest_at_least(self, floor: int) -> int:
        """The second item in ascending order among lengths ``>= floor`` (may equal the smallest), or -1."""
        first = self.smallest_at_least(floor)
        if first < 0:
            return -1
        return first if self._counts[first] >= 2 else self.smallest_at_least(first + 1)

    def pair_summing_to(self, target: int) -> tuple[int, int] | None:
        """Two unplaced items ``a >= b`` with ``a + b == target`` and the largest such ``a``, or None."""
        if target < 2 or target > 2 * self.capacity:
            return None
        # Bit a of `partners` is set when a and target - a are both unplaced (the mirrored set shifted into place).
        shift = self.capacity - target
        mirrored = self._mirrored >> shift if shift >= 0 else self._mirrored << -shift
        partners = self._present & mirrored
        if not partners:
            return None
        larger = partners.bit_length() - 1  # partners is symmetric about target / 2, so its top bit is >= target / 2
        smaller = target - larger
        if larger == smaller and self._counts[larger] < 2:
            return None
        return larger, smaller

    def take(self, length: int, copies: int) -> None:
        left = self._counts[length] - copies
        self._counts[length] = left
        self.remaining -= copies
        if left == 0:
            self._present &= ~(1 << length)
            self._mirrored &= ~(1 << (self.capacity - length))

    def give_back(self, length: int, copies: int) -> None:
        if self._counts[length] == 0:
            self._present |= 1 << length
            self._mirrored |= 1 << (self.capacity - length)
        self._counts[length] += copies
        self.remaining += copies


class Placements:
    """Which lengths went to which bin, as (bin, length, copies) records in placement order."""

    __slots__ = ("_bins", "_copies", "_lengths", "num_bins")

    def __init__(self) -> None:
        self._bins: list[int] = []
        self._lengths: list[int] = []
        self._copies: list[int] = []
        self.num_bins = 0

    def new_bin(self) -> int:
        self.num_bins += 1
        return self.num_bins - 1

    def add(self, bin_id: int, length: int, copies: int) -> None:
        self._bins.append(bin_id)
        self._lengths.append(length)
        self._copies.append(copies)

    def undo_last_copy(self) -> None:
        """Take back one copy of the latest record (the last item placed)."""
        if self._copies[-1] == 1:
            self._bins.pop()
            self._lengths.pop()
            self._copies.pop()
        else:
            self._copies[-1] -= 1

    def place_zero_lengths(self, count: int) -> None:
        """Zero-length items fit anywhere: they join the first bin (a bin of their own when nothing else exists)."""
        if count:
            self.add(0 if self.num_bins else self.new_bin(), 0, count)

    def to_bins(self, lengths: np.ndarray, descending_ties: bool = False) -> list[list[int]]:
        """Index lists per bin, in placement order; every item of ``lengths [N]`` must have been placed once. Items
        of one length are handed out in ascending index order, or descending with ``descending_ties``."""
        copies = np.asarray(self._copies, dtype=np.int64)
        rec_lengths = np.asarray(self._lengths, dtype=np.int64)
        if int(copies.sum()) != lengths.size:
            raise AssertionError(f"placed {int(copies.sum())} items, expected {lengths.size}")
        if lengths.size == 0:
            return []
        # Items sorted by (length, index) (or (length, -index)); records sorted by (length, time) consume that order
        # front to back.
        bound = int(lengths.max()) + 1
        if descending_ties:
            items_by_length = lengths.size - 1 - _stable_order(lengths[::-1], bound)
        else:
            items_by_length = _stable_order(lengths, bound)
        by_length = _stable_order(rec_lengths, bound)
        first_item = np.empty_like(copies)
        first_item[by_length] = np.cumsum(copies[by_length]) - copies[by_length]
        # Expand the records in placement order into item positions, then group by bin keeping that order.
        record_start = np.cumsum(copies) - copies
        positions = np.repeat(first_item - record_start, copies) + np.arange(lengths.size)
        items = items_by_length[positions]
        bin_of_item = np.repeat(np.asarray(self._bins, dtype=np.int64), copies)
        grouped = _stable_order(bin_of_item, self.num_bins)
        ends = np.cumsum(np.bincount(bin_of_item, minlength=self.num_bins)).tolist()
        return split_into_bins(items[grouped].tolist(), ends)


def fill_bins(pool: LengthPool, placements: Placements, rooms: Sequence[int] = (), pair_refill: bool = False) -> None:
    """Fill bins one at a time until every item is placed: first the existing bins ``0, 1, ...`` with the given
    ``rooms``, then new bins. Each bin repeatedly takes the largest unplaced length that fits (every copy that fits).

    Filling bins in order this way, each new bin opened with the largest unplaced item, is exactly first-fit
    decreasing: every item lands in the first bin with room for it, yet the work is one query per (bin, length)
    instead of a scan over bins per item.

    ``pair_refill`` (best-two-fit): a bin left with room swaps its last, smallest item for the two unplaced items
    whose sum fills it best, when that sum exceeds the item. No single unplaced item fits the room, so a better
    fill must replace something, and replacing the smallest item by a pair is the cheapest swap that can close the
    gap exactly.

    This loop dominates packing time, so it keeps the pool's state in locals (the same steps as
    :meth:`LengthPool.largest_at_most` and :meth:`LengthPool.take`) and writes it back before calling pool methods.
    """
    counts, top = pool._counts, pool.capacity
    present, mirrored, remaining = pool._present, pool._mirrored, pool.remaining
    record_bin, record_length, record_copies = (
        placements._bins.append,
        placements._lengths.append,
        placements._copies.append,
    )
    existing = len(rooms)
    bin_id = 0
    while remaining:
        if bin_id < existing:
            room = rooms[bin_id]
        else:
            placements.new_bin()
            room = top
        last, limit = 0, room
        while limit > 0:
            length = (present & ((2 << limit) - 1)).bit_length() - 1
            if length <= 0:
                break
            available = counts[length]
            copies = room // length
            if copies >= available:
                copies = available
                present ^= 1 << length
                mirrored ^= 1 << (top - length)
            counts[length] = available - copies
            record_bin(bin_id)
            record_length(length)
            record_copies(copies)
            remaining -= copies
            room -= copies * length
            last = length
            limit = room if room < length else length - 1
        if pair_refill and room and last and remaining:
            pool._present, pool._mirrored, pool.remaining = present, mirrored, remaining
            _swap_last_for_pair(pool, placements, bin_id, room, last)
            present, mirrored, remaining = pool._present, pool._mirrored, pool.remaining
        bin_id += 1
    pool._present, pool._mirrored, pool.remaining = present, mirrored, remaining


def _swap_last_for_pair(pool: LengthPool, placements: Placements, bin_id: int, room: int, last: int) -> None:
    """Replace one item of length ``last`` (the latest placed) by the pair with the largest sum in
    ``(last, room + last]``, if there is one."""
    freed = room + last
    for target in range(freed, last, -1):
        pair = pool.pair_summing_to(target)
        if pair is not None:
            placements.undo_last_copy()
            pool.give_back(last, 1)
            for length in pair:
                pool.take(length, 1)
                placements.add(bin_id, length, 1)
            return
