"""Sequence packers with NeMo-RL's interface: ``get_packer(algorithm, bin_capacity, ...).pack(lengths) -> bins``.

A bin is a list of indices into the lengths; every index appears in exactly one bin and no bin holds more than
``bin_capacity`` tokens. ``min_bin_count`` and ``bin_count_multiple`` then raise the bin count (NeMo-RL's rule: move
single sequences out of the bins holding the most sequences into new bins), which is how ``shard_by_batch_size``
gives every data-parallel rank the same number of microbatches.

Algorithms (all deterministic except ``first_fit_shuffle``, which is reproducible under a ``seed``):

=================================  =======================================================================
``concatenative``                  next fit in index order; bins are contiguous ranges
``first_fit_decreasing``           FFD
``first_fit_shuffle``              first fit in a random order
``modified_first_fit_decreasing``  Johnson & Garey's MFFD
``best_two_fit``                   FFD whose bins swap their smallest item for a better-filling pair
``karmarkar_karp``                 balanced microbatches (largest differencing), none over the capacity
=================================  =======================================================================

``best_two_fit`` gives the fewest bins (within 0.05 % of the lower bound on the benchmark workloads, where FFD and
MFFD are 0.1-0.2 % above it) at about the same speed; ``modified_first_fit_decreasing`` is what NeMo-RL recommends.
``karmarkar_karp`` pays off when a microbatch holds tens of sequences and equal token counts matter more than the
last few bins.

Lengths may be 0 (an empty sequence joins the first bin); negative lengths and lengths above the capacity are
errors, as are impossible bin-count constraints and unknown algorithm names.
"""

from __future__ import annotations

import enum
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from tritonrec.data.packing.balance import balanced_bins
from tritonrec.data.packing.checks import as_sequence_lengths
from tritonrec.data.packing.decreasing import best_two_fit, first_fit_decreasing, modified_first_fit_decreasing
from tritonrec.data.packing.metrics import PackingMetrics
from tritonrec.data.packing.ordered import concatenative, first_fit
from tritonrec.kernels.checks import check_int, check_optional_int

SequenceLengths = Sequence[int] | np.ndarray | torch.Tensor


class PackingAlgorithm(enum.Enum):
    """The packers :func:`get_packer` builds; names and values match NeMo-RL's where NeMo-RL has them."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"
    BEST_TWO_FIT = "best_two_fit"
    KARMARKAR_KARP = "karmarkar_karp"


class SequencePacker(ABC):
    """Packs sequence lengths into bins of ``bin_capacity`` tokens, then applies the bin-count constraints."""

    def __init__(
        self,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
    ) -> None:
        self.bin_capacity = check_int(bin_capacity, "bin_capacity", 1)
        self.min_bin_count = check_optional_int(min_bin_count, "min_bin_count", 0, what="None or an int >= 0")
        self.bin_count_multiple = check_optional_int(bin_count_multiple, "bin_count_multiple", 1,
                                                     what="None or an int >= 1")  # fmt: skip
        self.collect_metrics = collect_metrics
        self.metrics: PackingMetrics | None = PackingMetrics() if collect_metrics else None

    @abstractmethod
    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        """Bins for validated ``lengths [N]`` (int64, each within capacity), before the bin-count constraints."""

    def pack(self, sequence_lengths: SequenceLengths) -> list[list[int]]:
        """Bins as lists of indices into ``sequence_lengths`` (list, numpy array or integer tensor)."""
        lengths = as_sequence_lengths(sequence_lengths, self.bin_capacity)
        started = time.perf_counter()
        bins = self._adjust_bin_count(self._pack_implementation(lengths), int(lengths.size))
        if self.metrics is not None:
            self.metrics.update(lengths, bins, self.bin_capacity, time.perf_counter() - started)
        return bins

    def target_bin_count(self, natural_count: int) -> int:
        """The bin count the constraints ask for when the algorithm alone produced ``natural_count`` bins."""
        target = max(natural_count, self.min_bin_count or 0)
        if self.bin_count_multiple is not None:
            target = -(-target // self.bin_count_multiple) * self.bin_count_multiple
        return target

    def _adjust_bin_count(self, bins: list[list[int]], num_sequences: int) -> list[list[int]]:
        """Add bins until the constraints hold, moving one sequence at a time (NeMo-RL's rule): the last sequence
        of the bin holding the most sequences (ties: the later bin) goes to a new bin, so bins never overfill."""
        target = self.target_bin_count(len(bins))
        if target == len(bins):
            return bins
        if num_sequences < target:
            raise ValueError(
                f"min_bin_count={self.min_bin_count} and bin_count_multiple={self.bin_count_multiple} require "
                f"{target} bins, but there are only {num_sequences} sequences and each bin needs at least one"
            )
        sources = sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)
        adjusted = [list(b) for b in bins]
        source = 0
        for _ in range(target - len(bins)):
            while len(adjusted[sources[source][1]]) < 2:
                source += 1
            adjusted.append([adjusted[sources[source][1]].pop()])
        return adjusted

    def compute_metrics(self, sequence_lengths: SequenceLengths, bins: list[list[int]]) -> dict[str, float]:
        """Metrics of one packing (see :class:`PackingMetrics`), without recording them."""
        lengths = as_sequence_lengths(sequence_lengths, self.bin_capacity)
        return PackingMetrics.calculate_stats_only(lengths, bins, self.bin_capacity)

    def get_aggregated_metrics(self) -> dict[str, float]:
        """Metrics over every :meth:`pack` call so far ({} unless ``collect_metrics``)."""
        return self.metrics.get_aggregated_stats() if self.metrics is not None else {}

    def reset_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.reset()

    def print_metrics(self) -> None:
        if self.metrics is None:
            print("Metrics collection is not enabled. Initialize with collect_metrics=True.")
            return
        self.metrics.print_aggregated_stats()


class ConcatenativePacker(SequencePacker):
    """Next fit in index order: a bin closes when the next sequence does not fit."""

    max_sequences_per_bin = -1  # NeMo-RL's debugging knob: a positive value also caps the sequences per bin

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        return concatenative(lengths, self.bin_capacity, self.max_sequences_per_bin)


class FirstFitDecreasingPacker(SequencePacker):
    """Longest sequence first, each into the first bin with room."""

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        return first_fit_decreasing(lengths, self.bin_capacity)


class FirstFitShufflePacker(SequencePacker):
    """First fit in a random order. ``seed`` fixes the order; without it the order is drawn from Python's global
    ``random`` state, so ``random.seed(...)`` reproduces a run as it does in NeMo-RL."""

    def __init__(self, *args: object, seed: int | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seed = seed

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        order = np.random.default_rng(seed).permutation(lengths.size)
        return first_fit(lengths, self.bin_capacity, order)


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Johnson & Garey's MFFD (see :func:`~tritonrec.data.packing.decreasing.modified_first_fit_decreasing`)."""

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        return modified_first_fit_decreasing(lengths, self.bin_capacity)


class BestTwoFitPacker(SequencePacker):
    """FFD with a pair swap per bin; the fewest bins of these packers in practice (see
    :func:`~tritonrec.data.packing.decreasing.best_two_fit`)."""

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        return best_two_fit(lengths, self.bin_capacity)


class KarmarkarKarpPacker(SequencePacker):
    """Microbatches with nearly equal token counts, none above capacity (see
    :func:`~tritonrec.data.packing.balance.balanced_bins`). Its bin count already honours the constraints."""

    def _pack_implementation(self, lengths: np.ndarray) -> list[list[int]]:
        return balanced_bins(lengths, self.bin_capacity, self.min_bin_count or 0, self.bin_count_multiple or 1)


_PACKERS: dict[PackingAlgorithm, type[SequencePacker]] = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm.BEST_TWO_FIT: BestTwoFitPacker,
    PackingAlgorithm.KARMARKAR_KARP: KarmarkarKarpPacker,
}


def resolve_algorithm(algorithm: PackingAlgorithm | str) -> PackingAlgorithm:
    """The enum member for ``algorithm`` (a member, its value, or its name in any case)."""
    if isinstance(algorithm, PackingAlgorithm):
        return algorithm
    if isinstance(algorithm, str):
        for member in PackingAlgorithm:
            if algorithm.lower() == member.value:
                return member
    choices = ", ".join(member.value for member in PackingAlgorithm)
    raise ValueError(f"Unknown packing algorithm: algorithm={algorithm!r}. Available algorithms: {choices}")


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
    seed: int | None = None,
) -> SequencePacker:
    """Build the packer for ``algorithm``. ``seed`` only matters to ``first_fit_shuffle`` (the others are
    deterministic and ignore it)."""
    packer_type = _PACKERS[resolve_algorithm(algorithm)]
    kwargs = {
        "collect_metrics": collect_metrics,
        "min_bin_count": min_bin_count,
        "bin_count_multiple": bin_count_multiple,
    }
    if packer_type is FirstFitShufflePacker:
        return FirstFitShufflePacker(bin_capacity, seed=seed, **kwargs)
    return packer_type(bin_capacity, **kwargs)
