"""Sequence packing: NeMo-RL's packers (``get_packer``), faster and with two more algorithms, the Karmarkar-Karp
balancers, and packing metrics. See :mod:`tritonrec.data.packing.algorithms`."""

from tritonrec.data.packing.algorithms import (
    BestTwoFitPacker,
    ConcatenativePacker,
    FirstFitDecreasingPacker,
    FirstFitShufflePacker,
    KarmarkarKarpPacker,
    ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm,
    SequencePacker,
    get_packer,
)
from tritonrec.data.packing.balance import balance_bins_across_ranks, balanced_bins, karmarkar_karp
from tritonrec.data.packing.metrics import (
    PackingMetrics,
    bin_loads,
    rank_imbalance,
    rank_token_loads,
    theoretical_min_bins,
)

__all__ = [
    "BestTwoFitPacker",
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "KarmarkarKarpPacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackingAlgorithm",
    "PackingMetrics",
    "SequencePacker",
    "balance_bins_across_ranks",
    "balanced_bins",
    "bin_loads",
    "get_packer",
    "karmarkar_karp",
    "rank_imbalance",
    "rank_token_loads",
    "theoretical_min_bins",
]
