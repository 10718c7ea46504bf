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
weights are bit-identical. Two different contributions to one row tie only on a collision of the fingerprint's top
40+ bits (the bits the sort keeps); equal contributions may tie freely, since their order cannot change the sum.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tritonrec.kernels.embedding.layout import PoolingMode, TableBatchedLayout, value_features
from tritonrec.kernels.random_bits import mix32_
from tritonrec.kernels.runs import repeat_runs

# Odd 64-bit multipliers (as signed int64) that spread the feature id and the scale bits over the fingerprint.
_MIX_FEATURE = 0x2545F4914F6CDD1D
_MIX_SCALE = -0x61C8864680B583EB
_MIX_ROW = -0x40A7B892E31B1A47


def _int64_product(a: int, b: int) -> int:
    """``a * b`` wrapped to int64, as the same product of int64 tensors gives (a Python int past 2**64 does not
    convert to a tensor scalar: slot 7 of a layout times ``_MIX_FEATURE`` is)."""
    return (a * b + 2**63) % 2**64 - 2**63


@dataclass
class ValueGradientInfo:
    """Per value ``[N]``: its gradient row offset, its table's first global row (pooled: int32 when every global row
    fits), its scale (``None`` = all ones), whether its index is in range (``None`` = all are) and, for pooled
    lookups, its bag divisor (``None`` = 1) and the row stride of the gradient (``grad_row_stride``: every gradient
    row of a feature lies on that grid).

    Pooled lookups keep each value's feature per bag (``bag_offsets [F * B + 1]`` say which values a bag holds) and
    read a value's sample and feature back from its gradient offset (``feature_grad_starts [F]``: each feature's
    first column), only for the values that need them.
    """

    grad_offsets: torch.Tensor
    row_offsets: torch.Tensor
    scales: torch.Tensor | None
    valid: torch.Tensor | None
    divisors: torch.Tensor | None = None
    bag_offsets: torch.Tensor | None = None
    bag_features: torch.Tensor | None = None
    feature_grad_starts: torch.Tensor | None = None
    value_features: torch.Tensor | None = None
    grad_row_stride: int | None = None

    @property
    def features(self) -> torch.Tensor:
        """``[N]`` feature of every value."""
        if self.value_features is None:
            lengths = self.bag_offsets[1:] - self.bag_offsets[:-1]
            num_values = self.row_offsets.numel()
            self.value_features = torch.repeat_interleave(self.bag_features, lengths, output_size=num_values)
        return self.value_features

    def samples_and_features_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled lookups: the sample (output row) and the feature of the values at ``positions``, from their
        gradient offsets ``sample * grad_row_stride + feature_grad_starts[feature]`` (no per-value bag table)."""
        grad_offsets = self.grad_offsets.index_select(0, positions)
        samples = grad_offsets.div(self.grad_row_stride, rounding_mode="floor")
        columns = grad_offsets - samples * self.grad_row_stride
        return samples, torch.searchsorted(self.feature_grad_starts, columns, right=True) - 1

    def features_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The feature of the values at ``positions``."""
        if self.value_features is not None:
            return self.value_features.index_select(0, positions)
        return self.samples_and_features_of(positions)[1]


@dataclass(frozen=True)
class RowGradientPlan:
    """Contributions sorted by (global row, fingerprint), segmented per unique row.

    ``sorted_grad_offsets [M]`` / ``sorted_scales [M]`` (M = valid contributions), ``segment_offsets [U + 1]``,
    ``unique_rows [U]`` (global row numbers, ascending), ``unique_tables [U]`` and ``unique_local_rows [U]`` (row
    inside its table; both built on first use, since the torch twin rarely needs them). Host lists ``[T + 1]``:
    ``table_unique_offsets`` (table ``t`` owns unique rows ``[a_t, a_{t+1})``) and ``table_contribution_offsets``.
    ``table_row_offsets [T + 1]``: the layout's first global row of each table. ``grad_row_stride``: as in
    :class:`ValueGradientInfo` (lets the torch twin read gradient rows in place).
    """

    sorted_grad_offsets: torch.Tensor
    sorted_scales: torch.Tensor | None
    segment_offsets: torch.Tensor
    unique_rows: torch.Tensor
    table_row_offsets: torch.Tensor
    table_unique_offsets: list[int]
    table_contribution_offsets: list[int]
    grad_row_stride: int | None = None

    @property
    def num_unique(self) -> int:
        return self.table_unique_offsets[-1]

    @functools.cached_property
    def unique_tables(self) -> torch.Tensor:
        """``[U]`` int64: the table of every unique row (runs of equal values, tables in order)."""
        counts = torch.tensor(
            [b - a for a, b in itertools.pairwise(self.table_unique_offsets)], device=self.unique_rows.device
        )
        tables = torch.arange(counts.numel(), device=counts.device)
        return repeat_runs(tables, counts, self.num_unique)

    @functools.cached_property
    def unique_local_rows(self) -> torch.Tensor:
        """``[U]`` int64: every unique row's number inside its table."""
        return self.unique_rows - self.table_row_offsets.index_select(0, self.unique_tables)


@functools.lru_cache(maxsize=64)
def _column_keys(width: int, device: torch.device) -> torch.Tensor:
    """``[2, width]`` odd int32 multipliers, two per column, from 32-bit hashes of the column number (any
    well-mixed values do: they only make fingerprint collisions unlikely)."""
    cols = torch.arange(width, dtype=torch.int64, device=device)
    hi = mix32_(cols ^ 0x5BD1E995)  # mix32_ hashes in place: both operands are fresh tensors
    lo = mix32_(cols + 0x1B873593)
    keys = torch.stack([hi, lo]) | 1
    return torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)  # the same 32 bits, as signed int32


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """``[R, D]`` fp32 -> ``[R]`` int64: two wrapping 32-bit sums of each element's bit pattern times a per-column
    key, as the high and low halves.

    Integer arithmetic modulo 2**32 is associative, so any summation order gives the same fingerprint: CPU multiplies
    the int32 bit patterns by the keys as int32 matrices, CUDA (no integer matmul) sums the int32 products in int64
    (:func:`_halves_elementwise`); neither makes an int64 copy of the rows."""
    bits = rows.contiguous().view(torch.int32)
    keys = _column_keys(rows.shape[1], rows.device)
    if rows.is_cuda:
        halves = _halves_elementwise(bits, keys)
    else:  # [2, D] @ [D, R]: the fast orientation of torch's integer matmul
        halves = (keys @ bits.t()).long()
    halves &= 0xFFFFFFFF
    return (halves[0] << 32) | halves[1]


def _halves_elementwise(bits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``bits [R, D]`` int32, ``keys [2, D]`` int32 -> ``[2, R]`` int64 whose low 32 bits are those of the integer
    matmul ``keys @ bits.T``: int32 products wrap modulo 2**32, which keeps the low 32 bits of the exact products,
    and summing them in int64 keeps the low 32 bits of the exact sum. (Multiplying int64 copies instead moved twice
    the bytes: on an H200 at 8192 x 4096 gradient rows, each product took 143 us against 99 us now.)"""
    return torch.stack([(bits * k).sum(dim=1, dtype=torch.int64) for k in keys])


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
    device, num_values = indices.device, indices.numel()
    num_bags = layout.num_features * batch_size
    bag_offsets = offsets.long()
    lengths = bag_offsets[1:] - bag_offsets[:-1]
    bag_ids = torch.arange(num_bags, device=device)
    bag_features = bag_ids // max(batch_size, 1)
    bag_samples = bag_ids - bag_features * batch_size
    feature_grad_starts = meta.feature_out_offsets.long()
    bag_grad_offsets = bag_samples * grad_row_stride + feature_grad_starts.index_select(0, bag_features)

    def per_value(per_bag: torch.Tensor) -> torch.Tensor:  # [F * B] -> [N], each bag's value repeated over its values
        return torch.repeat_interleave(per_bag, lengths, output_size=num_values)

    # values are key-major: a feature's values are one run, so per-feature values repeat once per feature
    feature_lengths = bag_offsets[::batch_size].diff() if batch_size else torch.zeros_like(meta.feature_rows)
    feature_row_offsets = meta.feature_row_offsets.int() if layout.num_rows < 2**31 else meta.feature_row_offsets
    row_offsets = repeat_runs(feature_row_offsets, feature_lengths, num_values)
    scales = None if per_sample_weights is None else per_sample_weights.float()
    divisors = None
    if any(layout.tables[t].pooling == PoolingMode.MEAN for t in layout.feature_tables):
        bag_divisor = lengths.float() if bag_divisors is None else bag_divisors.float()
        divisors = per_value(torch.where(meta.feature_mean.bool().index_select(0, bag_features), bag_divisor, 1.0))
        numerator = torch.ones_like(divisors) if scales is None else scales
        scales = torch.where(divisors > 0, numerator / divisors.clamp(min=1e-30), 0.0)
    valid = None
    if not all_rows_valid:
        bounds = repeat_runs(meta.feature_rows, feature_lengths, num_values)
        valid = (indices >= 0) & (indices < bounds)
    return ValueGradientInfo(
        grad_offsets=per_value(bag_grad_offsets),
        row_offsets=row_offsets,
        scales=scales,
        valid=valid,
        divisors=divisors,
        bag_offsets=bag_offsets,
        bag_features=bag_features,
        feature_grad_starts=feature_grad_starts,
        grad_row_stride=grad_row_stride,
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
    position = torch.arange(indices.numel(), device=device) - value_start.index_select(0, features)
    grad_offsets = block_start.index_select(0, features) + position * meta.feature_dims.long().index_select(0, features)
    valid = None if all_rows_valid else (indices >= 0) & (indices < meta.feature_rows.index_select(0, features))
    row_offsets = meta.feature_row_offsets.index_select(0, features)
    return ValueGradientInfo(grad_offsets, row_offsets, None, valid, value_features=features)


Fingerprints = Callable[[torch.Tensor], torch.Tensor]
"""Maps value positions ``[K]`` to their contributions' int64 fingerprints ``[K]`` (only duplicates need one)."""


def pooled_fingerprints(info: ValueGradientInfo, grad_output: torch.Tensor) -> Fingerprints:
    """Fingerprints of pooled contributions: hash of the sample's gradient row, the feature and the scale."""

    def fingerprints(positions: torch.Tensor) -> torch.Tensor:
        sample_keys = row_fingerprints(grad_output)
        samples, features = info.samples_and_features_of(positions)
        keys = sample_keys.index_select(0, samples) + features * _MIX_FEATURE
        if info.scales is not None:
            keys = keys + info.scales.index_select(0, positions).view(torch.int32).to(torch.int64) * _MIX_SCALE
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
                keys[mine] = row_fingerprints(window.index_select(0, offsets)) * _MIX_ROW + _int64_product(
                    f, _MIX_FEATURE
                )
        return keys

    return fingerprints


def _duplicated_runs(
    segment_offsets: torch.Tensor, counts: torch.Tensor, num_contributions: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sorted positions ``[K]`` of the contributions in runs of two or more (rows looked up more than once), each
    one's run rank among those runs ``[K]``, and the number of such runs. Costs O(duplicates) after one pass over
    ``counts [U]``."""
    runs = (counts > 1).nonzero().squeeze(1)
    lengths = counts.index_select(0, runs)
    # every other run holds one contribution, so K follows from sizes the host knows (reading it is a GPU sync)
    total = num_contributions - (counts.numel() - runs.numel())
    rank = torch.repeat_interleave(torch.arange(runs.numel(), device=counts.device), lengths, output_size=total)
    # position = the run's first contribution + the index within the run = k + (run start - k of the run's first)
    shift = segment_offsets.index_select(0, runs) - (torch.cumsum(lengths, dim=0) - lengths)
    positions = torch.arange(total, device=counts.device) + torch.repeat_interleave(shift, lengths, output_size=total)
    return positions, rank, runs.numel()


def _canonical_order(rows: torch.Tensor, fingerprints: Fingerprints) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permutation sorting contributions by (row, fingerprint), the unique rows and their run offsets ``[U + 1]``.

    One stable sort by row; only runs of several contributions (duplicates, usually few) get fingerprints and are
    re-ordered by them, with one small sort of (run rank, the fingerprint's top bits) packed into one int64 key (the
    fingerprint keeps at least 40 bits while there are fewer than 2**23 duplicated rows)."""
    sorted_rows, order = torch.sort(rows, stable=True)
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    segment_offsets = torch.empty(unique_rows.numel() + 1, dtype=torch.int64, device=rows.device)
    segment_offsets[:1] = 0
    torch.cumsum(counts, dim=0, out=segment_offsets[1:])
    if unique_rows.numel() < rows.numel():
        positions, rank, num_runs = _duplicated_runs(segment_offsets, counts, rows.numel())
        in_runs = order.index_select(0, positions)
        fingerprint_bits = 63 - max(num_runs - 1, 1).bit_length()
        top_bits = (fingerprints(in_runs) >> (64 - fingerprint_bits)) & ((1 << fingerprint_bits) - 1)
        by_key = torch.argsort((rank << fingerprint_bits) | top_bits, stable=True)
        order.index_copy_(0, positions, in_runs.index_select(0, by_key))
    return order, unique_rows.long(), segment_offsets


def build_row_gradient_plan(
    layout: TableBatchedLayout, indices: torch.Tensor, info: ValueGradientInfo, fingerprints: Fingerprints
) -> RowGradientPlan:
    """Sort contributions by (global row, fingerprint) and segment them per unique row. Out-of-range values drop."""
    meta = layout.tensors(indices.device)
    if layout.num_rows < 2**31:  # int32 keys sort about twice as fast (out-of-range indices wrap, then drop)
        global_rows = indices.int() + info.row_offsets.int()
    else:
        global_rows = indices.long() + info.row_offsets
    grad_offsets, scales = info.grad_offsets, info.scales
    if info.valid is not None:
        keep = info.valid.nonzero().squeeze(1)
        global_rows, grad_offsets = global_rows.index_select(0, keep), grad_offsets.index_select(0, keep)
        scales = None if scales is None else scales.index_select(0, keep)
        of_all_values = fingerprints

        def fingerprints(positions: torch.Tensor) -> torch.Tensor:  # positions among the kept values
            return of_all_values(keep.index_select(0, positions))

    order, unique_rows, segment_offsets = _canonical_order(global_rows, fingerprints)
    table_unique = torch.searchsorted(unique_rows, meta.table_row_offsets)
    # both per-table boundaries in one host read (one GPU sync instead of two)
    bounds = torch.cat([table_unique, segment_offsets.index_select(0, table_unique)]).tolist()
    num_bounds = table_unique.numel()
    return RowGradientPlan(
        sorted_grad_offsets=grad_offsets.index_select(0, order),
        sorted_scales=None if scales is None else scales.index_select(0, order),
        segment_offsets=segment_offsets,
        unique_rows=unique_rows,
        table_row_offsets=meta.table_row_offsets,
        table_unique_offsets=bounds[:num_bounds],
        table_contribution_offsets=bounds[num_bounds:],
        grad_row_stride=info.grad_row_stride,
    )
