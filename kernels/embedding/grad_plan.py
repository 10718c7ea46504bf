"""The deterministic backward plan: which gradient rows add up into which table row, in a canonical order.

Every looked-up value contributes ``scale * grad[goff : goff + D]`` to one table row, where ``goff`` is the element
offset of its gradient row in a flat gradient buffer (pooled: its bag's slice of ``grad_output [B, sum(D)]``;
sequence: its own output row) and ``scale`` is its per-sample weight divided by its bag divisor (MEAN), or 1.

Duplicate rows in a batch are combined once per row: contributions are sorted by global row and each row's run is
summed by one program (Triton) or one ``index_add_`` segment (torch), then the optimizer touches the row once.

Why a second sort key: floating-point addition is not associative, so summing a row's contributions in input order
would make the result depend on how the batch was ordered. Within a row, contributions are therefore ordered by a
fingerprint of *what* they add (a 64-bit hash of the gradient row's bits, the feature and the scale), not *where*
they sit in the batch. Permuting samples, bags or values leaves each row's ordered run unchanged, so the updated
weights are bit-identical. Two different contributions share a fingerprint only on a 64-bit hash collision; equal
contributions may share one freely, since their order cannot change the sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tritonrec.kernels.embedding.layout import PoolingMode, TableBatchedLayout, value_features
from tritonrec.kernels.random_bits import mix32_

# Odd 64-bit multipliers (as signed int64) that spread the feature id and the scale bits over the fingerprint.
_MIX_FEATURE = 0x2545F4914F6CDD1D
_MIX_SCALE = -0x61C8864680B583EB
_MIX_ROW = -0x40A7B892E31B1A47


@dataclass
class ValueGradientInfo:
    """Per value ``[N]``: its gradient row offset, its table's first global row, its scale (``None`` = all ones),
    whether its index is in range (``None`` = all are) and, for pooled lookups, its bag divisor (``None`` = 1).

    Each value's feature (and, pooled, its sample) is kept per bag and only expanded to ``[N]`` when asked for.
    """

    grad_offsets: torch.Tensor
    row_offsets: torch.Tensor
    scales: torch.Tensor | None
    valid: torch.Tensor | None
    divisors: torch.Tensor | None = None
    bags: torch.Tensor | None = None
    bag_features: torch.Tensor | None = None
    bag_samples: torch.Tensor | None = None
    value_features: torch.Tensor | None = None

    @property
    def features(self) -> torch.Tensor:
        """``[N]`` feature of every value."""
        if self.value_features is None:
            self.value_features = self.bag_features[self.bags]
        return self.value_features

    def features_of(self, positions: torch.Tensor) -> torch.Tensor:
        if self.value_features is not None:
            return self.value_features[positions]
        return self.bag_features[self.bags[positions]]

    def samples_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Pooled lookups: the sample (output row) of the values at ``positions``."""
        return self.bag_samples[self.bags[positions]]


@dataclass(frozen=True)
class RowGradientPlan:
    """Contributions sorted by (global row, fingerprint), segmented per unique row.

    ``sorted_grad_offsets [M]`` / ``sorted_scales [M]`` (M = valid contributions), ``segment_offsets [U + 1]``,
    ``unique_rows [U]`` (global row numbers, ascending), ``unique_tables [U]`` and ``unique_local_rows [U]`` (row
    inside its table). Host lists ``[T + 1]``:
    ``table_unique_offsets`` (table ``t`` owns unique rows ``[a_t, a_{t+1})``) and ``table_contribution_offsets``.
    """

    sorted_grad_offsets: torch.Tensor
    sorted_scales: torch.Tensor | None
    segment_offsets: torch.Tensor
    unique_rows: torch.Tensor
    unique_tables: torch.Tensor
    unique_local_rows: torch.Tensor
    table_unique_offsets: list[int]
    table_contribution_offsets: list[int]

    @property
    def num_unique(self) -> int:
        return self.table_unique_offsets[-1]


@functools.lru_cache(maxsize=64)
def _column_keys(width: int, device: torch.device) -> torch.Tensor:
    """``[width]`` odd int64 multipliers, one per column, from two 32-bit hashes of the column number (any
    well-mixed values do: they only make fingerprint collisions unlikely)."""
    cols = torch.arange(width, dtype=torch.int64, device=device)
    hi = mix32_(cols ^ 0x5BD1E995)  # mix32_ hashes in place: both operands are fresh tensors
    lo = mix32_(cols + 0x1B873593)
    return (hi << 32) | lo | 1


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """``[R, D]`` fp32 -> ``[R]`` int64: a wrapping sum of each element's bit pattern times a per-column key.

    Integer arithmetic modulo 2**64 is associative, so any summation order gives the same fingerprint: CPU uses a
    matrix-vector product (one pass, no temporary), CUDA (no int64 matmul) an elementwise product and a sum."""
    bits = rows.contiguous().view(torch.int32).to(torch.int64)
    keys = _column_keys(rows.shape[1], rows.device)
    return (bits * keys).sum(dim=1) if rows.is_cuda else bits @ keys


def pooled_value_info(
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    batch_size: int,
    grad_row_stride: int,
    all_rows_valid: bool,
) -> ValueGradientInfo:
    """Per-value gradient addressing for a pooled lookup (bag-level values gathered once per value)."""
    meta = layout.tensors(indices.device)
    num_bags = layout.num_features * batch_size
    lengths = (offsets[1:] - offsets[:-1]).long()
    bag_ids = torch.arange(num_bags, device=indices.device)
    bags = torch.repeat_interleave(bag_ids, lengths, output_size=indices.numel())
    bag_features = bag_ids // max(batch_size, 1)
    bag_samples = bag_ids - bag_features * batch_size
    bag_grad_offsets = bag_samples * grad_row_stride + meta.feature_out_offsets.long()[bag_features]
    scales = None if per_sample_weights is None else per_sample_weights.float()
    divisors = None
    if any(layout.tables[t].pooling == PoolingMode.MEAN for t in layout.feature_tables):
        bag_divisor = lengths.float() if bag_divisors is None else bag_divisors.float()
        divisors = torch.where(meta.feature_mean.bool()[bag_features], bag_divisor, 1.0)[bags]
        numerator = torch.ones_like(divisors) if scales is None else scales
        scales = torch.where(divisors > 0, numerator / divisors.clamp(min=1e-30), 0.0)
    valid = None
    if not all_rows_valid:
        valid = (indices >= 0) & (indices < meta.feature_rows[bag_features][bags])
    return ValueGradientInfo(
        grad_offsets=bag_grad_offsets[bags],
        row_offsets=meta.feature_row_offsets[bag_features][bags],
        scales=scales,
        valid=valid,
        divisors=divisors,
        bags=bags,
        bag_features=bag_features,
        bag_samples=bag_samples,
    )


def sequence_value_info(
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    feature_value_offsets: Sequence[int],
    all_rows_valid: bool,
) -> ValueGradientInfo:
    """Per-value gradient addressing for a sequence lookup whose output is the flat concatenation of per-feature
    ``[N_f, D_f]`` blocks."""
    meta = layout.tensors(indices.device)
    device = indices.device
    features = value_features(feature_value_offsets, device)
    block_starts = [0]
    for f, dim in enumerate(layout.feature_dims):
        block_starts.append(block_starts[-1] + (feature_value_offsets[f + 1] - feature_value_offsets[f]) * dim)
    block_start = torch.tensor(block_starts[:-1], dtype=torch.int64, device=device)
    value_start = torch.tensor(list(feature_value_offsets[:-1]), dtype=torch.int64, device=device)
    position = torch.arange(indices.numel(), device=device) - value_start[features]
    grad_offsets = block_start[features] + position * meta.feature_dims.long()[features]
    valid = None if all_rows_valid else (indices >= 0) & (indices < meta.feature_rows[features])
    return ValueGradientInfo(grad_offsets, meta.feature_row_offsets[features], None, valid, value_features=features)


Fingerprints = Callable[[torch.Tensor], torch.Tensor]
"""Maps value positions ``[K]`` to their contributions' int64 fingerprints ``[K]`` (only duplicates need one)."""


def pooled_fingerprints(info: ValueGradientInfo, grad_output: torch.Tensor) -> Fingerprints:
    """Fingerprints of pooled contributions: hash of the sample's gradient row, the feature and the scale."""

    def fingerprints(positions: torch.Tensor) -> torch.Tensor:
        sample_keys = row_fingerprints(grad_output)
        keys = sample_keys[info.samples_of(positions)] + info.features_of(positions) * _MIX_FEATURE
        if info.scales is not None:
            keys = keys + info.scales[positions].view(torch.int32).to(torch.int64) * _MIX_SCALE
        return keys

    return fingerprints


def sequence_fingerprints(info: ValueGradientInfo, layout: TableBatchedLayout, grad_flat: torch.Tensor) -> Fingerprints:
    """Fingerprints of sequence contributions: hash of each value's own gradient row and its feature."""

    def fingerprints(positions: torch.Tensor) -> torch.Tensor:
        keys = torch.zeros(positions.numel(), dtype=torch.int64, device=positions.device)
        features = info.features_of(positions)
        for f, dim in enumerate(layout.feature_dims):
            mine = (features == f).nonzero().squeeze(1)
            if mine.numel():
                offsets = info.grad_offsets[positions[mine]]
                window = grad_flat.as_strided((grad_flat.numel() - dim + 1, dim), (1, 1))
                keys[mine] = row_fingerprints(window.index_select(0, offsets)) * _MIX_ROW + f * _MIX_FEATURE
        return keys

    return fingerprints


def long_runs(
    segment_offsets: torch.Tensor, counts: torch.Tensor, skip_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted positions of the contributions in runs of two or more (rows looked up more than once), and each one's
    run (its unique-row index); ``skip_first`` leaves out each run's first contribution. Costs O(duplicates)."""
    runs = (counts > 1).nonzero().squeeze(1)
    lengths = counts[runs] - int(skip_first)
    total = int(lengths.sum()) if runs.numel() else 0
    run_of = torch.repeat_interleave(runs, lengths, output_size=total)
    run_starts = torch.cumsum(lengths, dim=0) - lengths
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(run_starts, lengths, output_size=total)
    return segment_offsets[run_of] + int(skip_first) + within, run_of


def _canonical_order(rows: torch.Tensor, fingerprints: Fingerprints) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permutation sorting contributions by (row, fingerprint), the unique rows and their run offsets ``[U + 1]``.

    One stable sort by row; only runs of several contributions (duplicates, usually few) get fingerprints and are
    re-ordered by them, with two small stable sorts."""
    sorted_rows, order = torch.sort(rows, stable=True)
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    segment_offsets = torch.zeros(unique_rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, dim=0, out=segment_offsets[1:])
    if unique_rows.numel() < rows.numel():
        positions, run_of = long_runs(segment_offsets, counts)
        by_fingerprint = torch.argsort(fingerprints(order[positions]), stable=True)
        by_run = torch.argsort(run_of[by_fingerprint], stable=True)
        order[positions] = order[positions][by_fingerprint[by_run]]
    return order, unique_rows.long(), segment_offsets


def build_row_gradient_plan(
    layout: TableBatchedLayout, indices: torch.Tensor, info: ValueGradientInfo, fingerprints: Fingerprints
) -> RowGradientPlan:
    """Sort contributions by (global row, fingerprint) and segment them per unique row. Out-of-range values drop."""
    meta = layout.tensors(indices.device)
    global_rows = indices.long() + info.row_offsets
    if layout.num_rows < 2**31:  # int32 keys sort about twice as fast
        global_rows = global_rows.int()
    grad_offsets, scales = info.grad_offsets, info.scales
    if info.valid is not None:
        keep = info.valid.nonzero().squeeze(1)
        global_rows, grad_offsets = global_rows[keep], grad_offsets[keep]
        scales = None if scales is None else scales[keep]
        of_all_values = fingerprints

        def fingerprints(positions: torch.Tensor) -> torch.Tensor:  # positions among the kept values
            return of_all_values(keep[positions])

    order, unique_rows, segment_offsets = _canonical_order(global_rows, fingerprints)
    unique_tables = torch.searchsorted(meta.table_row_offsets[1:], unique_rows, right=True)
    table_unique = torch.searchsorted(unique_rows, meta.table_row_offsets)
    return RowGradientPlan(
        sorted_grad_offsets=grad_offsets[order],
        sorted_scales=None if scales is None else scales[order],
        segment_offsets=segment_offsets,
        unique_rows=unique_rows,
        unique_tables=unique_tables,
        unique_local_rows=unique_rows - meta.table_row_offsets[unique_tables],
        table_unique_offsets=table_unique.tolist(),
        table_contribution_offsets=segment_offsets[table_unique].tolist(),
    )
