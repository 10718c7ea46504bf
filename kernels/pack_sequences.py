"""Pack variable-length sequences into bins for padding-free training, and scatter per-token outputs back.

A :class:`PackingPlan` says where every token goes. It is built once per batch from the bin assignment
(``sequence_order [B]``: original sequence index of each packed position, bins one after another;
``bin_offsets [num_bins + 1]``: bin ``b`` holds packed positions ``bin_offsets[b]:bin_offsets[b + 1]``) and the
source layout: padded ``[B, S, *]`` rows with ``lengths [B]``, or jagged ``[N, *]`` values with ``offsets [B + 1]``.
The plan holds only ``[B]``-sized index tensors, so every tensor of the batch (input ids, labels, masks, hidden
states) packs with the same plan.

* :func:`pack_sequences` builds, in one launch, the packed tokens (one flat ``[T, *]`` buffer, or ``[num_bins,
  capacity, *]`` rows when the plan has a capacity), position ids restarting at 0 in every sequence, and segment ids
  (index of the sequence within its bin, -1 on padding). ``plan.cu_seqlens`` and :meth:`PackingPlan.bin_cu_seqlens`
  are the FlashAttention varlen boundaries.
* :func:`unpack_sequences` is the inverse: per-token outputs in the packed layout back to the source layout.

Each is the other's backward, so packing hidden states and unpacking logits are differentiable. With
``pad_to_multiple > 1`` every sequence occupies a slot rounded up to that multiple (context-parallel alignment); the
extra tokens hold ``padding_value``, continue the position count and keep the sequence's segment id.

Triton path: the pack kernel runs one program per (bin, feature block) that walks its bin's sequences and also
writes the bin's padding, so nothing is pre-filled; the unpack kernel runs one program per (sequence, feature block).
The torch twins (the specification) live in :mod:`tritonrec.kernels.pack_sequences_reference`, re-exported here.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import check_same_device, check_tensor
from tritonrec.kernels.library import custom_op
from tritonrec.kernels.pack_sequences_reference import (
    feature_shape,
    pack_sequences_reference,
    packed_shape,
    source_shape,
    unpack_sequences_reference,
)
from tritonrec.kernels.packing_plan import (
    PLAN_TENSORS,
    PackingPlan,
    bin_assignment,
    make_packing_plan,
    plan_args,
    plan_from_args,
)


def _tile_configs() -> list:
    # A tile is BLOCK_T rows x BLOCK_D features with BLOCK_T = TILE // BLOCK_D, so token ids (D = 1) get long row
    # blocks and wide hidden states get short ones at the same register budget.
    # 16 values per thread at most: TILE 8192 on 8 warps (32 per thread) reached 255 registers and spilled on sm_80
    # and sm_90 (python -m tritonrec.kernels.aot).
    return [triton.Config({"TILE": t}, num_warps=w) for t, w in ((2048, 4), (512, 2), (4096, 8))]


@autotune(configs=_tile_configs(), key=["ROWS_BUCKET", "BLOCK_D", "PADDED"])
@triton.jit
def _pack_bins_kernel(
    values_ptr,
    order_ptr,
    source_starts_ptr,
    source_lengths_ptr,
    packed_starts_ptr,
    bin_offsets_ptr,
    cu_seqlens_ptr,
    tokens_ptr,
    positions_ptr,
    segments_ptr,
    padding_ptr,
    D,
    capacity,
    ROWS_BUCKET,
    PADDED: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (num_bins, cdiv(D, BLOCK_D)): copy bin b's sequences into their slots, then pad the rest of the row."""
    BLOCK_T: tl.constexpr = TILE // BLOCK_D
    bin_id = tl.program_id(0).to(tl.int64)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols[None, :] < D
    rows = tl.arange(0, BLOCK_T)
    pad = tl.load(padding_ptr)
    first = tl.load(bin_offsets_ptr + bin_id)
    last = tl.load(bin_offsets_ptr + bin_id + 1)
    for j in range(first, last):
        seq = tl.load(order_ptr + j)
        src = tl.load(source_starts_ptr + seq)
        length = tl.load(source_lengths_ptr + seq)
        dst = tl.load(packed_starts_ptr + j)
        slot = tl.load(cu_seqlens_ptr + j + 1).to(tl.int64) - tl.load(cu_seqlens_ptr + j).to(tl.int64)
        segment = tl.full((BLOCK_T,), 0, tl.int32) + (j - first).to(tl.int32)
        for t0 in range(0, slot, BLOCK_T):
            r = t0 + rows
            real = r[:, None] < length
            tile = tl.load(values_ptr + (src + r[:, None]) * D + cols[None, :], mask=real & col_ok, other=0)
            tile = tl.where(real, tile, pad)
            tl.store(tokens_ptr + (dst + r[:, None]) * D + cols[None, :], tile, mask=(r[:, None] < slot) & col_ok)
            if col_block == 0:  # ids are per token, not per feature: one column block writes them
                tl.store(positions_ptr + dst + r, r.to(tl.int64), mask=r < slot)
                tl.store(segments_ptr + dst + r, segment, mask=r < slot)
    if PADDED:
        used = tl.load(cu_seqlens_ptr + last).to(tl.int64) - tl.load(cu_seqlens_ptr + first).to(tl.int64)
        base = bin_id * capacity
        fill = tl.full((BLOCK_T, BLOCK_D), 0, tokens_ptr.dtype.element_ty) + pad
        for t0 in range(used, capacity, BLOCK_T):
            r = t0 + rows
            keep = r < capacity
            tl.store(tokens_ptr + (base + r[:, None]) * D + cols[None, :], fill, mask=keep[:, None] & col_ok)
            if col_block == 0:
                tl.store(positions_ptr + base + r, tl.full((BLOCK_T,), 0, tl.int64), mask=keep)
                tl.store(segments_ptr + base + r, tl.full((BLOCK_T,), -1, tl.int32), mask=keep)


@autotune(configs=_tile_configs(), key=["ROWS_BUCKET", "BLOCK_D", "PADDED_SOURCE"])
@triton.jit
def _unpack_sequences_kernel(
    packed_ptr,
    order_ptr,
    source_starts_ptr,
    source_lengths_ptr,
    packed_starts_ptr,
    out_ptr,
    padding_ptr,
    D,
    padded_len,
    ROWS_BUCKET,
    PADDED_SOURCE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (B, cdiv(D, BLOCK_D)): packed sequence j back to its source rows (and, for a padded source, the padding
    after it up to the row length)."""
    BLOCK_T: tl.constexpr = TILE // BLOCK_D
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols[None, :] < D
    rows = tl.arange(0, BLOCK_T)
    pad = tl.load(padding_ptr)
    seq = tl.load(order_ptr + j)
    length = tl.load(source_lengths_ptr + seq)
    src = tl.load(packed_starts_ptr + j)
    dst = tl.load(source_starts_ptr + seq)
    if PADDED_SOURCE:
        extent = padded_len + 0 * length  # the whole padded row, typed like length (int64)
    else:
        extent = length
    for t0 in range(0, extent, BLOCK_T):
        r = t0 + rows
        real = r[:, None] < length
        tile = tl.load(packed_ptr + (src + r[:, None]) * D + cols[None, :], mask=real & col_ok, other=0)
        tile = tl.where(real, tile, pad)
        tl.store(out_ptr + (dst + r[:, None]) * D + cols[None, :], tile, mask=(r[:, None] < extent) & col_ok)


def _block_d(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), 256)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """Bool tensors travel as bytes (Triton pointers to i1 are awkward); everything else as is."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _padding_tensor(padding_value: float, like: torch.Tensor) -> torch.Tensor:
    """The padding value rounded into the values' dtype by torch, passed by pointer (exact for int64 and fp64)."""
    return _kernel_view(torch.full((1,), padding_value, dtype=like.dtype, device=like.device))


def _pack_triton(
    values: torch.Tensor, plan: PackingPlan, padding_value: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    feature = feature_shape(plan, values)
    width = int(torch.Size(feature).numel())
    if width == 0:  # no feature columns means no programs, but the ids still have to be written
        return pack_sequences_reference(values, plan, padding_value)
    source = _kernel_view(values.reshape(-1, width)[: plan.num_source_rows].contiguous())
    tokens = torch.empty((plan.num_packed_rows, width), dtype=values.dtype, device=values.device)
    positions = torch.empty(plan.num_packed_rows, dtype=torch.int64, device=values.device)
    segments = torch.empty(plan.num_packed_rows, dtype=torch.int32, device=values.device)
    if plan.num_bins and plan.num_packed_rows:
        block_d = _block_d(width)
        _pack_bins_kernel[(plan.num_bins, triton.cdiv(width, block_d))](
            source,
            plan.sequence_order,
            plan.source_starts,
            plan.source_lengths,
            plan.packed_starts,
            plan.bin_offsets,
            plan.cu_seqlens,
            _kernel_view(tokens),
            positions,
            segments,
            _padding_tensor(padding_value, values),
            width,
            plan.capacity or 0,
            pow2_bucket(plan.num_packed_rows // plan.num_bins),
            PADDED=plan.capacity is not None,
            BLOCK_D=block_d,
        )
    shape = packed_shape(plan, feature)
    id_shape = shape[: len(shape) - len(feature)]
    return tokens.reshape(shape), positions.reshape(id_shape), segments.reshape(id_shape)


def _unpack_triton(packed: torch.Tensor, plan: PackingPlan, padding_value: float) -> torch.Tensor:
    feature = tuple(packed.shape[2:] if plan.capacity is not None else packed.shape[1:])
    width = int(torch.Size(feature).numel())
    if width == 0:
        return unpack_sequences_reference(packed, plan, padding_value)
    out = torch.empty((plan.num_source_rows, width), dtype=packed.dtype, device=packed.device)
    if plan.num_sequences and width and plan.num_source_rows:
        block_d = _block_d(width)
        _unpack_sequences_kernel[(plan.num_sequences, triton.cdiv(width, block_d))](
            _kernel_view(packed.reshape(-1, width).contiguous()),
            plan.sequence_order,
            plan.source_starts,
            plan.source_lengths,
            plan.packed_starts,
            _kernel_view(out),
            _padding_tensor(padding_value, packed),
            width,
            plan.padded_len or 0,
            pow2_bucket(plan.num_source_rows // plan.num_sequences),
            PADDED_SOURCE=plan.padded_len is not None,
            BLOCK_D=block_d,
        )
    return out.reshape(source_shape(plan, feature))


# --------------------------------------------------------------------------------------------------- the ops
@custom_op("pack_sequences")
def _pack_op(
    values: torch.Tensor,
    plan_tensors: list[torch.Tensor],
    capacity: int | None,
    padded_len: int | None,
    plan_ints: list[int],
    padding_value: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = plan_from_args(plan_tensors, capacity, padded_len, plan_ints)
    return (_pack_triton if backend == "triton" else pack_sequences_reference)(values, plan, padding_value)


@_pack_op.register_fake
def _(values, plan_tensors, capacity, padded_len, plan_ints, padding_value, backend):
    plan = plan_from_args(plan_tensors, capacity, padded_len, plan_ints)
    shape = packed_shape(plan, feature_shape(plan, values))
    id_shape = shape[: len(shape) - len(feature_shape(plan, values))]
    return (
        values.new_empty(shape),
        values.new_empty(id_shape, dtype=torch.int64),
        values.new_empty(id_shape, dtype=torch.int32),
    )


@custom_op("unpack_sequences")
def _unpack_op(
    packed: torch.Tensor,
    plan_tensors: list[torch.Tensor],
    capacity: int | None,
    padded_len: int | None,
    plan_ints: list[int],
    padding_value: float,
    backend: str,
) -> torch.Tensor:
    plan = plan_from_args(plan_tensors, capacity, padded_len, plan_ints)
    return (_unpack_triton if backend == "triton" else unpack_sequences_reference)(packed, plan, padding_value)


@_unpack_op.register_fake
def _(packed, plan_tensors, capacity, padded_len, plan_ints, padding_value, backend):
    plan = plan_from_args(plan_tensors, capacity, padded_len, plan_ints)
    feature = tuple(packed.shape[2:] if plan.capacity is not None else packed.shape[1:])
    return packed.new_empty(source_shape(plan, feature))


def _setup_plan(ctx, inputs) -> None:
    _, plan_tensors, capacity, padded_len, plan_ints, _, backend = inputs
    ctx.save_for_backward(*plan_tensors)
    ctx.capacity, ctx.padded_len, ctx.plan_ints, ctx.backend = capacity, padded_len, plan_ints, backend


def _pack_setup(ctx, inputs, output) -> None:
    _setup_plan(ctx, inputs)
    ctx.source_shape = inputs[0].shape
    ctx.set_materialize_grads(True)


def _pack_grad(ctx, grad_tokens, _grad_positions, _grad_segments):
    plan = (list(ctx.saved_tensors), ctx.capacity, ctx.padded_len, ctx.plan_ints)
    grad = torch.ops.tritonrec.unpack_sequences(grad_tokens.contiguous(), *plan, 0.0, ctx.backend)
    if grad.shape[0] != ctx.source_shape[0]:  # jagged values may carry rows past offsets[-1]; they get no grad
        grad = torch.cat([grad, grad.new_zeros((ctx.source_shape[0] - grad.shape[0], *grad.shape[1:]))])
    return grad.reshape(ctx.source_shape), [None] * len(PLAN_TENSORS), None, None, None, None, None


def _unpack_setup(ctx, inputs, output) -> None:
    _setup_plan(ctx, inputs)


def _unpack_grad(ctx, grad_source):
    plan = (list(ctx.saved_tensors), ctx.capacity, ctx.padded_len, ctx.plan_ints)
    grad_packed, _, _ = torch.ops.tritonrec.pack_sequences(grad_source.contiguous(), *plan, 0.0, ctx.backend)
    return grad_packed, [None] * len(PLAN_TENSORS), None, None, None, None, None


_pack_op.register_autograd(_pack_grad, setup_context=_pack_setup)
_unpack_op.register_autograd(_unpack_grad, setup_context=_unpack_setup)


class PackedSequences(tuple):
    """``(tokens, position_ids, segment_ids, plan)``; see :func:`pack_sequences`."""

    __slots__ = ()

    def __new__(
        cls, tokens: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor, plan: PackingPlan
    ) -> PackedSequences:
        return super().__new__(cls, (tokens, position_ids, segment_ids, plan))

    tokens = property(lambda self: self[0], doc="``[T, *]`` or ``[num_bins, capacity, *]`` packed values")
    position_ids = property(lambda self: self[1], doc="int64, ``[T]`` or ``[num_bins, capacity]``; 0 on padding")
    segment_ids = property(lambda self: self[2], doc="int32, sequence index within its bin; -1 on padding")
    plan = property(lambda self: self[3], doc="the :class:`PackingPlan` used (``cu_seqlens`` lives there)")


def _check_plan(plan: object) -> PackingPlan:
    if not isinstance(plan, PackingPlan):
        raise TypeError(f"plan must be a PackingPlan (build it with make_packing_plan), got {type(plan).__name__}")
    return plan


def _check_values(values: torch.Tensor, plan: PackingPlan, name: str = "values") -> None:
    check_tensor(values, name)
    _check_plan(plan)
    check_same_device(**{name: values, "plan.sequence_order": plan.sequence_order})
    if plan.padded_len is not None:
        expected = (plan.num_sequences, plan.padded_len)
        if values.dim() < 2 or tuple(values.shape[:2]) != expected:
            raise ValueError(
                f"{name} must be padded [B, S, *] with (B, S) = {expected} as in the plan, "
                f"got shape {tuple(values.shape)}"
            )
    elif values.dim() < 1 or values.shape[0] < plan.num_source_rows:
        raise ValueError(
            f"{name} must be jagged [N, *] with N >= offsets[-1] = {plan.num_source_rows}, "
            f"got shape {tuple(values.shape)}"
        )


def pack_sequences(
    values: torch.Tensor, plan: PackingPlan, padding_value: float = 0.0, backend: Backend = "auto"
) -> PackedSequences:
    """Pack ``values`` (the plan's source layout: padded ``[B, S, *]`` or jagged ``[N, *]``) into bins.

    Returns :class:`PackedSequences` ``(tokens, position_ids, segment_ids, plan)``: ``tokens`` is ``[T, *]`` (flat,
    ``T = plan.cu_seqlens[-1]``) or ``[num_bins, capacity, *]``; ids have the tokens' leading shape. Differentiable
    in ``values``.
    """
    _check_values(values, plan)
    resolved = resolve_backend(backend, values)
    tokens, positions, segments = _pack_op(values, *plan_args(plan), float(padding_value), resolved)
    return PackedSequences(tokens, positions, segments, plan)


def unpack_sequences(
    packed: torch.Tensor, plan: PackingPlan, padding_value: float = 0.0, backend: Backend = "auto"
) -> torch.Tensor:
    """Inverse of :func:`pack_sequences`: per-token ``packed`` values (``[T, *]`` or ``[num_bins, capacity, *]``,
    any trailing dims, e.g. logits) back to ``[B, S, *]`` (``padding_value`` past each length) or ``[N, *]``.
    Differentiable in ``packed``."""
    check_tensor(packed, "packed")
    _check_plan(plan)
    check_same_device(packed=packed, **{"plan.sequence_order": plan.sequence_order})
    expected = (plan.num_bins, plan.capacity) if plan.capacity is not None else (plan.num_packed_rows,)
    if packed.dim() < len(expected) or tuple(packed.shape[: len(expected)]) != expected:
        raise ValueError(
            f"packed must start with the plan's packed shape {expected} (then any feature dims), "
            f"got shape {tuple(packed.shape)}"
        )
    return _unpack_op(packed, *plan_args(plan), float(padding_value), resolve_backend(backend, packed))


__all__ = [
    "PackedSequences",
    "PackingPlan",
    "bin_assignment",
    "make_packing_plan",
    "pack_sequences",
    "pack_sequences_reference",
    "unpack_sequences",
    "unpack_sequences_reference",
]
