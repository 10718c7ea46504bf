"""INT8 row-wise comm encoding (FBGEMM's fused 8-bit row-wise layout) with nearest-even or stochastic rounding.

Byte layout, per group of ``row_dim`` consecutive values (see :mod:`.rowwise`), ``ceil4(row_dim) + 8`` bytes
(40 for the default ``row_dim = 32``):

    [0, row_dim)                   uint8 codes, value j at byte j
    [row_dim, ceil4(row_dim))      zero
    [ceil4(row_dim), +4)           fp32 scale = (max - min) / 255, little-endian
    [ceil4(row_dim) + 4, +4)       fp32 bias = min, little-endian

with ``code = round_half_even((x - min) / scale)`` (0 when ``scale == 0``: constant rows decode exactly) and decode
``code * scale + bias``. For ``row_dim % 4 == 0`` this is byte-compatible with FBGEMM's
``Fused8BitRowwiseQuantizedToFloat``. A zero ``min`` is stored as +0.0 whatever the sign of the input zeros.

Non-finite policy ("propagate"): the codes cannot hold NaN, so a group holding a NaN or Inf, or whose ``max - min``
overflows fp32, gets scale = bias = NaN and decodes to NaN in every position; it never decodes to finite numbers.
``nonfinite="raise"`` rejects such input instead.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, resolve_backend
from tritonrec.kernels.codecs import bits_reference as ref
from tritonrec.kernels.codecs.bits import store_output
from tritonrec.kernels.codecs.formats import (
    NonFinitePolicy,
    ceil4,
    check_encoded,
    check_float32_input,
    check_nonfinite_policy,
    check_output_dtype,
    check_row_dim,
    check_seed,
    int8_row_bytes,
)
from tritonrec.kernels.codecs.rowwise import (
    TILE_HEURISTICS,
    decoded_shape,
    encoded_shape,
    launch_decode,
    launch_encode,
    launch_geometry,
    load_group_tile,
    load_le_word,
    pack_bytes_le,
    padded_groups,
    program_groups,
    tile_configs,
)
from tritonrec.kernels.library import custom_op, seed_arg, seed_from_arg
from tritonrec.kernels.random_bits import random_bits, random_bits_range_int32

_INV_2_POW_24 = 5.9604644775390625e-08  # 2**-24: turns 24 random bits into a uniform fp32 in [0, 1), exactly


@triton.jit
def _finite_range(x, in_group):
    """Per group: the smallest and largest finite member and whether any member is NaN / Inf."""
    nonfinite = (x.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
    usable = in_group & ~nonfinite
    low = tl.min(tl.where(usable, x, float("inf")), axis=1)
    high = tl.max(tl.where(usable, x, float("-inf")), axis=1)
    return low, high, tl.max(nonfinite.to(tl.int32), axis=1) > 0


@triton.jit
def _store_int8_codes(
    x, group, member, in_group, low, safe_scale, has_scale, poisoned, words_ptr, num_groups, row_dim, words_per_row,
    first, k1, k2, STOCHASTIC: tl.constexpr, BLOCK_G: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Quantize one ``[BLOCK_G, COLS]`` tile (columns ``first ...``) with its groups' scale and bias and store the
    packed code words."""
    usable = in_group & ((x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000)
    # IEEE divisions (Triton's default fp32 '/' is approximate on GPUs).
    q = tl.where(has_scale[:, None] & usable, tl.math.div_rn(x - low[:, None], safe_scale[:, None]), 0.0)
    # 0 <= q < 2**24, so truncation is the floor and the fraction is exact (no libdevice floor: it flushes subnormals).
    base = q.to(tl.int32)
    frac = q - base.to(tl.float32)
    if STOCHASTIC:
        rand = random_bits(group[:, None] * row_dim + member[None, :], k1, k2)
        up = (rand >> 8).to(tl.float32) * 5.9604644775390625e-08 < frac  # uniform in [0, 1) on a 2**-24 grid
    else:
        up = (frac > 0.5) | ((frac == 0.5) & ((base & 1) == 1))
    code = tl.minimum(tl.maximum(base + up.to(tl.int32), 0), 255)
    code = tl.where(in_group & ~poisoned[:, None], code, 0).to(tl.uint32)
    words = pack_bytes_le(code, BLOCK_G, COLS)
    word = first // 4 + tl.arange(0, COLS // 4)
    row_words = words_ptr + group * words_per_row
    real = group < num_groups
    tl.store(row_words[:, None] + word[None, :], words, mask=real[:, None] & (word < words_per_row - 2)[None, :])


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "STOCHASTIC"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit(do_not_specialize=["k1", "k2"])
def _int8_encode_kernel(
    x_ptr,
    words_ptr,
    num_groups,
    cols,
    groups_per_row,
    row_stride,
    row_dim,
    words_per_row,
    k1,
    k2,
    G_BUCKET,
    STOCHASTIC: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """Encode BLOCK_G groups; ``words_ptr`` is the int32 view of the ``[G, ceil4(row_dim) + 8]`` byte output. A group
    wider than a tile is read twice: its range from every chunk, then its codes chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    if COLS == ROW_P2:
        member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim, 0,
                                              COLS)  # fmt: skip
        low, high, any_nonfinite = _finite_range(x, in_group)
    else:
        low = tl.full((BLOCK_G,), float("inf"), tl.float32)
        high = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        any_nonfinite = tl.zeros((BLOCK_G,), tl.int1)
        for first in range(0, ROW_P2, COLS):
            member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim,
                                                  first, COLS)  # fmt: skip
            chunk_low, chunk_high, chunk_nonfinite = _finite_range(x, in_group)
            low, high = tl.minimum(low, chunk_low), tl.maximum(high, chunk_high)
            any_nonfinite = any_nonfinite | chunk_nonfinite
    low, high = low + 0.0, high + 0.0  # -0.0 -> +0.0: one bit pattern for zero
    span = high - low
    poisoned = any_nonfinite | (span == float("inf"))
    scale = tl.math.div_rn(span, 255.0)
    has_scale = (scale > 0.0) & ~poisoned
    safe_scale = tl.where(has_scale, scale, 1.0)
    if COLS == ROW_P2:
        _store_int8_codes(x, group, member, in_group, low, safe_scale, has_scale, poisoned, words_ptr, num_groups,
                          row_dim, words_per_row, 0, k1, k2, STOCHASTIC, BLOCK_G, COLS)  # fmt: skip
    else:
        for first in range(0, ROW_P2, COLS):
            member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim,
                                                  first, COLS)  # fmt: skip
            _store_int8_codes(x, group, member, in_group, low, safe_scale, has_scale, poisoned, words_ptr,
                              num_groups, row_dim, words_per_row, first, k1, k2, STOCHASTIC, BLOCK_G,
                              COLS)  # fmt: skip
    nan = tl.full(scale.shape, 0x7FC00000, tl.uint32)
    scale_bits = tl.where(poisoned, nan, scale.to(tl.uint32, bitcast=True))
    bias_bits = tl.where(poisoned, nan, low.to(tl.uint32, bitcast=True))
    row_words = words_ptr + group * words_per_row + words_per_row - 2
    tl.store(row_words, scale_bits.to(tl.int32, bitcast=True), mask=real)
    tl.store(row_words + 1, bias_bits.to(tl.int32, bitcast=True), mask=real)


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "OUT_KIND"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit
def _int8_decode_kernel(
    q_ptr,
    out_ptr,
    num_groups,
    row_dim,
    row_bytes,
    G_BUCKET,
    OUT_KIND: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """out[g * row_dim + j] = code[g, j] * scale[g] + bias[g], rounded twice (launched without FMA contraction).
    Groups wider than a tile go chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    row = q_ptr + group * row_bytes
    scale = load_le_word(row + row_bytes - 8, real).to(tl.float32, bitcast=True)
    bias = load_le_word(row + row_bytes - 4, real).to(tl.float32, bitcast=True)
    for first in range(0, ROW_P2, COLS):
        member = first + tl.arange(0, COLS)
        in_group = real[:, None] & (member < row_dim)[None, :]
        code = tl.load(row[:, None] + member[None, :], mask=in_group, other=0).to(tl.float32)
        value = code * scale[:, None] + bias[:, None]
        store_output(out_ptr, group[:, None] * row_dim + member[None, :], in_group, value, OUT_KIND)


def _quantize_int8_triton(input: torch.Tensor, row_dim: int, stochastic_rounding: bool, seed: int) -> torch.Tensor:
    row_bytes = int8_row_bytes(row_dim)
    return launch_encode(
        _int8_encode_kernel, input, row_dim, row_bytes, stochastic_rounding, seed, as_words=True,
        extra_args=(row_bytes // 4,),
    )  # fmt: skip


def _dequantize_int8_triton(input: torch.Tensor, row_dim: int, units: int, output_dtype: torch.dtype) -> torch.Tensor:
    return launch_decode(
        _int8_decode_kernel, input, row_dim, units, output_dtype, extra_args=(int8_row_bytes(row_dim),)
    )


def quantize_int8_rowwise_reference(
    input: torch.Tensor, row_dim: int = 32, stochastic_rounding: bool = False, seed: int = 0
) -> torch.Tensor:
    """The specification of :func:`quantize_int8_rowwise`."""
    groups = padded_groups(input, row_dim)
    low = groups.amin(dim=1, keepdim=True) + 0.0  # -0.0 -> +0.0 (NaN propagates)
    high = groups.amax(dim=1, keepdim=True) + 0.0
    span = high - low
    poisoned = ~torch.isfinite(span)  # a NaN/Inf in the group, or max - min beyond fp32
    # Divide by device tensors, not Python scalars: CUDA torch turns scalar division into a reciprocal multiply.
    scale = span / span.new_tensor(255.0)
    has_scale = (scale > 0) & ~poisoned
    safe_scale = torch.where(has_scale, scale, 1.0)
    out = torch.empty((groups.shape[0], int8_row_bytes(row_dim)), dtype=torch.uint8, device=input.device)
    rand = None
    if stochastic_rounding:
        rand = random_bits_range_int32(groups.numel(), seed, input.device).view(groups.shape)
    if bool(poisoned.any()):
        out[:, :row_dim] = _round_codes(groups, low, safe_scale, has_scale, poisoned, rand)
    else:
        # Finite groups: q = (x - low) / scale in place, rounded in fp32 and written straight into the uint8 codes
        # (copy_ of integers in [0, 255] is exact). Nearest-even: torch.round is half-to-even, the same as the
        # floor/fraction rule of _round_codes for 0 <= q < 2**23, and a group without a scale has
        # q <= span < 2**-140, which rounds to 0.
        q = torch.sub(groups, low).div_(safe_scale)
        if rand is None:
            q.round_()
        else:
            q = _round_up_stochastic_(q, rand, has_scale)
        out[:, :row_dim] = q.clamp_(0, 255)
    out[:, row_dim : ceil4(row_dim)] = 0
    meta = torch.cat([scale, low], dim=1).masked_fill(poisoned, torch.nan)
    out[:, ceil4(row_dim) :] = ref.cast_with_canonical_nan(meta, torch.float32).view(torch.uint8)
    return out.reshape(encoded_shape(input, row_dim, out.shape[1]))


def _round_up_stochastic_(q: torch.Tensor, rand: torch.Tensor, has_scale: torch.Tensor) -> torch.Tensor:
    """:func:`_round_codes`' stochastic rule on finite groups, in fp32 and in place on ``q`` and ``rand``:
    ``trunc(q)`` (the int32 truncation, exact for 0 <= q < 2**24) plus one when the 24-bit uniform is below the
    fraction; groups without a scale get 0 (their tiny q could otherwise round up on a zero draw)."""
    if not bool(has_scale.all()):
        q.masked_fill_(~has_scale, 0.0)
    base = q.trunc()
    frac = q.sub_(base)
    uniform = torch.bitwise_right_shift(rand, 8, out=rand).bitwise_and_(0xFFFFFF).to(torch.float32)
    return base.add_(uniform.mul_(_INV_2_POW_24) < frac)


def _round_codes(
    groups: torch.Tensor,
    low: torch.Tensor,
    safe_scale: torch.Tensor,
    has_scale: torch.Tensor,
    poisoned: torch.Tensor,
    rand: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel's rounding of ``q = (x - low) / scale``: floor plus a fraction test (nearest-even, or against 24
    random bits), on ``[G, row_dim]`` groups; uint8 codes, zero in poisoned groups."""
    usable = has_scale & torch.isfinite(groups)
    q = torch.where(usable, (groups - low) / safe_scale, 0.0)
    base = q.to(torch.int32)  # truncation == floor for 0 <= q < 2**24
    frac = q - base.to(torch.float32)
    if rand is None:
        up = (frac > 0.5) | ((frac == 0.5) & ((base & 1) == 1))
    else:
        up = ((rand >> 8) & 0xFFFFFF).to(torch.float32) * _INV_2_POW_24 < frac  # the top 24 of the uint32 bits
    return (base + up.to(torch.int32)).clamp(0, 255).masked_fill(poisoned, 0).to(torch.uint8)


def dequantize_int8_rowwise_reference(
    input: torch.Tensor, row_dim: int = 32, output_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The specification of :func:`dequantize_int8_rowwise`: ``code * scale + bias`` in fp32, two roundings."""
    row_bytes = int8_row_bytes(row_dim)
    units = input.shape[-1] // row_bytes
    rows = input.reshape(-1, row_bytes)
    meta = rows[:, row_bytes - 8 :].contiguous().view(torch.float32)
    value = rows[:, :row_dim].to(torch.float32).mul_(meta[:, :1]).add_(meta[:, 1:])
    if ref.all_finite(meta):  # codes are finite, so only a non-finite scale or bias can make a NaN
        return (value if output_dtype == torch.float32 else value.to(output_dtype)).reshape(
            decoded_shape(input, units, row_dim)
        )
    return ref.to_output(value, output_dtype).reshape(decoded_shape(input, units, row_dim))


def _raise_if_unencodable(input: torch.Tensor, row_dim: int) -> None:
    """``nonfinite="raise"``: name the first group holding NaN/Inf or spanning more than fp32's range."""
    groups = padded_groups(input, row_dim)
    finite = torch.isfinite(groups)
    span = torch.where(finite, groups, 0.0).amax(dim=1) - torch.where(finite, groups, 0.0).amin(dim=1)
    bad = ~finite.all(dim=1) | torch.isinf(span)
    if bool(bad.any()):
        group = int(bad.nonzero()[0].item())
        raise ValueError(
            f"input group {group} (values {group * row_dim}..{(group + 1) * row_dim - 1} of the zero-padded input) "
            f"holds NaN/Inf or spans more than fp32's range, which INT8 cannot encode (nonfinite='raise'; "
            "nonfinite='propagate' decodes such a group as NaN)"
        )


def quantize_int8_rowwise(
    input: torch.Tensor,
    row_dim: int = 32,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    nonfinite: NonFinitePolicy = "propagate",
    backend: Backend = "auto",
) -> torch.Tensor:
    """fp32 ``[N]`` (``N % row_dim == 0``) or ``[R, C]`` -> uint8 ``[N / row_dim * B]`` or ``[R, ceil(C / row_dim) *
    B]`` with ``B = ceil4(row_dim) + 8`` bytes per group."""
    check_float32_input(input, ndim=(1, 2))
    check_row_dim(row_dim)
    check_seed(seed)
    launch_geometry(input, row_dim)  # shape check before any work
    policy = check_nonfinite_policy(nonfinite)
    resolved = resolve_backend(backend, input)
    return _quantize_int8_op(input, row_dim, bool(stochastic_rounding), seed_arg(seed), policy, resolved)


def dequantize_int8_rowwise(
    input: torch.Tensor,
    row_dim: int = 32,
    *,
    output_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """uint8 ``[..., units * B]`` -> ``output_dtype`` ``[..., units * row_dim]`` (padding columns included)."""
    check_row_dim(row_dim)
    units = check_encoded(input, int8_row_bytes(row_dim), "INT8 rows")
    check_output_dtype(output_dtype)
    return _dequantize_int8_op(input, row_dim, units, output_dtype, resolve_backend(backend, input))


# --------------------------------------------------------------------------------------------------- the ops
# Bytes out / bytes in: neither op has a gradient.
@custom_op("quantize_int8_rowwise")
def _quantize_int8_op(
    input: torch.Tensor, row_dim: int, stochastic_rounding: bool, seed: int, nonfinite: str, backend: str
) -> torch.Tensor:
    if nonfinite == "raise":
        _raise_if_unencodable(input, row_dim)
    seed = seed_from_arg(seed)
    if backend == "triton":
        return _quantize_int8_triton(input, row_dim, stochastic_rounding, seed)
    return quantize_int8_rowwise_reference(input, row_dim, stochastic_rounding, seed)


@_quantize_int8_op.register_fake
def _(input, row_dim, stochastic_rounding, seed, nonfinite, backend):
    return input.new_empty(encoded_shape(input, row_dim, int8_row_bytes(row_dim)), dtype=torch.uint8)


@custom_op("dequantize_int8_rowwise")
def _dequantize_int8_op(
    input: torch.Tensor, row_dim: int, units: int, output_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    if backend == "triton":
        return _dequantize_int8_triton(input, row_dim, units, output_dtype)
    return dequantize_int8_rowwise_reference(input, row_dim, output_dtype)


@_dequantize_int8_op.register_fake
def _(input, row_dim, units, output_dtype, backend):
    return input.new_empty(decoded_shape(input, units, row_dim), dtype=output_dtype)
