"""``block_bucketize_sparse_features``: split a key-major sparse batch into per-bucket (per-rank) pieces for row-wise
sharding, with FBGEMM's semantics.

Index ``i`` of feature ``t`` (block size ``s = block_sizes[t]``, ``n = num_buckets``):

* ``i < s * n``  -> bucket ``i // s``, local index ``i % s`` (the row inside that rank's block);
* otherwise      -> bucket ``i % n``, local index ``i // n`` (ids past the sharded range are spread round-robin).

``keep_orig_idx`` keeps ``i`` as the local index. Outputs are laid out ``[bucket][feature][sample]``:
``new_lengths [n * T * B]``, and ``new_indices`` grouped by that order with each bag's original order kept.
``bucketize_pos`` adds each index's position inside its original bag; ``sequence`` adds ``unbucketize_permute``,
where ``unbucketize_permute[j]`` is the output position of input index ``j`` (what sequence embeddings need to put
rows back in input order).

Triton path: two launches, one lane per bag (``BAGS`` bags per program, programs striding over the bags), each lane
walking its bag in order. The first counts the bag's indices per bucket, the second places each index at its (bucket,
bag) write cursor (the exclusive scan of those counts) and advances it. Counters and cursors live in global memory,
one per (bucket, bag), and only the lane owning the bag touches them: registers do not grow with the number of
buckets (any count runs), no atomics or barriers are needed, and results are bit-identical run to run.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, grid_programs, resolve_backend
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
from tritonrec.kernels.runs import repeat_runs

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
def _bag_spans(offsets_ptr, block_sizes_ptr, first, B, TB, BAGS: tl.constexpr):
    """Bags ``first ... first + BAGS - 1`` (int64), their first value, length (0 past TB) and block size."""
    bag = first + tl.arange(0, BAGS).to(tl.int64)
    ok = bag < TB
    start = tl.load(offsets_ptr + bag, mask=ok, other=0).to(tl.int64)
    length = tl.load(offsets_ptr + bag + 1, mask=ok, other=0).to(tl.int64) - start
    block_size = tl.load(block_sizes_ptr + bag // B, mask=ok, other=1).to(tl.int64)
    return bag, start, length, block_size


@triton.jit
def _bucket_count_kernel(
    offsets_ptr, indices_ptr, block_sizes_ptr, new_lengths_ptr, B, TB, num_buckets, BAGS: tl.constexpr
):
    """Lane per bag: new_lengths[bucket * TB + bag] += 1 for each of the bag's indices (new_lengths starts at 0)."""
    for first in range(tl.program_id(0) * BAGS, TB, tl.num_programs(0) * BAGS):
        bag, start, length, block_size = _bag_spans(offsets_ptr, block_sizes_ptr, first, B, TB, BAGS)
        for p in range(0, tl.max(length, axis=0)):
            live = p < length
            idx = tl.load(indices_ptr + start + p, mask=live, other=0).to(tl.int64)
            bucket, _ = _bucket_and_local(idx, block_size, num_buckets, False)
            counter = new_lengths_ptr + bucket * TB + bag
            tl.store(counter, tl.load(counter, mask=live, other=0) + 1, mask=live)


@triton.jit
def _bucket_scatter_kernel(
    offsets_ptr,
    indices_ptr,
    block_sizes_ptr,
    weights_ptr,
    cursors_ptr,
    new_indices_ptr,
    new_weights_ptr,
    new_pos_ptr,
    unbucketize_ptr,
    B,
    TB,
    num_buckets,
    HAS_WEIGHTS: tl.constexpr,
    BUCKETIZE_POS: tl.constexpr,
    SEQUENCE: tl.constexpr,
    KEEP_ORIG_IDX: tl.constexpr,
    BAGS: tl.constexpr,
):
    """Lane per bag: the bag's p-th index goes to cursors[bucket * TB + bag], which then moves on by one.
    ``cursors`` starts as the exclusive offsets of the bucket-major lengths and is advanced in place."""
    for first in range(tl.program_id(0) * BAGS, TB, tl.num_programs(0) * BAGS):
        bag, start, length, block_size = _bag_spans(offsets_ptr, block_sizes_ptr, first, B, TB, BAGS)
        for p in range(0, tl.max(length, axis=0)):
            live = p < length
            j = start + p
            idx = tl.load(indices_ptr + j, mask=live, other=0).to(tl.int64)
            bucket, local = _bucket_and_local(idx, block_size, num_buckets, KEEP_ORIG_IDX)
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


Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _block_bucketize_triton(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None,
    bucketize_pos: bool,
    sequence: bool,
    keep_orig_idx: bool,
) -> Outputs:
    num_bags, n = lengths.numel(), indices.numel()
    batch = num_bags // max(block_sizes.numel(), 1)
    # lengths were checked by the op, bucket counts are non-negative: neither scan re-checks (a host sync each)
    offsets = _lengths_to_offsets_triton(lengths)
    new_lengths = torch.zeros(num_buckets * num_bags, dtype=lengths.dtype, device=lengths.device)
    indices, block_sizes = indices.contiguous(), block_sizes.contiguous()
    grid = (grid_programs(triton.cdiv(num_bags, _BAGS)),)
    if num_bags and n:
        _bucket_count_kernel[grid](offsets, indices, block_sizes, new_lengths, batch, num_bags, num_buckets, BAGS=_BAGS)
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
            dummy if weights is None else weights.contiguous(),
            cursors,
            new_indices,
            dummy if new_weights is None else new_weights,
            dummy if new_pos is None else new_pos,
            dummy if unbucketize is None else unbucketize,
            batch,
            num_bags,
            num_buckets,
            HAS_WEIGHTS=weights is not None,
            BUCKETIZE_POS=bucketize_pos,
            SEQUENCE=sequence,
            KEEP_ORIG_IDX=keep_orig_idx,
            BAGS=_BAGS,
        )
    return new_lengths, new_indices, new_weights, new_pos, unbucketize


# torch's stable CPU sort is a merge sort below 32768 elements (fastest on int64 there) and a radix sort from there
# on (several times faster on int8 keys); between these sizes, padding up to the radix size wins.
_RADIX_SORT_MIN = 32768
_PAD_TO_RADIX_MIN = 6144


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


# Up to this many buckets a shared block size gives bucket ids by comparisons (80k ids, 2 buckets: one compare and
# a cast, ~0.07 ms, instead of the int64 floor division, ~0.21 ms; from 3 buckets the extra passes eat the gain).
_COMPARE_MAX_BUCKETS = 2


def block_bucketize_sparse_features_reference(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None = None,
    bucketize_pos: bool = False,
    sequence: bool = False,
    keep_orig_idx: bool = False,
) -> Outputs:
    """The specification (module docstring), vectorised.

    Indices arrive ordered by bag, so a *stable* sort by bucket alone yields the output order (bucket, feature,
    sample, position in bag); the counts and in-bag positions are then read off the sorted side. All elementwise
    steps keep operands of one dtype (mixed-dtype in-place ops take torch's slow casting path, ~10x slower). One
    ``aminmax`` of the ids (shared block size) tells whether any lies past the blocks and lets two buckets be found
    by a comparison.
    """
    num_bags, n, device = lengths.numel(), indices.numel(), indices.device
    num_features = block_sizes.numel()
    idx, block_size = _index_and_block_size(lengths, indices, block_sizes, num_features, n)
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
    past_blocks = high >= block_size * num_buckets if shared else n and int(bucket.max()) >= num_buckets
    if past_blocks:  # ids past block_size * num_buckets are spread round-robin
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


def _check_bucketize_values(lengths: torch.Tensor, indices: torch.Tensor, block_sizes: torch.Tensor) -> None:
    """Value checks (read tensor contents), inside the op: four numbers in one host read (one sync on a GPU); a
    failing check is rerun by the function that names the offending entry."""
    if not value_checks_enabled():
        return
    one = torch.ones((), dtype=torch.int64, device=lengths.device)
    low = lambda t: t.min() if t.numel() else one  # an empty tensor has nothing below zero
    lengths_low, lengths_sum, indices_low, blocks_low = host_ints(
        low(lengths), lengths.sum(dtype=torch.int64), low(indices), low(block_sizes)
    )
    if lengths_low < 0 or lengths_sum != indices.numel():
        check_lengths_total(lengths, "lengths", indices.numel(), what="indices")
    if indices_low < 0:
        check_nonnegative(indices, "indices")
    if lengths.dtype == torch.int32 and lengths_sum > torch.iinfo(torch.int32).max:
        raise ValueError(f"int32 lengths sum to {lengths_sum}, past what int32 offsets hold: pass int64 lengths")
    if blocks_low <= 0:
        where = int((block_sizes <= 0).nonzero()[0].item())
        raise ValueError(f"block_sizes must be positive, got block_sizes[{where}] = {block_sizes[where].item()}")


def block_bucketize_sparse_features(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    num_buckets: int,
    weights: torch.Tensor | None = None,
    bucketize_pos: bool = False,
    sequence: bool = False,
    keep_orig_idx: bool = False,
    backend: Backend = "auto",
) -> Outputs:
    """``lengths [T * B]``, ``indices [N]``, ``block_sizes [T]`` -> ``(new_lengths [num_buckets * T * B],
    new_indices [N], new_weights [N] | None, new_pos [N] | None, unbucketize_permute [N] | None)``.
    See the module docstring for the bucket rule and layout. Differentiable in ``weights`` (the other outputs are
    integers)."""
    num_buckets = _check_bucketize_inputs(lengths, indices, block_sizes, num_buckets, weights)
    resolved = resolve_backend(backend, lengths, indices)
    outputs = _block_bucketize_op(
        lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx, resolved
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
    backend: str,
) -> list[torch.Tensor]:
    """``[new_lengths, new_indices]`` then, in order, whichever of new_weights / new_pos / unbucketize_permute
    exist (an op returns no ``None`` inside a list)."""
    _check_bucketize_values(lengths, indices, block_sizes)
    run = _block_bucketize_triton if backend == "triton" else block_bucketize_sparse_features_reference
    outputs = run(lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx)
    return [t for t in outputs if t is not None]


@_block_bucketize_op.register_fake
def _(lengths, indices, block_sizes, num_buckets, weights, bucketize_pos, sequence, keep_orig_idx, backend):
    out = [lengths.new_empty(num_buckets * lengths.shape[0]), torch.empty_like(indices)]
    out += [] if weights is None else [torch.empty_like(weights)]
    return out + [torch.empty_like(indices) for flag in (bucketize_pos, sequence) if flag]


def _block_bucketize_setup(ctx, inputs, output) -> None:
    lengths, indices, block_sizes, num_buckets, weights, *_, backend = inputs
    ctx.save_for_backward(lengths, indices, block_sizes)
    ctx.num_buckets, ctx.backend = num_buckets, backend
    ctx.weights_need = weights is not None and weights.requires_grad


def _block_bucketize_grad(ctx, grads):
    """Only ``weights`` is differentiable: ``new_weights[unbucketize[j]] = weights[j]``, so its gradient gathers
    the output gradient through ``unbucketize_permute``, recomputed here (forward callers rarely ask for it)."""
    grad_weights = None
    if ctx.weights_need and grads[2] is not None:
        lengths, indices, block_sizes = ctx.saved_tensors
        unbucketize = torch.ops.tritonrec.block_bucketize_sparse_features(
            lengths, indices, block_sizes, ctx.num_buckets, None, False, True, False, ctx.backend
        )[2]
        grad_weights = grads[2].index_select(0, unbucketize)
    return None, None, None, None, grad_weights, None, None, None, None


_block_bucketize_op.register_autograd(_block_bucketize_grad, setup_context=_block_bucketize_setup)
