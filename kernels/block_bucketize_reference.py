"""The torch twin of :mod:`tritonrec.kernels.block_bucketize`: the specification its Triton kernels must equal bit
for bit, and the CPU implementation of the ``block_bucketize_sparse_features`` operator. Kept apart from the kernels
so the op module reads kernel, launcher, operator, public function; the twin is re-exported there.

Buckets come from per-feature block sizes (every rank a ``ceil(rows / W)`` block) or, with ``block_bucketize_pos``,
from per-feature row boundaries (FBGEMM's ``block_bucketize_pos``: uneven blocks, explicit rows per rank): index
``i`` of feature ``t`` with boundaries ``pos = block_bucketize_pos[t]`` (``num_buckets + 1`` non-decreasing entries
from 0) goes to the bucket ``p`` with ``pos[p] <= i < pos[p + 1]`` (the last such ``p`` where empty blocks share a
boundary), local index ``i - pos[p]``; ids ``i >= pos[num_buckets]`` are spread round-robin as past the blocks.
"""

from __future__ import annotations

import torch

from tritonrec.kernels.checks import host_ints
from tritonrec.kernels.runs import repeat_runs

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

# torch's stable CPU sort is a merge sort below 32768 elements (fastest on int64 there) and a radix sort from there
# on (several times faster on int8 keys); between these sizes, padding up to the radix size wins.
_RADIX_SORT_MIN = 32768
_PAD_TO_RADIX_MIN = 6144
# Up to this many buckets a shared block size gives bucket ids by comparisons (80k ids, 2 buckets: one compare and
# a cast, ~0.07 ms, instead of the int64 floor division, ~0.21 ms; from 3 buckets the extra passes eat the gain).
_COMPARE_MAX_BUCKETS = 2
# Boundaries of all features are searched as one sorted sequence, feature t shifted by t * span, while that fits.
_MAX_SHIFTED = 2**62


def _smallest_int_dtype(upper: int) -> torch.dtype:
    """Narrowest signed dtype holding ``[0, upper]``."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if upper <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _stable_sort_buckets(bucket: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``bucket [N]`` in ``[0, num_buckets)`` -> ``(sorted buckets [N], order [N] int64)``, ties kept in input order."""
    n, on_cpu = bucket.numel(), bucket.device.type == "cpu"
    if on_cpu and n < _PAD_TO_RADIX_MIN:
        return torch.sort(bucket, stable=True)
    keys = bucket.to(_smallest_int_dtype(num_buckets))
    if n >= _RADIX_SORT_MIN or not on_cpu:
        return torch.sort(keys, stable=True)
    # Pad with num_buckets, which sorts after every real key, so the first n of the order are the real one.
    padded = torch.cat([keys, keys.new_full((_RADIX_SORT_MIN - n,), num_buckets)])
    sorted_keys, order = torch.sort(padded, stable=True)
    return sorted_keys[:n], order[:n]


def _index_and_block_size(
    lengths: torch.Tensor, indices: torch.Tensor, block_sizes: torch.Tensor, num_features: int, n: int
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(idx [N], block size)`` for the bucket arithmetic. The block size is a Python int when every feature shares
    one (the usual row-wise sharding plan: no per-value tensor to build), else ``[N]`` int64. ``idx`` stays int32
    when the indices are int32 and the shared block size fits (exact: bucket and local index never exceed idx)."""
    sizes = block_sizes.tolist()
    if sizes and min(sizes) == max(sizes):
        if indices.dtype == torch.int32 and sizes[0] <= torch.iinfo(torch.int32).max:
            return indices, sizes[0]
        return indices.to(torch.int64), sizes[0]
    values_per_feature = lengths.view(num_features, -1).sum(dim=1) if num_features else lengths.to(torch.int64)
    block_size = repeat_runs(block_sizes.to(torch.int64), values_per_feature, n)
    return indices.to(torch.int64), block_size


def _bucket_by_blocks(
    lengths: torch.Tensor, indices: torch.Tensor, block_sizes: torch.Tensor, num_buckets: int, keep_orig_idx: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(idx [N], bucket [N], local [N], any id past the blocks)`` by block sizes; past ids' buckets are
    ``>= num_buckets`` until spread round-robin. One ``aminmax`` of the ids (shared block size) tells whether any
    lies past the blocks and lets two buckets be found by a comparison."""
    n = indices.numel()
    idx, block_size = _index_and_block_size(lengths, indices, block_sizes, block_sizes.numel(), n)
    shared = isinstance(block_size, int)
    low, high = host_ints(*torch.aminmax(idx)) if shared and n else (0, -1)
    if shared and num_buckets <= _COMPARE_MAX_BUCKETS and low >= 0 and high < block_size * num_buckets:
        bucket = torch.ge(idx, block_size).to(idx.dtype)  # = floor(idx / block_size) for ids inside the blocks
    else:
        bucket = torch.div(idx, block_size, rounding_mode="floor")
    if keep_orig_idx:
        local = idx
    elif isinstance(block_size, int):
        local = torch.sub(idx, bucket, alpha=block_size)  # one pass instead of a mul and a sub
    else:
        local = idx - bucket * block_size
    past_blocks = high >= block_size * num_buckets if shared else bool(n) and int(bucket.max()) >= num_buckets
    return idx, bucket, local, past_blocks


def _bucket_by_boundaries(
    lengths: torch.Tensor, indices: torch.Tensor, bounds: torch.Tensor, keep_orig_idx: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`_bucket_by_blocks` by ``bounds [T, num_buckets + 1]`` (module docstring): the bucket is the upper bound
    of the id in its feature's boundaries, minus one. All features are searched at once in one sorted sequence,
    feature ``t``'s boundaries and ids shifted by ``t * span`` (``span`` past every id and boundary); per feature
    where the shifted values could overflow int64."""
    n, (num_features, width) = indices.numel(), bounds.shape
    idx = indices.to(torch.int64)
    if not n:
        return idx, idx.clone(), idx.clone(), False
    values_per_feature = lengths.view(num_features, -1).sum(dim=1, dtype=torch.int64)
    feature = repeat_runs(torch.arange(num_features, device=idx.device), values_per_feature, n)
    id_top, bound_top = host_ints(idx.max(), bounds.max())
    span = max(id_top, bound_top) + 1
    if num_features * span <= _MAX_SHIFTED:
        shifts = torch.arange(num_features, device=idx.device) * span
        flat = (bounds + shifts[:, None]).reshape(-1)
        found = torch.searchsorted(flat, idx + shifts.index_select(0, feature), right=True)
    else:
        parts = idx.split(values_per_feature.tolist())
        per_feature = [torch.searchsorted(bounds[t], part, right=True) + t * width for t, part in enumerate(parts)]
        found = torch.cat(per_feature)
    last = found.sub_(1)  # flat position of the id's block start: feature * width + bucket
    bucket = last - feature * width
    local = idx if keep_orig_idx else idx - bounds.reshape(-1).index_select(0, last)
    return idx, bucket, local, bool(bucket.max() >= width - 1)


def block_bucketize_sparse_features_reference(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None = None,
    bucketize_pos: bool = False,
    sequence: bool = False,
    keep_orig_idx: bool = False,
    block_bucketize_pos: torch.Tensor | None = None,
) -> Outputs:
    """The specification (module docstrings), vectorised; ``block_bucketize_pos``: ``None`` or ``[T,
    num_buckets + 1]`` int64 boundaries (then ``block_sizes`` only gives the number of features).

    Indices arrive ordered by bag, so a *stable* sort by bucket alone yields the output order (bucket, feature,
    sample, position in bag); the counts and in-bag positions are then read off the sorted side. All elementwise
    steps keep operands of one dtype (mixed-dtype in-place ops take torch's slow casting path, ~10x slower).
    """
    num_bags, n, device = lengths.numel(), indices.numel(), indices.device
    if block_bucketize_pos is None:
        idx, bucket, local, past_blocks = _bucket_by_blocks(lengths, indices, block_sizes, num_buckets, keep_orig_idx)
    else:
        idx, bucket, local, past_blocks = _bucket_by_boundaries(lengths, indices, block_bucketize_pos, keep_orig_idx)
    if past_blocks:  # ids past the blocks are spread round-robin
        in_blocks = bucket < num_buckets
        bucket = torch.where(in_blocks, bucket, idx % num_buckets)
        if not keep_orig_idx:
            local = torch.where(in_blocks, local, torch.div(idx, num_buckets, rounding_mode="floor"))
    sorted_bucket, order = _stable_sort_buckets(bucket, num_buckets)  # order: output position -> input
    # Counts per (bucket, bag) from the sorted side: there the bucket-major key bucket * num_bags + bag never
    # decreases, so the bincount writes its counters in order (scattering the unsorted key costs ~5x more).
    key_dtype = lengths.dtype if num_bags * num_buckets <= torch.iinfo(lengths.dtype).max else torch.int64
    sorted_bag = torch.repeat_interleave(lengths.to(key_dtype), output_size=n).index_select(0, order)
    key = torch.add(sorted_bag, sorted_bucket, alpha=num_bags)
    new_lengths = torch.bincount(key, minlength=num_buckets * num_bags).to(lengths.dtype)
    new_indices = local.index_select(0, order).to(indices.dtype)
    new_weights = None if weights is None else weights.index_select(0, order)
    new_pos = None
    if bucketize_pos:
        # Input j = order[k] sits at output k and has position j - start(bag of j) in its bag.
        bag_start = torch.cumsum(lengths, 0, dtype=torch.int64).sub_(lengths).index_select(0, sorted_bag)
        new_pos = torch.sub(order, bag_start, out=bag_start).to(indices.dtype)
    unbucketize = None
    if sequence:
        positions = torch.arange(n, device=device, dtype=indices.dtype)
        unbucketize = torch.empty_like(indices).scatter_(0, order, positions)
    return new_lengths, new_indices, new_weights, new_pos, unbucketize


__all__ = ["Outputs", "block_bucketize_sparse_features_reference"]
