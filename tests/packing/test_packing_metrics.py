"""Packing metrics against hand computations."""

from __future__ import annotations

import statistics

import pytest

from tritonrec.data.packing import PackingMetrics, bin_loads, rank_imbalance, rank_token_loads, theoretical_min_bins

LENGTHS = [60, 40, 30, 70, 50]
BINS = [[0, 1], [2, 3], [4]]  # loads 100, 100, 50 at capacity 100


def test_single_packing() -> None:
    stats = PackingMetrics().calculate_stats_only(LENGTHS, BINS, 100)
    assert stats["num_sequences"] == 5
    assert stats["num_bins"] == 3
    assert stats["total_sequence_length"] == 250
    assert stats["total_bin_capacity"] == 300
    assert stats["total_waste"] == 50
    assert stats["average_utilization"] == pytest.approx(250 / 300)
    assert stats["waste_ratio"] == pytest.approx(50 / 300)
    assert stats["bin_balance"] == pytest.approx(1 - statistics.stdev([1.0, 1.0, 0.5]) / (250 / 300))
    assert stats["theoretical_min_bins"] == 3
    assert stats["bin_efficiency"] == 1.0


def test_one_bin_and_no_bins() -> None:
    assert PackingMetrics.calculate_stats_only([30, 20], [[0, 1]], 100)["bin_balance"] == 1.0
    empty = PackingMetrics.calculate_stats_only([], [], 100)
    assert empty["num_bins"] == 0 and empty["bin_efficiency"] == 0.0


def test_aggregation_over_calls() -> None:
    metrics = PackingMetrics()
    assert metrics.get_aggregated_stats() == {}
    metrics.update(LENGTHS, BINS, 100, packing_time=0.5)
    metrics.update([100, 100], [[0], [1]], 100, packing_time=1.5)
    stats = metrics.get_aggregated_stats()
    assert stats["total_sequences"] == 7
    assert stats["total_bins"] == 5
    assert stats["average_utilization"] == pytest.approx(450 / 500)
    assert stats["min_utilization"] == pytest.approx(250 / 300)
    assert stats["max_utilization"] == 1.0
    assert stats["average_bin_count"] == 2.5
    assert stats["bin_efficiency"] == pytest.approx(5 / 5)
    assert stats["average_packing_time"] == 1.0
    metrics.reset()
    assert metrics.get_aggregated_stats() == {}


def test_loads_bounds_and_ranks() -> None:
    assert bin_loads(LENGTHS, BINS).tolist() == [100, 100, 50]
    assert bin_loads([5], [[]]).tolist() == [0]
    assert theoretical_min_bins(LENGTHS, 100) == 3
    assert theoretical_min_bins(LENGTHS, 251) == 1
    # Round-robin deal over 2 ranks: rank 0 takes bins 0 and 2, rank 1 takes bin 1.
    assert rank_token_loads(LENGTHS, BINS, 2).tolist() == [150, 100]
    assert rank_imbalance(LENGTHS, BINS, 2) == pytest.approx(150 / 125)
    assert rank_imbalance([], [], 4) == 1.0
