"""FP8 row-wise comm encoding (OCP E4M3 "fn" for forward, E5M2 for backward) with a power-of-two fp32 row scale.

Byte layout, per group of ``row_dim`` consecutive values (see :mod:`.rowwise` for how inputs split into groups),
``ceil4(row_dim) + 4`` bytes:

    [0, row_dim)                   FP8 codes, value j at byte j (sign, exponent, mantissa as in OCP FP8 v1.0)
    [row_dim, ceil4(row_dim))      zero
    [ceil4(row_dim), +4)           fp32 scale = 2**s, little-endian; decode gives code_value * scale

``s`` is the smallest exponent for which the row's largest finite magnitude still rounds inside the format
(``amax / 2**s`` lands at the format's top binade, 448 for E4M3, 57344 for E5M2), clamped to ``s >= -149``; a zero
row has ``s = 0``. A power of two makes the scaling exact, so encoding is pure integer rounding of each value
(nearest-even, or stochastic) and no value saturates (except in rows within one FP8 step of fp32's max, whose codes
are capped so that decoding stays finite). Unlike FBGEMM's non-row-wise FP8 nothing clips at 0.9375.

Non-finite policy ("propagate"): the scale comes from the finite values; NaN -> NaN code (0x7F), +-Inf -> +-Inf
(E5M2) or NaN (E4M3 has no Inf). ``nonfinite="raise"`` rejects NaN/Inf inputs instead.
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
    pow2_exponent_bits,
    row_scale_exponent,
    split_magnitude,
    store_output,
)
from tritonrec.kernels.codecs.formats import (
    FP8_FORMATS,
    FP32_MIN_POW2_EXP,
    MiniFloat,
    NonFinitePolicy,
    ceil4,
    check_encoded,
    check_float32_input,
    check_format,
    check_nonfinite_policy,
    check_output_dtype,
    check_row_dim,
    check_seed,
    fp8_row_bytes,
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
    load_le_word,
    pack_bytes_le,
    padded_groups,
    program_groups,
    tile_configs,
)
from tritonrec.kernels.library import custom_op, seed_arg, seed_from_arg
from tritonrec.kernels.random_bits import random_bits, random_bits_range_int32


@triton.jit
def _finite_amax(x):
    """Per group (row of ``x``): the bit pattern of the largest finite magnitude (0 when there is none)."""
    mag = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.where(mag >= 0x7F800000, tl.zeros_like(mag), mag), axis=1)


@triton.jit
def _store_fp8_codes(
    x, group, member, in_group, scale_exp, words_ptr, num_groups, row_dim, words_per_row, first, k1, k2,
    MBITS: tl.constexpr, BIAS: tl.constexpr, OVERFLOW_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_G: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Encode one ``[BLOCK_G, COLS]`` tile (columns ``first ...``) with its groups' scale exponents and store the
    packed code words."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    mag = bits & 0x7FFFFFFF
    nonfinite = mag >= 0x7F800000
    is_nan = mag > 0x7F800000
    mag = tl.where(nonfinite, tl.zeros_like(mag), mag)
    sig, e = split_magnitude(mag)
    if STOCHASTIC:
        rand = random_bits(group[:, None] * row_dim + member[None, :], k1, k2)
    else:
        rand = mag
    code = minifloat_code(sig, e - scale_exp[:, None], rand, MBITS, BIAS, OVERFLOW_CODE, STOCHASTIC)
    code = tl.minimum(code, finite_code_cap(scale_exp, MBITS, BIAS, OVERFLOW_CODE)[:, None]) | (sign << 7)
    nan_code = tl.full(code.shape, NAN_CODE, tl.uint32)
    if INF_CODE >= 0:
        code = tl.where(is_nan, nan_code, tl.where(nonfinite, (sign << 7) | INF_CODE, code))
    else:
        code = tl.where(nonfinite, nan_code, code)
    code = tl.where(in_group, code, tl.zeros_like(code))
    words = pack_bytes_le(code, BLOCK_G, COLS)
    word = first // 4 + tl.arange(0, COLS // 4)
    row_words = words_ptr + group * words_per_row
    real = group < num_groups
    tl.store(row_words[:, None] + word[None, :], words, mask=real[:, None] & (word < words_per_row - 1)[None, :])


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "MBITS", "STOCHASTIC"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit(do_not_specialize=["k1", "k2"])
def _fp8_encode_kernel(
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
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    EMAX: tl.constexpr,
    SIG_LIMIT: tl.constexpr,
    OVERFLOW_CODE: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """Encode BLOCK_G groups; ``words_ptr`` is the int32 view of the ``[G, ceil4(row_dim) + 4]`` byte output.
    ``INF_CODE < 0`` means the format has no Inf. A group wider than a tile is read twice: its scale from every
    chunk, then its codes chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    if COLS == ROW_P2:
        member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim, 0,
                                              COLS)  # fmt: skip
        scale_exp = row_scale_exponent(_finite_amax(x), EMAX, SIG_LIMIT, -149)
        _store_fp8_codes(x, group, member, in_group, scale_exp, words_ptr, num_groups, row_dim, words_per_row, 0, k1,
                         k2, MBITS, BIAS, OVERFLOW_CODE, NAN_CODE, INF_CODE, STOCHASTIC, BLOCK_G, COLS)  # fmt: skip
    else:
        amax = tl.zeros((BLOCK_G,), tl.uint32)
        for first in range(0, ROW_P2, COLS):
            _, _, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim, first, COLS)
            amax = tl.maximum(amax, _finite_amax(x))
        scale_exp = row_scale_exponent(amax, EMAX, SIG_LIMIT, -149)
        for first in range(0, ROW_P2, COLS):
            member, in_group, x = load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim,
                                                  first, COLS)  # fmt: skip
            _store_fp8_codes(x, group, member, in_group, scale_exp, words_ptr, num_groups, row_dim, words_per_row,
                             first, k1, k2, MBITS, BIAS, OVERFLOW_CODE, NAN_CODE, INF_CODE, STOCHASTIC, BLOCK_G,
                             COLS)  # fmt: skip
    bits = pow2_exponent_bits(scale_exp).to(tl.int32, bitcast=True)
    tl.store(words_ptr + group * words_per_row + words_per_row - 1, bits, mask=real)


@autotune(configs=tile_configs(), key=["G_BUCKET", "ROW_P2", "MBITS", "OUT_KIND"])
@triton.heuristics(TILE_HEURISTICS)
@triton.jit
def _fp8_decode_kernel(
    q_ptr,
    out_ptr,
    num_groups,
    row_dim,
    row_bytes,
    G_BUCKET,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    INF_CODE: tl.constexpr,
    NAN_ABOVE: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ROW_P2: tl.constexpr,
    ELEMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    COLS: tl.constexpr,
):
    """out[g * row_dim + j] = value(code[g, j]) * scale[g]; magnitude codes above NAN_ABOVE are NaN. Bytes are read
    one by one, so the encoded buffer may start at any offset. Groups wider than a tile go chunk by chunk."""
    group, real = program_groups(num_groups, BLOCK_G)
    row = q_ptr + group * row_bytes
    scale = load_le_word(row + row_bytes - 4, real).to(tl.float32, bitcast=True)
    for first in range(0, ROW_P2, COLS):
        member = first + tl.arange(0, COLS)
        in_group = real[:, None] & (member < row_dim)[None, :]
        code = tl.load(row[:, None] + member[None, :], mask=in_group, other=0).to(tl.uint32)
        mag = code & 0x7F
        value = minifloat_value(mag, MBITS, BIAS)
        if INF_CODE >= 0:
            value = tl.where(mag == INF_CODE, float("inf"), value)
        value = tl.where((code >> 7) != 0, -value, value) * scale[:, None]
        value = tl.where(mag > NAN_ABOVE, float("nan"), value)
        store_output(out_ptr, group[:, None] * row_dim + member[None, :], in_group, value, OUT_KIND)


def _quantize_fp8_triton(
    input: torch.Tensor, row_dim: int, spec: MiniFloat, stochastic_rounding: bool, seed: int
) -> torch.Tensor:
    row_bytes = fp8_row_bytes(row_dim)
    return launch_encode(
        _fp8_encode_kernel, input, row_dim, row_bytes, stochastic_rounding, seed, as_words=True,
        extra_args=(row_bytes // 4,),
        MBITS=spec.mbits,
        BIAS=spec.bias,
        EMAX=spec.emax,
        SIG_LIMIT=spec.scale_sig_limit(stochastic_rounding),
        OVERFLOW_CODE=spec.overflow_code,
        NAN_CODE=spec.nan_code,
        INF_CODE=-1 if spec.inf_code is None else spec.inf_code,
    )  # fmt: skip


def _dequantize_fp8_triton(
    input: torch.Tensor, row_dim: int, spec: MiniFloat, units: int, output_dtype: torch.dtype
) -> torch.Tensor:
    return launch_decode(
        _fp8_decode_kernel, input, row_dim, units, output_dtype, extra_args=(fp8_row_bytes(row_dim),),
        MBITS=spec.mbits,
        BIAS=spec.bias,
        INF_CODE=-1 if spec.inf_code is None else spec.inf_code,
        NAN_ABOVE=max(spec.max_code, spec.inf_code or 0),
    )  # fmt: skip


_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize_fp8_rowwise_reference(
    input: torch.Tensor, row_dim: int = 32, fmt: str = "e4m3", stochastic_rounding: bool = False, seed: int = 0
) -> torch.Tensor:
    """The specification of :func:`quantize_fp8_rowwise`.

    Finite input with nearest-even rounding takes a fast path: scale by the exact power of two, then torch's FP8
    cast (IEEE nearest-even; tests check it against :func:`_encode_fp8_bits` bit for bit). Everything else runs the
    kernel's integer algorithm.
    """
    spec = FP8_FORMATS[fmt]
    groups = padded_groups(input, row_dim)
    amax = ref.row_abs_max(groups)
    if not stochastic_rounding and ref.all_finite(amax):
        scale_exp = ref.row_scale_exponent(amax.view(torch.int32), spec, False, FP32_MIN_POW2_EXP)
        # 2**-s must be a normal fp32, and no row may sit so close to fp32's top that its codes need capping.
        capped = ref.finite_code_cap(scale_exp, spec) < spec.max_code
        if groups.shape[0] == 0 or (int(scale_exp.min()) >= -127 and not bool(capped.any())):
            codes = ref.scale_by_pow2(groups, -scale_exp).to(_TORCH_FP8[fmt]).view(torch.uint8)
            return _assemble_rows(input, row_dim, codes, scale_exp)
    rand = random_bits_range_int32(groups.numel(), seed, input.device) if stochastic_rounding else None
    codes, scale_exp = _encode_fp8_bits(groups, spec, rand)
    return _assemble_rows(input, row_dim, codes, scale_exp)


def _encode_fp8_bits(
    groups: torch.Tensor, spec: MiniFloat, rand: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's integer algorithm on ``[G, row_dim]`` groups: (uint8 codes, int32 scale exponents ``[G, 1]``)."""
    mag, sign = ref.magnitude_bits(groups.contiguous())
    nonfinite = mag >= 0x7F800000
    is_nan = mag > 0x7F800000
    mag = mag.masked_fill(nonfinite, 0)
    stochastic = rand is not None
    scale_exp = ref.row_scale_exponent(mag.amax(dim=1, keepdim=True), spec, stochastic, FP32_MIN_POW2_EXP)
    code = ref.encode_scaled_minifloat(mag, sign, scale_exp, None if rand is None else rand.view(groups.shape), spec)
    if spec.inf_code is not None:
        code = torch.where(nonfinite, (sign << 7) | spec.inf_code, code)
        code = code.masked_fill(is_nan, spec.nan_code)
    else:
        code = code.masked_fill(nonfinite, spec.nan_code)
    return code.to(torch.uint8), scale_exp


def _assemble_rows(input: torch.Tensor, row_dim: int, codes: torch.Tensor, scale_exp: torch.Tensor) -> torch.Tensor:
    out = torch.empty((codes.shape[0], fp8_row_bytes(row_dim)), dtype=torch.uint8, device=codes.device)
    out[:, :row_dim] = codes
    out[:, row_dim : ceil4(row_dim)] = 0
    out[:, ceil4(row_dim) :] = ref.pow2(scale_exp).view(torch.uint8)
    return out.reshape(encoded_shape(input, row_dim, out.shape[1]))


def dequantize_fp8_rowwise_reference(
    input: torch.Tensor, row_dim: int = 32, fmt: str = "e4m3", output_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The specification of :func:`dequantize_fp8_rowwise`: exact code value times the row scale, one rounding."""
    row_bytes = fp8_row_bytes(row_dim)
    units = input.shape[-1] // row_bytes
    rows = input.reshape(-1, row_bytes)
    codes = rows[:, :row_dim].contiguous().view(-1).to(torch.int32)
    values = ref.lookup_table(f"fp8_{fmt}", input.device, lambda: fp8_code_values(FP8_FORMATS[fmt]))
    scale = rows[:, row_bytes - 4 :].contiguous().view(torch.float32)
    value = values.index_select(0, codes).view(-1, row_dim) * scale
    return ref.to_output(value, output_dtype).reshape(decoded_shape(input, units, row_dim))


def fp8_code_values(spec: MiniFloat) -> torch.Tensor:
    """fp32 ``[256]``: the exact value of every FP8 code (the kernel's decode before scaling)."""
    code = torch.arange(256, dtype=torch.int32)
    mag = code & 0x7F
    value = ref.minifloat_value(mag.clamp(max=spec.max_code), spec)
    if spec.inf_code is not None:
        value = value.masked_fill(mag == spec.inf_code, torch.inf)
    value = value.masked_fill(mag > max(spec.max_code, spec.inf_code or 0), torch.nan)
    return torch.where(code >= 0x80, -value, value)


def quantize_fp8_rowwise(
    input: torch.Tensor,
    row_dim: int = 32,
    fmt: str = "e4m3",
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    nonfinite: NonFinitePolicy = "propagate",
    backend: Backend = "auto",
) -> torch.Tensor:
    """fp32 ``[N]`` (``N % row_dim == 0``) or ``[R, C]`` -> uint8 ``[N / row_dim * B]`` or ``[R, ceil(C / row_dim) *
    B]`` with ``B = ceil4(row_dim) + 4`` bytes per group; ``fmt`` is ``"e4m3"`` (forward) or ``"e5m2"`` (backward)."""
    check_float32_input(input, ndim=(1, 2))
    check_row_dim(row_dim)
    spec = check_format(fmt, FP8_FORMATS)
    check_seed(seed)
    launch_geometry(input, row_dim)  # shape check before any work
    policy = check_nonfinite_policy(nonfinite)
    resolved = resolve_backend(backend, input)
    return _quantize_fp8_op(input, row_dim, spec.name, bool(stochastic_rounding), seed_arg(seed), policy, resolved)


def dequantize_fp8_rowwise(
    input: torch.Tensor,
    row_dim: int = 32,
    fmt: str = "e4m3",
    *,
    output_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """uint8 ``[..., units * B]`` -> ``output_dtype`` ``[..., units * row_dim]`` (padding columns included)."""
    check_row_dim(row_dim)
    spec = check_format(fmt, FP8_FORMATS)
    units = check_encoded(input, fp8_row_bytes(row_dim), "FP8 rows")
    check_output_dtype(output_dtype)
    return _dequantize_fp8_op(input, row_dim, spec.name, units, output_dtype, resolve_backend(backend, input))


# --------------------------------------------------------------------------------------------------- the ops
# Bytes out / bytes in: neither op has a gradient.
@custom_op("quantize_fp8_rowwise")
def _quantize_fp8_op(
    input: torch.Tensor, row_dim: int, fmt: str, stochastic_rounding: bool, seed: int, nonfinite: str, backend: str
) -> torch.Tensor:
    if nonfinite == "raise":
        raise_if_nonfinite(input)
    seed = seed_from_arg(seed)
    if backend == "triton":
        return _quantize_fp8_triton(input, row_dim, FP8_FORMATS[fmt], stochastic_rounding, seed)
    return quantize_fp8_rowwise_reference(input, row_dim, fmt, stochastic_rounding, seed)


@_quantize_fp8_op.register_fake
def _(input, row_dim, fmt, stochastic_rounding, seed, nonfinite, backend):
    return input.new_empty(encoded_shape(input, row_dim, fp8_row_bytes(row_dim)), dtype=torch.uint8)


@custom_op("dequantize_fp8_rowwise")
def _dequantize_fp8_op(
    input: torch.Tensor, row_dim: int, fmt: str, units: int, output_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    if backend == "triton":
        return _dequantize_fp8_triton(input, row_dim, FP8_FORMATS[fmt], units, output_dtype)
    return dequantize_fp8_rowwise_reference(input, row_dim, fmt, output_dtype)


@_dequantize_fp8_op.register_fake
def _(input, row_dim, fmt, units, output_dtype, backend):
    return input.new_empty(decoded_shape(input, units, row_dim), dtype=output_dtype)
