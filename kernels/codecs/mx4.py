"""MX4 comm encoding: OCP Microscaling v1.0 MXFP4 (E2M1 elements, E8M0 shared exponent) in FBGEMM's byte order.

Byte layout, per group of ``group_size`` (even; OCP uses 32) consecutive values (see :mod:`.rowwise`),
``group_size / 2 + 1`` bytes (17 for 32 values, 4.25 bits per value):

    byte i < group_size / 2        element 2i in the low nibble, element 2i + 1 in the high nibble; each nibble is
                                   sign (bit 3) and E2M1 magnitude code (values 0, 0.5, 1, 1.5, 2, 3, 4, 6)
    byte group_size / 2            E8M0 shared exponent: scale = 2**(byte - 127); 0xFF = NaN group

The shared exponent is the smallest one whose scale keeps the group's largest finite magnitude from rounding past
6: ``floor(log2(amax)) - 2``, plus one when the significand of ``amax`` would round up to 8 (>= 1.75 with
nearest-even, > 1.5 with stochastic rounding), clamped to [-127, 127]. With nearest-even this is FBGEMM's "even"
shared exponent; elements are rounded to nearest even (FBGEMM rounds half away from zero) or stochastically, with
exact power-of-two scaling, so nothing saturates, except in groups within a step of fp32's max, whose codes are
capped so that decoding stays finite. E8M0 cannot scale below 2**-127, so groups whose max is under 2**-129 encode as
(signed) zeros.

Non-finite policy ("propagate"): E2M1 has no NaN/Inf, so a group holding one gets the E8M0 NaN exponent (0xFF) and
zero elements; it decodes to NaN in every position (OCP: a NaN scale makes the whole block NaN).
``nonfinite="raise"`` rejects such input instead.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, resolve_backend
from tritonrec.kernels.codecs import bits_reference as ref
from tritonrec.kernels.codecs.bits import (
    finite_code_cap,
    minifloat_code,
    minifloat_value,
    pow2,
    row_scale_exponent,
    split_magnitude,
    store_output,
)
from tritonrec.kernels.codecs.formats import (
    E8M0_BIAS,
    E8M0_NAN,
    FP4_E2M1,
    NonFinitePolicy,
    check_encoded,
    check_float32_input,
    check_nonfinite_policy,
    check_output_dtype,
    check_row_dim,
    check_seed,
    mx4_group_bytes,
    raise_if_nonfinite,
)
from tritonrec.kernels.codecs.rowwise import (
    TILE_HEURISTICS,
    decoded_shape,
    encoded_shape,
    launch_decode,
    launch_encode,
    launch_geometry,
    load_group_tile,
    padded_groups,
    program_groups,
    tile_configs,
)
from tritonrec.kernels.library import custom_op, seed_arg, seed_from_arg
from tritonrec.kernels.random_bits import random_bits, random_bits_range_int32

_E2M1 = FP4_E2M1
_MIN_SCALE_EXP = -E8M0_BIAS


@triton.jit
def _finite_amax_and_poison(x):
    """Per group: the bit pattern of the largest finite magnitude and whether any member is NaN / Inf."""
    mag = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    nonfinite = mag >= 0x7F800000
    amax = tl.max(tl.where(nonfinite, tl.zeros_like(mag), mag), axis=1)
    return amax, tl.max(nonfinite.to(tl.int32), axis=1) > 0


@triton.jit
def _store_mx4_codes(
    x, group, member, in_group, scale_exp, poisoned, out_ptr, num_groups, group_size, first, k1, k2,
    STOCHASTIC: tl.constexpr, BLOCK_G: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Encode one ``[BLOCK_G, COLS]`` tile (columns ``first ...``) with its groups' shared exponents and store the
    packed nibbles."""
    bits = x.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    mag = tl.where(mag >= 0x7F800000, tl.zeros_like(mag), mag)
    sig, e = split_magnitude(mag)
    if STOCHASTIC:
        rand = random_bits(group[:, None] * group_size + member[None, :], k1, k2)
    else:
        rand = mag
    # E2M1: 1 mantissa bit, bias 1, top binade 2**2, largest code 7 (saturating; never reached, see module doc).
    code = minifloat_code(sig, e - scale_exp[:, None], rand, 1, 1, 7, STOCHASTIC)
    code = tl.minimum(code, finite_code_cap(scale_exp, 1, 1, 7)[:, None]) | ((bits >> 31) << 3)
    code = tl.where(in_group & ~poisoned[:, None], code, tl.zeros_like(code))
    low, high = tl.split(tl.reshape(code, [BLOCK_G, COLS // 2, 2]))
    packed = (low | (high << 4)).to(tl.uint8)
    half = group_size // 2
    pair = first // 2 + tl.arange(0, COLS // 2)
    row = out_ptr + group * (half + 1)
    tl.store(row[:, None] + pair[None, :], packed, mask=(group < num_groups)[:, None] & (pair < half)[None, :])


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "STOCHASTIC"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit(do_not_specialize=["k1", "k2"])
def _mx4_encode_kernel(
    x_ptr,
    out_ptr,
    num_groups,
    cols,
    groups_per_row,
    row_stride,
    group_size,
    k1,
    k2,
    G_BUCKET,
    SIG_LIMIT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """Encode BLOCK_G groups into ``out_ptr`` (uint8, ``group_size / 2 + 1`` bytes per group). A group wider than a
    tile is read twice: its shared exponent from every chunk, then its codes chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    if COLS == ROW_P2:
        member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, group_size,
                                              0, COLS)  # fmt: skip
        amax, poisoned = _finite_amax_and_poison(x)
        scale_exp = row_scale_exponent(amax, 2, SIG_LIMIT, -127)
        _store_mx4_codes(x, group, member, in_group, scale_exp, poisoned, out_ptr, num_groups, group_size, 0, k1, k2,
                         STOCHASTIC, BLOCK_G, COLS)  # fmt: skip
    else:
        amax = tl.zeros((BLOCK_G,), tl.uint32)
        poisoned = tl.zeros((BLOCK_G,), tl.int1)
        for first in range(0, ROW_P2, COLS):
            _, _, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, group_size, first,
                                      COLS)  # fmt: skip
            chunk_amax, chunk_poisoned = _finite_amax_and_poison(x)
            amax, poisoned = tl.maximum(amax, chunk_amax), poisoned | chunk_poisoned
        scale_exp = row_scale_exponent(amax, 2, SIG_LIMIT, -127)
        for first in range(0, ROW_P2, COLS):
            member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride,
                                                  group_size, first, COLS)  # fmt: skip
            _store_mx4_codes(x, group, member, in_group, scale_exp, poisoned, out_ptr, num_groups, group_size, first,
                             k1, k2, STOCHASTIC, BLOCK_G, COLS)  # fmt: skip
    shared = tl.where(poisoned, 0xFF, scale_exp + 127).to(tl.uint8)
    tl.store(out_ptr + group * (group_size // 2 + 1) + group_size // 2, shared, mask=real)


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "OUT_KIND"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit
def _mx4_decode_kernel(
    q_ptr,
    out_ptr,
    num_groups,
    group_size,
    G_BUCKET,
    OUT_KIND: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """out[g * group_size + j] = e2m1(nibble j of group g) * 2**(exponent byte - 127); NaN for exponent 0xFF.
    Groups wider than a tile go chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    half = group_size // 2
    row = q_ptr + group * (half + 1)
    shared = tl.load(row + half, mask=real, other=0).to(tl.int32)
    scale = pow2(shared - 127)
    for first in range(0, ROW_P2, COLS):
        pair = first // 2 + tl.arange(0, COLS // 2)
        packed = tl.load(row[:, None] + pair[None, :], mask=real[:, None] & (pair < half)[None, :], other=0)
        packed = packed.to(tl.uint32)
        code = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_G, COLS])
        value = minifloat_value(code & 0x7, 1, 1) * scale[:, None]
        value = tl.where((code >> 3) != 0, -value, value)
        value = tl.where((shared == 0xFF)[:, None], float("nan"), value)
        member = first + tl.arange(0, COLS)
        in_group = real[:, None] & (member < group_size)[None, :]
        store_output(out_ptr, group[:, None] * group_size + member[None, :], in_group, value, OUT_KIND)


def _quantize_mx4_triton(input: torch.Tensor, group_size: int, stochastic_rounding: bool, seed: int) -> torch.Tensor:
    return launch_encode(
        _mx4_encode_kernel, input, group_size, mx4_group_bytes(group_size), stochastic_rounding, seed, as_words=False,
        SIG_LIMIT=_E2M1.scale_sig_limit(stochastic_rounding),
    )  # fmt: skip


def _dequantize_mx4_triton(input: torch.Tensor, group_size: int, units: int, output_dtype: torch.dtype) -> torch.Tensor:
    return launch_decode(_mx4_decode_kernel, input, group_size, units, output_dtype)


def quantize_mx4_reference(
    input: torch.Tensor, group_size: int = 32, stochastic_rounding: bool = False, seed: int = 0
) -> torch.Tensor:
    """The specification of :func:`quantize_mx4`.

    Finite input with nearest-even rounding takes a fast path: scale by the exact power of two, then look the E2M1
    code up by the fp32 exponent, top three mantissa bits and a sticky bit (all nearest-even needs below 8; the
    table is built by :func:`_encode_e2m1_bits` itself). Everything else runs the kernel's integer algorithm.
    """
    groups = padded_groups(input, group_size)
    amax = ref.row_abs_max(groups)
    if not stochastic_rounding and ref.all_finite(amax):
        scale_exp = ref.row_scale_exponent(amax.view(torch.int32), _E2M1, False, _MIN_SCALE_EXP)
        if not bool((ref.finite_code_cap(scale_exp, _E2M1) < _E2M1.max_code).any()):  # no group at fp32's top
            bits = ref.scale_by_pow2(groups, -scale_exp).view(torch.int32)
            key = ((bits >> 19) & 0x1FFE) | ((bits & 0xFFFFF) != 0).to(torch.int32)
            table = ref.lookup_table("e2m1_codes", input.device, _e2m1_code_table)
            code = table.index_select(0, key.view(-1)).view(key.shape)
            return _pack(input, group_size, code, scale_exp + E8M0_BIAS)
    rand = None
    if stochastic_rounding:
        rand = random_bits_range_int32(groups.numel(), seed, input.device).view(groups.shape)
    mag, sign = ref.magnitude_bits(groups.contiguous())
    nonfinite = mag >= 0x7F800000
    poisoned = nonfinite.any(dim=1, keepdim=True)
    mag = mag.masked_fill(nonfinite, 0)
    scale_exp = ref.row_scale_exponent(mag.amax(dim=1, keepdim=True), _E2M1, stochastic_rounding, _MIN_SCALE_EXP)
    code = _encode_e2m1_bits(mag, scale_exp, rand) | (sign << 3)
    return _pack(
        input, group_size, code.masked_fill(poisoned, 0), (scale_exp + E8M0_BIAS).masked_fill(poisoned, E8M0_NAN)
    )


def _encode_e2m1_bits(mag: torch.Tensor, scale_exp: torch.Tensor, rand: torch.Tensor | None) -> torch.Tensor:
    """E2M1 magnitude codes (int32) of finite fp32 magnitude bits divided by ``2**scale_exp``: the kernel's rule."""
    sig, e = ref.split_magnitude(mag)
    return torch.minimum(ref.minifloat_code(sig, e - scale_exp, rand, _E2M1), ref.finite_code_cap(scale_exp, _E2M1))


def _e2m1_code_table() -> torch.Tensor:
    """uint8 ``[8192]``: signed E2M1 code of every (sign, 8-bit exponent, 3 mantissa bits, sticky) key of |v| < 8,
    built by the integer algorithm itself; the sticky bit stands for any nonzero bits below the top three."""
    key = torch.arange(8192, dtype=torch.int32)
    magnitude = (((key >> 1) & 0x7FF) << 20) | (key & 1)
    code = _encode_e2m1_bits(magnitude, torch.zeros_like(key), None) | ((key >> 12) << 3)
    return code.to(torch.uint8)


def _pack(input: torch.Tensor, group_size: int, code: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Signed nibble codes ``[G, group_size]`` and E8M0 bytes ``[G, 1]`` -> the encoded groups."""
    # Two uint8 codes read as one little-endian int16: element 2i in the low byte, 2i + 1 in the high byte.
    pairs = code.to(torch.uint8).contiguous().view(torch.int16)
    out = torch.empty((code.shape[0], mx4_group_bytes(group_size)), dtype=torch.uint8, device=code.device)
    out[:, :-1] = ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)
    out[:, -1:] = shared
    return out.reshape(encoded_shape(input, group_size, out.shape[1]))


def dequantize_mx4_reference(
    input: torch.Tensor, group_size: int = 32, output_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The specification of :func:`dequantize_mx4`: exact element value times ``2**(byte - 127)``, one rounding."""
    unit = mx4_group_bytes(group_size)
    units = input.shape[-1] // unit
    rows = input.reshape(-1, unit)
    packed = rows[:, :-1].contiguous().view(-1).to(torch.int32)
    pairs = ref.lookup_table("e2m1_pairs", input.device, _e2m1_pair_values)
    shared = rows[:, -1:].to(torch.int32)
    value = pairs.index_select(0, packed).view(-1, group_size) * ref.pow2(shared - E8M0_BIAS)
    nan_group = shared == E8M0_NAN
    if bool(nan_group.any()):
        value = value.masked_fill(nan_group, torch.nan)
    return ref.to_output(value, output_dtype).reshape(decoded_shape(input, units, group_size))


def _e2m1_pair_values() -> torch.Tensor:
    """fp32 ``[256, 2]``: the two exact E2M1 values packed in every byte (low nibble first)."""
    nibble = torch.arange(16, dtype=torch.int32)
    value = ref.minifloat_value(nibble & 0x7, _E2M1)
    value = torch.where(nibble >= 8, -value, value)
    byte = torch.arange(256)
    return torch.stack([value[byte & 0xF], value[byte >> 4]], dim=1)


def quantize_mx4(
    input: torch.Tensor,
    group_size: int = 32,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    nonfinite: NonFinitePolicy = "propagate",
    backend: Backend = "auto",
) -> torch.Tensor:
    """fp32 ``[N]`` (``N % group_size == 0``) or ``[R, C]`` -> uint8 ``[N / group_size * B]`` or
    ``[R, ceil(C / group_size) * B]`` with ``B = group_size / 2 + 1`` bytes per group."""
    check_float32_input(input, ndim=(1, 2))
    check_row_dim(group_size, "group_size", even=True)
    check_seed(seed)
    launch_geometry(input, group_size)  # shape check before any work
    policy = check_nonfinite_policy(nonfinite)
    resolved = resolve_backend(backend, input)
    return _quantize_mx4_op(input, group_size, bool(stochastic_rounding), seed_arg(seed), policy, resolved)


def dequantize_mx4(
    input: torch.Tensor,
    group_size: int = 32,
    *,
    output_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """uint8 ``[..., units * B]`` -> ``output_dtype`` ``[..., units * group_size]`` (padding columns included)."""
    check_row_dim(group_size, "group_size", even=True)
    units = check_encoded(input, mx4_group_bytes(group_size), "MX4 groups")
    check_output_dtype(output_dtype)
    return _dequantize_mx4_op(input, group_size, units, output_dtype, resolve_backend(backend, input))


# --------------------------------------------------------------------------------------------------- the ops
# Bytes out / bytes in: neither op has a gradient.
@custom_op("quantize_mx4")
def _quantize_mx4_op(
    input: torch.Tensor, group_size: int, stochastic_rounding: bool, seed: int, nonfinite: str, backend: str
) -> torch.Tensor:
    if nonfinite == "raise":
        raise_if_nonfinite(input)
    seed = seed_from_arg(seed)
    if backend == "triton":
        return _quantize_mx4_triton(input, group_size, stochastic_rounding, seed)
    return quantize_mx4_reference(input, group_size, stochastic_rounding, seed)


@_quantize_mx4_op.register_fake
def _(input, group_size, stochastic_rounding, seed, nonfinite, backend):
    return input.new_empty(encoded_shape(input, group_size, mx4_group_bytes(group_size)), dtype=torch.uint8)


@custom_op("dequantize_mx4")
def _dequantize_mx4_op(
    input: torch.Tensor, group_size: int, units: int, output_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    if backend == "triton":
        return _dequantize_mx4_triton(input, group_size, units, output_dtype)
    return dequantize_mx4_reference(input, group_size, output_dtype)


@_dequantize_mx4_op.register_fake
def _(input, group_size, units, output_dtype, backend):
    return input.new_empty(decoded_shape(input, units, group_size), dtype=output_dtype)
