"""``block_bucketize_sparse_features``: split a key-major sparse batch into per-bucket (per-rank) pieces for row-wise
sharding, with FBGEMM's semantics.

Index ``i`` of feature ``t`` (block size ``s = block_sizes[t]``, ``n = num_buckets``):

* ``i < s * n``  -> bucket ``i // s``, local index ``i % s`` (the row inside that rank's block);
* otherwise      -> bucket ``i % n``, local index ``i // n`` (ids past the sharded range are spread round-robin).

With ``block_bucketize_pos`` (per feature, ``n + 1`` row boundaries ``pos``: uneven blocks, FBGEMM's argument),
index ``i`` goes to the last bucket ``p`` with ``pos[p] <= i``, local index ``i - pos[p]``, when ``i < pos[n]``, and
round-robin as above otherwise; ``block_sizes`` then only gives the number of features.

``keep_orig_idx`` keeps ``i`` as the local index. Outputs are laid out ``[bucket][feature][sample]``:
``new_lengths [n * T * B]``, and ``new_indices`` grouped by that order with each bag's original order kept.
``bucketize_pos`` adds each index's position inside its original bag; ``sequence`` adds ``unbucketize_permute``,
where ``unbucketize_permute[j]`` is the output position of input index ``j`` (what sequence embeddings need to put
rows back in input order).

Triton path: two launches, one lane per bag (``BAGS`` bags per program, programs striding over the bags), each lane
walking its bag in order. The first counts the bag's indices per bucket, the second places each index at its (bucket,
bag) write cursor (the exclusive scan of those counts) and advances it. Counters and cursors live in global memory,
one per (bucket, bag), and only the lane owning the bag touches them: registers do not grow with the number of
buckets (any count runs), no atomics or barriers are needed, and results are bit-identical run to run. With
boundaries each lane finds its id's bucket by a binary search of its feature's row (``log2(n + 1)`` loads).

The torch twin lives in :mod:`tritonrec.kernels.block_bucketize_reference` (re-exported here), the boundary checks in
:mod:`tritonrec.kernels.block_bucketize_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, grid_programs, resolve_backend
from tritonrec.kernels.block_bucketize_checks import boundaries_tensor, check_boundaries_values
from tritonrec.kernels.block_bucketize_reference import Outputs, block_bucketize_sparse_features_reference
from tritonrec.kernels.checks import (
    check_int,
    check_lengths_total,
    check_nonnegative,
    check_same_device,
    check_tensor,
    host_ints,
    value_checks_enabled,
)
from tritonrec.kernels.lengths_to_offsets import _lengths_to_offsets_triton
from tritonrec.kernels.library import custom_op, optional_outputs

# Bags per program (one per lane of 4 warps); the launches use 4 warps.
_BAGS = 128


@triton.jit
def _bucket_and_local(idx, block_size, num_buckets, KEEP_ORIG_IDX: tl.constexpr):
    in_blocks = idx < block_size * num_buckets
    bucket = tl.where(in_blocks, idx // block_size, idx % num_buckets)
    if KEEP_ORIG_IDX:
        local = idx
    else:
        local = tl.where(in_blocks, idx % block_size, idx // num_buckets)
    return bucket, local


@triton.jit
def _bucket_by_bounds(idx, live, bounds_row, num_buckets, search_steps, KEEP_ORIG_IDX: tl.constexpr):
    """Per lane: upper bound of ``idx`` in its feature's ``num_buckets + 1`` boundaries at ``bounds_row`` (a binary
    search of ``search_steps`` halvings), minus one, is the bucket; ids past the last boundary go round-robin."""
    lo = tl.zeros_like(idx)
    hi = lo + num_buckets + 1
    for _ in range(0, search_steps):
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        bound = tl.load(bounds_row + mid, mask=active, other=0)
        lo = tl.where(active & (bound <= idx), mid + 1, lo)
        hi = tl.where(active & (bound > idx), mid, hi)
    bucket = lo - 1
    in_blocks = bucket < num_buckets
    block_start = tl.load(bounds_row + bucket, mask=live & in_blocks, other=0)
    bucket = tl.where(in_blocks, bucket, idx % num_buckets)
    if KEEP_ORIG_IDX:
        local = idx
    else:
        local = tl.where(in_blocks, idx - block_start, idx // num_buckets)
    return bucket, local


@triton.jit
def _bucket_of(
    idx,
    live,
    block_size,
    bounds_row,
    num_buckets,
    search_steps,
    HAS_BOUNDS: tl.constexpr,
    KEEP_ORIG_IDX: tl.constexpr,
):
    """``(bucket, local index)`` of each lane's id: by its feature's boundaries or by its block size."""
    if HAS_BOUNDS:
        bucket, local = _bucket_by_bounds(idx, live, bounds_row, num_buckets, search_steps, KEEP_ORIG_IDX)
    else:
        bucket, local = _bucket_and_local(idx, block_size, num_buckets, KEEP_ORIG_IDX)
    return bucket, local


@triton.jit
def _bag_spans(offsets_ptr, block_sizes_ptr, bounds_ptr, first, B, TB, num_buckets, BAGS: tl.constexpr):
    """Bags ``first ... first + BAGS - 1`` (int64), their first value, length (0 past TB), block size and the
    address of their feature's boundaries row (read only with boundaries)."""
    bag = first + tl.arange(0, BAGS).to(tl.int64)
    ok = bag < TB
    start = tl.load(offsets_ptr + bag, mask=ok, other=0).to(tl.int64)
    length = tl.load(offsets_ptr + bag + 1, mask=ok, other=0).to(tl.int64) - start
    block_size = tl.load(block_sizes_ptr + bag // B, mask=ok, other=1).to(tl.int64)
    bounds_row = bounds_ptr + (bag // B) * (num_buckets + 1)
    return bag, start, length, block_size, bounds_row


@triton.jit
def _bucket_count_kernel(
    offsets_ptr,
    indices_ptr,
    block_sizes_ptr,
    bounds_ptr,
    new_lengths_ptr,
    B,
    TB,
    num_buckets,
    search_steps,
    HAS_BOUNDS: tl.constexpr,
    BAGS: tl.constexpr,
):
    """Lane per bag: new_lengths[bucket * TB + bag] += 1 for each of the bag's indices (new_lengths starts at 0)."""
    for first in range(tl.program_id(0) * BAGS, TB, tl.num_programs(0) * BAGS):
        bag, start, length, block_size, bounds_row = _bag_spans(
            offsets_ptr, block_sizes_ptr, bounds_ptr, first, B, TB, num_buckets, BAGS
        )
        for p in range(0, tl.max(length, axis=0)):
            live = p < length
            idx = tl.load(indices_ptr + start + p, mask=live, other=0).to(tl.int64)
            bucket, _ = _bucket_of(idx, live, block_size, bounds_row, num_buckets, search_steps, HAS_BOUNDS, False)
            counter = new_lengths_ptr + bucket * TB + bag
            tl.store(counter, tl.load(counter, mask=live, other=0) + 1, mask=live)


@triton.jit
def _bucket_scatter_kernel(
    offsets_ptr,
    indices_ptr,
    block_sizes_ptr,
    bounds_ptr,
    weights_ptr,
    cursors_ptr,
    new_indices_ptr,
    new_weights_ptr,
    new_pos_ptr,
    unbucketize_ptr,
    B,
    TB,
    num_buckets,
    search_steps,
    HAS_BOUNDS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BUCKETIZE_POS: tl.constexpr,
    SEQUENCE: tl.constexpr,
    KEEP_ORIG_IDX: tl.constexpr,
    BAGS: tl.constexpr,
):
    """Lane per bag: the bag's p-th index goes to cursors[bucket * TB + bag], which then moves on by one.
    ``cursors`` starts as the exclusive offsets of the bucket-major lengths and is advanced in place."""
    for first in range(tl.program_id(0) * BAGS, TB, tl.num_programs(0) * BAGS):
        bag, start, length, block_size, bounds_row = _bag_spans(
            offsets_ptr, block_sizes_ptr, bounds_ptr, first, B, TB, num_buckets, BAGS
        )
        for p in range(0, tl.max(length, axis=0)):
            live = p < length
            j = start + p
            idx = tl.load(indices_ptr + j, mask=live, other=0).to(tl.int64)
            bucket, local = _bucket_of(
                idx, live, block_size, bounds_row, num_buckets, search_steps, HAS_BOUNDS, KEEP_ORIG_IDX
            )
            cursor = cursors_ptr + bucket * TB + bag
            pos = tl.load(cursor, mask=live, other=0)
            tl.store(cursor, pos + 1, mask=live)
            pos = pos.to(tl.int64)
            tl.store(new_indices_ptr + pos, local.to(new_indices_ptr.dtype.element_ty), mask=live)
            if HAS_WEIGHTS:
                tl.store(new_weights_ptr + pos, tl.load(weights_ptr + j, mask=live), mask=live)
            if BUCKETIZE_POS:
                tl.store(new_pos_ptr + pos, (j - start).to(new_pos_ptr.dtype.element_ty), mask=live)
            if SEQUENCE:
                tl.store(unbucketize_ptr + j, pos.to(unbucketize_ptr.dtype.element_ty), mask=live)


def _block_bucketize_triton(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None,
    bucketize_pos: bool,
    sequence: bool,
    keep_orig_idx: bool,
    block_bucketize_pos: torch.Tensor | None = None,
) -> Outputs:
    num_bags, n = lengths.numel(), indices.numel()
    batch = num_bags // max(block_sizes.numel(), 1)
    # lengths were checked by the op, bucket counts are non-negative: neither scan re-checks (a host sync each)
    offsets = _lengths_to_offsets_triton(lengths)
    new_lengths = torch.zeros(num_buckets * num_bags, dtype=lengths.dtype, device=lengths.device)
    indices, block_sizes = indices.contiguous(), block_sizes.contiguous()
    bounds = block_sizes if block_bucketize_pos is None else block_bucketize_pos.contiguous()  # unread without
    search = {"search_steps": (num_buckets + 1).bit_length(), "HAS_BOUNDS": block_bucketize_pos is not None}
    grid = (grid_programs(triton.cdiv(num_bags, _BAGS)),)
    if num_bags and n:
        _bucket_count_kernel[grid](
            offsets, indices, block_sizes, bounds, new_lengths, batch, num_bags, num_buckets, **search, BAGS=_BAGS
        )
    cursors = _lengths_to_offsets_triton(new_lengths)  # advanced in place by the scatter
    new_indices = torch.empty_like(indices)
    new_weights = None if weights is None else torch.empty_like(weights)
    new_pos = torch.empty_like(indices) if bucketize_pos else None
    unbucketize = torch.empty_like(indices) if sequence else None
    if num_bags and n:
        dummy = new_indices  # stands in for absent optional outputs; never written (the flags are constexpr)
        _bucket_scatter_kernel[grid](
            offsets,
            indices,
            block_sizes,
            bounds,
            dummy if weights is None else weights.contiguous(),
            cursors,
            new_indices,
            dummy if new_weights is None else new_weights,
            dummy if new_pos is None else new_pos,
            dummy if unbucketize is None else unbucketize,
            batch,
            num_bags,
            num_buckets,
            **search,
            HAS_WEIGHTS=weights is not None,
            BUCKETIZE_POS=bucketize_pos,
            SEQUENCE=sequence,
            KEEP_ORIG_IDX=keep_orig_idx,
            BAGS=_BAGS,
        )
    return new_lengths, new_indices, new_weights, new_pos, unbucketize


def _check_bucketize_inputs(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None,
) -> int:
    """Raises on a bad argument; returns ``num_buckets`` as a Python int (the op's schema takes no numpy int)."""
    check_tensor(lengths, "lengths", ndim=1, integer=True)
    check_tensor(indices, "indices", ndim=1, integer=True)
    check_tensor(block_sizes, "block_sizes", ndim=1, integer=True)
    check_same_device(lengths=lengths, indices=indices, block_sizes=block_sizes, weights=weights)
    num_buckets = check_int(num_buckets, "num_buckets", 1)
    num_features = block_sizes.numel()
    if (num_features == 0 and lengths.numel()) or (num_features and lengths.numel() % num_features):
        raise ValueError(
            f"lengths has {lengths.numel()} entries, not a multiple of the number of features "
            f"(block_sizes has {num_features} entries)"
        )
    if weights is not None:
        check_tensor(weights, "weights", ndim=1)
        if weights.numel() != indices.numel():
            raise ValueError(f"weights must have one entry per index ({indices.numel()}), got {weights.numel()}")
    return num_buckets


def _check_bucketize_values(
    lengths: torch.Tensor, indices: torch.Tensor, block_sizes: torch.Tensor, bounds: torch.Tensor | None
) -> None:
    """Value checks (read tensor contents), inside the op: the numbers in one host read (one sync on a GPU); a
    failing check is rerun by the function that names the offending entry."""
    if not value_checks_enabled():
        return
    one = torch.ones((), dtype=torch.int64, device=lengths.device)
    low = lambda t: t.min() if t.numel() else one  # an empty tensor has nothing below zero
    scalars = [low(lengths), lengths.sum(dtype=torch.int64), low(indices), low(block_sizes)]
    if bounds is not None:  # a first boundary other than 0 makes the first minimum negative; a decrease the second
        scalars += [low(-bounds[:, 0].abs()) + 1, low(bounds.diff(dim=1)) + 1]
    lengths_low, lengths_sum, indices_low, blocks_low, *bounds_low = host_ints(*scalars)
    if lengths_low < 0 or lengths_sum != indices.numel():
        check_lengths_total(lengths, "lengths", indices.numel(), what="indices")
    if indices_low < 0:
        check_nonnegative(indices, "indices")
    if lengths.dtype == torch.int32 and lengths_sum > torch.iinfo(torch.int32).max:
        raise ValueError(f"int32 lengths sum to {lengths_sum}, past what int32 offsets hold: pass int64 lengths")
    if blocks_low <= 0:
        where = int((block_sizes <= 0).nonzero()[0].item())
        raise ValueError(f"block_sizes must be positive, got block_sizes[{where}] = {block_sizes[where].item()}")
    if bounds is not None and min(bounds_low) <= 0:
        check_boundaries_values(bounds)


def block_bucketize_sparse_features(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None = None,
    bucketize_pos: bool = False,
    sequence: bool = False,
    keep_orig_idx: bool = False,
    block_bucketize_pos: Sequence[torch.Tensor] | torch.Tensor | None = None,
    backend: Backend = "auto",
) -> Outputs:
    """``lengths [T * B]``, ``indices [N]``, ``block_sizes [T]`` -> ``(new_lengths [num_buckets * T * B],
    new_indices [N], new_weights [N] | None, new_pos [N] | None, unbucketize_permute [N] | None)``.
    See the module docstring for the bucket rule and layout. ``block_bucketize_pos`` (FBGEMM's argument): per
    feature, ``num_buckets + 1`` row boundaries (``T`` 1-D tensors or one ``[T, num_buckets + 1]`` tensor; each row
    non-decreasing from 0), bucketing by explicit blocks instead of ``block_sizes``. Differentiable in ``weights``
    (the other outputs are integers)."""
    num_buckets = _check_bucketize_inputs(lengths, indices, block_sizes, num_buckets, weights)
    bounds = boundaries_tensor(block_bucketize_pos, block_sizes.numel(), num_buckets, lengths.device)
    resolved = resolve_backend(backend, lengths, indices)
    outputs = _block_bucketize_op(
        lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx, bounds, resolved
    )
    new_lengths, new_indices, *optional = outputs
    return new_lengths, new_indices, *optional_outputs(optional, (weights is not None, bucketize_pos, sequence))


# --------------------------------------------------------------------------------------------------- the ops
@custom_op("block_bucketize_sparse_features")
def _block_bucketize_op(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None,
    bucketize_pos: bool,
    sequence: bool,
    keep_orig_idx: bool,
    block_bucketize_pos: torch.Tensor | None,
    backend: str,
) -> list[torch.Tensor]:
    """``[new_lengths, new_indices]`` then, in order, whichever of new_weights / new_pos / unbucketize_permute
    exist (an op returns no ``None`` inside a list)."""
    _check_bucketize_values(lengths, indices, block_sizes, block_bucketize_pos)
    run = _block_bucketize_triton if backend == "triton" else block_bucketize_sparse_features_reference
    outputs = run(
        lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx, block_bucketize_pos
    )
    return [t for t in outputs if t is not None]


@_block_bucketize_op.register_fake
def _(lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx, bounds, backend):
    out = [lengths.new_empty(num_buckets * lengths.shape[0]), torch.empty_like(indices)]
    out += [] if weights is None else [torch.empty_like(weights)]
    return out + [torch.empty_like(indices) for flag in (bucketize_pos, sequence) if flag]


def _block_bucketize_setup(ctx, inputs, output) -> None:
    lengths, indices, block_sizes, num_buckets, weights, *_, bounds, backend = inputs
    ctx.save_for_backward(lengths, indices, block_sizes, bounds)
    ctx.num_buckets, ctx.backend = num_buckets, backend
    ctx.weights_need = weights is not None and weights.requires_grad


def _block_bucketize_grad(ctx, grads):
    """Only ``weights`` is differentiable: ``new_weights[unbucketize[j]] = weights[j]``, so its gradient gathers
    the output gradient through ``unbucketize_permute``, recomputed here (forward callers rarely ask for it)."""
    grad_weights = None
    if ctx.weights_need and grads[2] is not None:
        lengths, indices, block_sizes, bounds = ctx.saved_tensors
        unbucketize = torch.ops.tritonrec.block_bucketize_sparse_features(
            lengths, indices, block_sizes, ctx.num_buckets, None, False, True, False, bounds, ctx.backend
        )[2]
        grad_weights = grads[2].index_select(0, unbucketize)
    return None, None, None, None, grad_weights, None, None, None, None, None


_block_bucketize_op.register_autograd(_block_bucketize_grad, setup_context=_block_bucketize_setup)
