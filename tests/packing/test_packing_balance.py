"""Karmarkar-Karp: the sparse implementation against a dense textbook one, and the two balancers built on it."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.data.packing import (
    balance_bins_across_ranks,
    bin_loads,
    get_packer,
    karmarkar_karp,
    rank_imbalance,
    rank_token_loads,
    theoretical_min_bins,
)


def reference_part_sums(weights: list[int], k: int, equal_size: bool) -> list[int]:
    """Largest differencing with every partition as a dense, descending k-vector of part sums. Partitions are
    combined largest spread first (ties: larger largest part, then creation order), pairing one partition's parts
    in descending order with the other's in ascending order."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    group = k if equal_size else 1
    heap: list[tuple[int, int, int, list[int]]] = []
    created = 0
    for start in range(0, len(order), group):
        members = [weights[i] for i in order[start : start + group]]
        parts = sorted(members + [0] * (k - len(members)), reverse=True)
        heap.append((parts[-1] - parts[0], -parts[0], created, parts))
        created += 1
    heapq.heapify(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        parts = sorted((a + b for a, b in zip(first, reversed(second), strict=True)), reverse=True)
        heapq.heappush(heap, (parts[-1] - parts[0], -parts[0], created, parts))
        created += 1
    return sorted(heap[0][3]) if heap else [0] * k


def part_sums(weights: list[int], parts: list[list[int]]) -> list[int]:
    return sorted(sum(weights[i] for i in part) for part in parts)


@given(weights=st.lists(st.integers(0, 1000), max_size=40), k=st.integers(1, 12))
def test_matches_dense_reference(weights: list[int], k: int) -> None:
    parts = karmarkar_karp(weights, k)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    assert part_sums(weights, parts) == reference_part_sums(weights, k, equal_size=False)
    assert [sum(weights[i] for i in p) for p in parts] == sorted(part_sums(weights, parts), reverse=True)


@given(k=st.integers(1, 6), groups=st.integers(0, 6), data=st.data())
def test_equal_size_matches_dense_reference(k: int, groups: int, data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.integers(0, 1000), min_size=k * groups, max_size=k * groups))
    parts = karmarkar_karp(weights, k, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    assert {len(p) for p in parts} == {groups}
    assert part_sums(weights, parts) == reference_part_sums(weights, k, equal_size=True)


def test_large_k_is_fast_and_exact_on_sums() -> None:
    weights = np.random.default_rng(0).integers(50, 801, 3000).tolist()
    parts = karmarkar_karp(weights, 1000)
    assert part_sums(weights, parts) == reference_part_sums(weights, 1000, equal_size=False)


def test_two_way_textbook_example() -> None:
    # Largest differencing on {8, 7, 6, 5, 4}: 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2, so the final difference is 2.
    assert part_sums([8, 7, 6, 5, 4], karmarkar_karp([8, 7, 6, 5, 4], 2)) == [14, 16]


def test_balanced_packer_never_exceeds_capacity() -> None:
    lengths = np.random.default_rng(1).integers(50, 801, 1024)
    for multiple in (None, 8):
        bins = get_packer("karmarkar_karp", 1200, bin_count_multiple=multiple, min_bin_count=multiple).pack(lengths)
        loads = bin_loads(lengths, bins)
        assert loads.max() <= 1200
        assert len(bins) >= theoretical_min_bins(lengths, 1200)
        assert len(bins) % (multiple or 1) == 0
        assert sorted(i for b in bins for i in b) == list(range(1024))


def test_balanced_packer_with_many_sequences_per_microbatch() -> None:
    """The RL regime (tens of sequences per microbatch): the lower bound is met or nearly, and every microbatch
    holds close to the same number of tokens."""
    lengths = np.random.default_rng(2).integers(50, 801, 4096)
    bins = get_packer("karmarkar_karp", 16384).pack(lengths)
    loads = bin_loads(lengths, bins)
    assert len(bins) <= theoretical_min_bins(lengths, 16384) + 1
    assert loads.max() <= 16384
    assert loads.max() - loads.min() <= 800


def test_balance_bins_across_ranks() -> None:
    lengths = np.random.default_rng(3).integers(50, 801, 2048)
    bins = get_packer("first_fit_decreasing", 1200, bin_count_multiple=8).pack(lengths)
    dealt = balance_bins_across_ranks(bins, lengths, 8)
    assert sorted(map(tuple, dealt)) == sorted(map(tuple, bins))
    per_rank = rank_token_loads(lengths, dealt, 8)
    expected = reference_part_sums(bin_loads(lengths, bins).tolist(), 8, equal_size=True)
    assert sorted(per_rank.tolist()) == expected
    assert rank_imbalance(lengths, dealt, 8) <= rank_imbalance(lengths, bins, 8)
    position = {tuple(b): i for i, b in enumerate(bins)}
    for rank in range(8):  # a rank runs its bins in packer order
        mine = [position[tuple(b)] for b in dealt[rank::8]]
        assert mine == sorted(mine)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_parts must be a positive int, got num_parts=0"):
        karmarkar_karp([1, 2], 0)
    with pytest.raises(ValueError, match=r"number of items \(3\) to be a multiple of num_parts=2"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match=r"len\(bins\) = 3 must be a multiple of num_ranks=2"):
        balance_bins_across_ranks([[0], [1], [2]], [1, 2, 3], 2)
    with pytest.raises(ValueError, match="num_ranks must be a positive int, got num_ranks=0"):
        balance_bins_across_ranks([[0]], [1], 0)
