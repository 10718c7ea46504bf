"""How good a packing is: NeMo-RL's ``PackingMetrics`` (utilization, waste ratio, bin balance, theoretical minimum
bins, bin efficiency), plus the per-rank view used when bins are dealt to data-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def bin_loads(lengths: np.ndarray | Sequence[int], bins: Sequence[Sequence[int]]) -> np.ndarray:
    """``[num_bins]`` tokens per bin."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    if not sizes.sum():
        return np.zeros(len(bins), dtype=np.int64)
    members = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
    return np.bincount(np.repeat(np.arange(len(bins)), sizes), weights=lengths[members], minlength=len(bins)).astype(
        np.int64
    )


def theoretical_min_bins(lengths: np.ndarray | Sequence[int], bin_capacity: int) -> int:
    """The lower bound ``ceil(total tokens / capacity)``."""
    return math.ceil(int(np.asarray(lengths, dtype=np.int64).sum()) / bin_capacity)


def rank_token_loads(lengths: np.ndarray | Sequence[int], bins: Sequence[Sequence[int]], num_ranks: int) -> np.ndarray:
    """``[num_ranks]`` tokens per rank when rank ``r`` takes ``bins[r::num_ranks]`` (the round-robin deal)."""
    loads = bin_loads(lengths, bins)
    return np.bincount(np.arange(len(bins)) % num_ranks, weights=loads, minlength=num_ranks).astype(np.int64)


def rank_imbalance(lengths: np.ndarray | Sequence[int], bins: Sequence[Sequence[int]], num_ranks: int) -> float:
    """max / mean tokens over ranks under the round-robin deal (1.0 is perfect balance)."""
    per_rank = rank_token_loads(lengths, bins, num_ranks)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


class PackingMetrics:
    """Accumulates packing statistics over calls (NeMo-RL names and formulas)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total_sequences = 0
        self.total_bins = 0
        self.total_sequence_length = 0
        self.total_bin_capacity = 0
        self.total_waste = 0
        self.bin_utilizations: list[float] = []
        self.bin_counts: list[int] = []
        self.packing_times: list[float] = []
        self.min_utilization = 1.0
        self.max_utilization = 0.0
        self.min_waste_ratio = 1.0
        self.max_waste_ratio = 0.0

    def update(
        self,
        sequence_lengths: np.ndarray | Sequence[int],
        bins: Sequence[Sequence[int]],
        bin_capacity: int,
        packing_time: float | None = None,
    ) -> dict[str, float]:
        """Record one packing and return its own metrics."""
        stats = self.calculate_stats_only(sequence_lengths, bins, bin_capacity)
        self.total_sequences += int(stats["num_sequences"])
        self.total_bins += len(bins)
        self.total_sequence_length += int(stats["total_sequence_length"])
        self.total_bin_capacity += len(bins) * bin_capacity
        self.total_waste += int(stats["total_waste"])
        self.bin_utilizations.append(stats["average_utilization"])
        self.bin_counts.append(len(bins))
        if packing_time is not None:
            self.packing_times.append(packing_time)
        self.min_utilization = min(self.min_utilization, stats["average_utilization"])
        self.max_utilization = max(self.max_utilization, stats["average_utilization"])
        self.min_waste_ratio = min(self.min_waste_ratio, stats["waste_ratio"])
        self.max_waste_ratio = max(self.max_waste_ratio, stats["waste_ratio"])
        return stats

    @staticmethod
    def calculate_stats_only(
        sequence_lengths: np.ndarray | Sequence[int], bins: Sequence[Sequence[int]], bin_capacity: int
    ) -> dict[str, float]:
        """Metrics of one packing.

        ``average_utilization`` = tokens / (bins x capacity); ``waste_ratio`` = 1 - that; ``bin_balance`` =
        1 - stdev(per-bin utilization) / mean utilization (1.0 for a single bin); ``theoretical_min_bins`` =
        ceil(tokens / capacity); ``bin_efficiency`` = theoretical_min_bins / bins.
        """
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if not bins:
            return {
                "num_sequences": 0,
                "num_bins": 0,
                "total_sequence_length": 0,
                "total_bin_capacity": 0,
                "total_waste": 0,
                "average_utilization": 0.0,
                "waste_ratio": 0.0,
                "bin_balance": 0.0,
                "theoretical_min_bins": 0,
                "bin_efficiency": 0.0,
            }
        num_bins = len(bins)
        total_length = int(lengths.sum())
        total_capacity = num_bins * bin_capacity
        utilization = total_length / total_capacity
        per_bin = bin_loads(lengths, bins) / bin_capacity
        # Sample standard deviation (ddof=1), as Python's statistics.stdev in NeMo-RL.
        balance = 1.0 - float(np.std(per_bin, ddof=1)) / utilization if num_bins > 1 and utilization > 0 else 1.0
        min_bins = theoretical_min_bins(lengths, bin_capacity)
        return {
            "num_sequences": int(lengths.size),
            "num_bins": num_bins,
            "total_sequence_length": total_length,
            "total_bin_capacity": total_capacity,
            "total_waste": total_capacity - total_length,
            "average_utilization": utilization,
            "waste_ratio": (total_capacity - total_length) / total_capacity,
            "bin_balance": balance,
            "theoretical_min_bins": min_bins,
            "bin_efficiency": min_bins / num_bins,
        }

    def get_aggregated_stats(self) -> dict[str, float]:
        """Metrics over every recorded packing ({} before the first)."""
        if not self.bin_utilizations:
            return {}
        capacity = self.total_bin_capacity
        min_bins = math.ceil(self.total_sequence_length / (capacity / self.total_bins)) if self.total_bins else 0
        stats = {
            "total_sequences": self.total_sequences,
            "total_bins": self.total_bins,
            "average_utilization": self.total_sequence_length / capacity if capacity else 0.0,
            "min_utilization": self.min_utilization,
            "max_utilization": self.max_utilization,
            "average_waste_ratio": self.total_waste / capacity if capacity else 0.0,
            "min_waste_ratio": self.min_waste_ratio,
            "max_waste_ratio": self.max_waste_ratio,
            "average_bin_count": sum(self.bin_counts) / len(self.bin_counts),
            "bin_efficiency": min_bins / self.total_bins if self.total_bins else 0.0,
        }
        if self.packing_times:
            stats["average_packing_time"] = sum(self.packing_times) / len(self.packing_times)
        return stats

    def print_aggregated_stats(self) -> None:
        stats = self.get_aggregated_stats()
        if not stats:
            print("No metrics collected yet.")
            return
        print("\n=== Packing Metrics Summary ===")
        print(f"Total sequences packed: {stats['total_sequences']}")
        print(f"Total bins used: {stats['total_bins']}")
        print(
            f"Average bin utilization: {stats['average_utilization']:.4f} "
            f"(min: {stats['min_utilization']:.4f}, max: {stats['max_utilization']:.4f})"
        )
        print(
            f"Average waste ratio: {stats['average_waste_ratio']:.4f} "
            f"(min: {stats['min_waste_ratio']:.4f}, max: {stats['max_waste_ratio']:.4f})"
        )
        print(f"Bin efficiency (theoretical min bins / actual bins): {stats['bin_efficiency']:.4f}")
        if "average_packing_time" in stats:
            print(f"Average packing time: {stats['average_packing_time']:.6f} seconds")
        print("===============================\n")
