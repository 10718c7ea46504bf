"""Packers that keep a given item order: concatenative (next fit in index order) and first fit in any order (used on a
shuffled order by ``first_fit_shuffle``).

Both take ``lengths [N]`` (int64, validated: ``0 <= length <= capacity``) and return bins as lists of indices.
"""

from __future__ import annotations

import numpy as np

from tritonrec.data.packing.length_pool import split_into_bins


def concatenative(lengths: np.ndarray, capacity: int, max_sequences_per_bin: int = -1) -> list[list[int]]:
    """Fill one bin in index order until the next item does not fit (or the bin holds ``max_sequences_per_bin``
    items, when that is positive), then start the next bin. Bins are contiguous index ranges."""
    limit = max_sequences_per_bin if max_sequences_per_bin > 0 else lengths.size + 1
    starts: list[int] = []
    start, total = 0, 0
    for index, length in enumerate(lengths.tolist()):
        if total + length > capacity or index - start >= limit:
            starts.append(start)
            start, total = index, 0
        total += length
    if lengths.size:
        starts.append(start)
    return split_into_bins(list(range(lengths.size)), [*starts[1:], lengths.size] if starts else [])


def first_fit(lengths: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
    """Items in ``order [N]``, each into the lowest-numbered bin with room for it.

    A max-tree over the bins' remaining room finds that bin in O(log N): the tree has a leaf for every bin that could
    ever exist (at most one per item), unopened bins hold a full capacity, so "the first bin with room" is also how a
    new bin gets opened, and bins come out numbered in opening order.
    """
    count = len(order)
    if count == 0:
        return []
    leaves = 1 << (count - 1).bit_length()
    room = [capacity] * (2 * leaves)
    sizes = lengths.tolist()
    bin_of_placement = []
    for item in order.tolist():
        size = sizes[item]
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        bin_of_placement.append(node - leaves)
        room[node] -= size
        node >>= 1
        while node:
            best = max(room[2 * node], room[2 * node + 1])
            if room[node] == best:
                break  # ancestors above are unchanged too
            room[node] = best
            node >>= 1
    placed_bins = np.asarray(bin_of_placement, dtype=np.int64)
    grouped = np.argsort(placed_bins, kind="stable")
    return split_into_bins(order[grouped].tolist(), np.cumsum(np.bincount(placed_bins)).tolist())
