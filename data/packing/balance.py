"""Karmarkar-Karp largest differencing for k-way balanced partitions, and the two balancers built on it.

:func:`karmarkar_karp` is the classic method (as in veRL's ``seqlen_balancing``): every item starts as a partial
k-way partition; the two partial partitions with the largest spread (max part - min part) are combined, pairing the
largest part of one with the smallest of the other, until one partition remains.

Parts are kept sparse, which makes large ``k`` cheap: a partial partition stores only its non-empty parts (in a heap)
and a count of empty ones, and combining merges the one with fewer parts into the other. Pairing "ascending with
descending" only touches the smaller partition's part count, so a combine costs O(m log k) for m parts of the smaller
side instead of O(k).

Built on it:

* :func:`balanced_bins` packs sequences into few balanced microbatches that each stay within the token
  capacity. veRL sets the count to ``ceil(total / capacity)`` and balances, which can leave a microbatch over the
  cap; here the count grows until every part fits.
* :func:`balance_bins_across_ranks` reorders finished bins so that dealing them round-robin gives every rank the
  same number of bins and nearly the same number of tokens; bins are never split, so no bin can exceed capacity.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from itertools import count

import numpy as np

from tritonrec.data.packing.metrics import bin_loads
from tritonrec.kernels.checks import check_int


class _Partition:
    """A partial k-way partition: non-empty parts as a heap of [sum, tiebreak, members], plus empty parts."""

    __slots__ = ("empty", "largest", "parts")

    def __init__(self, parts: list[list], empty: int, largest: int) -> None:
        heapq.heapify(parts)
        self.parts = parts
        self.empty = empty
        self.largest = largest

    def spread(self) -> int:
        return self.largest - (0 if self.empty else self.parts[0][0])

    def absorb(self, other: _Partition, tiebreak: count) -> None:
        """Pair ``other``'s parts, largest first, with this partition's parts, smallest (the empty ones) first.

        ``other``'s empty parts would pair with this partition's largest parts and change nothing, so only its
        non-empty parts are visited.
        """
        incoming = sorted(other.parts, reverse=True) if len(other.parts) > 1 else other.parts
        into_empty = min(self.empty, len(incoming))
        smallest = [heapq.heappop(self.parts) for _ in range(len(incoming) - into_empty)]
        self.empty -= into_empty
        largest = self.largest
        for part in incoming[:into_empty]:
            heapq.heappush(self.parts, part)
            if part[0] > largest:
                largest = part[0]
        for mine, theirs in zip(smallest, incoming[into_empty:], strict=True):
            members, extra = (mine[2], theirs[2]) if len(mine[2]) >= len(theirs[2]) else (theirs[2], mine[2])
            members.extend(extra)  # the longer member list absorbs the shorter one
            total = mine[0] + theirs[0]
            heapq.heappush(self.parts, [total, next(tiebreak), members])
            if total > largest:
                largest = total
        self.largest = largest


def _differencing(values: np.ndarray, num_parts: int, equal_size: bool) -> tuple[list[list], int]:
    """The final partition's non-empty parts as ``[sum, tiebreak, members]`` and its number of empty parts."""
    tiebreak = count()
    order = np.lexsort((np.arange(values.size), values)).tolist()
    sizes = values.tolist()
    group = num_parts if equal_size else 1
    heap: list[tuple[int, int, int, _Partition]] = []
    for start in range(0, len(order), group):
        members = order[start : start + group]
        parts = [[sizes[i], next(tiebreak), [i]] for i in members]
        partition = _Partition(parts, num_parts - len(parts), sizes[members[-1]])
        heap.append((-partition.spread(), -partition.largest, next(tiebreak), partition))
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[3]
        second = heapq.heappop(heap)[3]
        if len(first.parts) < len(second.parts):
            first, second = second, first
        first.absorb(second, tiebreak)
        heapq.heappush(heap, (-first.spread(), -first.largest, next(tiebreak), first))
    if not heap:
        return [], num_parts
    return heap[0][3].parts, heap[0][3].empty


def karmarkar_karp(weights: Sequence[int] | np.ndarray, num_parts: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices of ``weights [N]`` into ``num_parts`` lists with nearly equal weight sums.

    ``equal_size=True`` also gives every part the same number of items (``N`` must be a multiple of ``num_parts``):
    items are sorted and seeded in groups of ``num_parts``, one item per part, and combining keeps the counts equal.
    Parts come out by descending sum, members in ascending index order; with fewer items than parts, trailing parts
    are empty. Deterministic: ties are broken by creation order.
    """
    num_parts = check_int(num_parts, "num_parts", 1)
    values = np.asarray(weights, dtype=np.int64).reshape(-1)
    if equal_size and values.size % num_parts:
        raise ValueError(
            f"equal_size=True needs the number of items ({values.size}) to be a multiple of num_parts={num_parts}"
        )
    parts, empty = _differencing(values, num_parts, equal_size)
    parts = sorted(parts, key=lambda part: (-part[0], part[1]))
    return [sorted(part[2]) for part in parts] + [[] for _ in range(empty)]


_REFINE_STEPS = 2


def balanced_bins(lengths: np.ndarray, capacity: int, min_bins: int, bins_multiple: int) -> list[list[int]]:
    """Few balanced microbatches, each at most ``capacity`` tokens: KK partitions into k parts for growing k.

    k starts at the lower bound ``ceil(sum / capacity)`` (at least ``min_bins``, rounded up to ``bins_multiple``).
    While the heaviest part overflows, k jumps to where the mean part leaves room for the observed overshoot (at
    least a doubling step); then up to two bisection steps between the last miss and the first fit look for a
    smaller k. Every returned partition was checked, so no part exceeds ``capacity``; k stops at ``N`` (one item
    per part always fits). With tens of sequences per microbatch the first k almost always fits; with two or three
    (short capacities) KK's spread forces many more bins than the packers need.
    """
    count_items = int(lengths.size)
    if count_items == 0:
        return []

    def rounded(k: int) -> int:
        return min(-(-k // bins_multiple) * bins_multiple, count_items)

    def partition(k: int) -> tuple[list[list[int]], int]:
        parts, _ = _differencing(lengths, k, equal_size=False)  # k <= N: no empty parts
        return [sorted(part[2]) for part in parts], max(part[0] for part in parts)

    total = int(lengths.sum())
    k = rounded(max(math.ceil(total / capacity), min_bins, 1))
    miss, step = 0, bins_multiple
    while (found := partition(k))[1] > capacity:
        # KK parts sit within about one spread of the mean: jump to the k whose mean leaves room for that overshoot.
        overshoot = found[1] - total / k
        guess = math.ceil(total / (capacity - overshoot)) if overshoot < capacity else count_items
        miss, k, step = k, rounded(max(k + step, guess)), 2 * step
    best, hit = found[0], k
    for _ in range(_REFINE_STEPS if miss else 0):
        middle = rounded((miss + hit) // 2)
        if middle in (miss, hit):
            break
        parts, heaviest = partition(middle)
        if heaviest > capacity:
            miss = middle
        else:
            hit, best = middle, parts
    return best


def balance_bins_across_ranks(
    bins: Sequence[Sequence[int]], sequence_lengths: Sequence[int] | np.ndarray, num_ranks: int
) -> list[list[int]]:
    """Reorder ``bins`` so that rank ``r`` taking ``bins[r::num_ranks]`` gets the same number of bins as every other
    rank and a nearly equal share of tokens (KK over bin loads, equal counts). ``len(bins)`` must be a multiple of
    ``num_ranks``. Within a rank, bins keep their original order.
    """
    num_ranks = check_int(num_ranks, "num_ranks", 1)
    if len(bins) % num_ranks:
        raise ValueError(f"len(bins) = {len(bins)} must be a multiple of num_ranks={num_ranks} to deal bins evenly")
    per_rank = karmarkar_karp(bin_loads(np.asarray(sequence_lengths, dtype=np.int64), bins), num_ranks, equal_size=True)
    dealt: list[list[int]] = [[] for _ in bins]
    for rank, bin_ids in enumerate(per_rank):
        for slot, bin_id in enumerate(bin_ids):
            dealt[slot * num_ranks + rank] = list(bins[bin_id])
    return dealt
