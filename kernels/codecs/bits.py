"""Integer bit arithmetic on fp32 patterns, as ``@triton.jit`` helpers the codec kernels inline.

Every rounding in the codecs (to FP16, BF16, FP8, E2M1) goes through these helpers instead of Triton's float casts:
the interpreter's ``.to(tl.bfloat16)`` truncates and its FP8 casts are wrong (triton 3.9), GPUs canonicalise NaNs
differently from the CPU, and only integer operations are exact everywhere. :mod:`.bits_reference` holds the torch
twin of each helper, line for line. Stochastic rounding draws its random bits from :mod:`tritonrec.kernels.random_bits`.

Conventions: fp32 magnitudes are ``uint32`` bit patterns with the sign cleared; a finite magnitude is split into a
24-bit significand ``sig`` (leading one at bit 23, fp32 subnormals normalised) and the unbiased exponent ``e`` of
that leading one, so ``|x| = sig * 2**(e - 23)``. Zero has ``sig = 0`` and ``e = ZERO_EXP``.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton

# Exponent given to zero: far below every format's smallest subnormal, so zero rounds to code 0.
ZERO_EXP = tl.constexpr(-512)


@triton.jit
def split_magnitude(mag):
    """Finite fp32 magnitude bits (uint32) -> ``(sig uint32, e int32)`` with ``|x| = sig * 2**(e - 23)``."""
    biased = (mag >> 23).to(tl.int32)
    mant = mag & 0x7FFFFF
    # An fp32 subnormal is mant * 2**-149; float(mant) is exact and normal, so its exponent locates the leading one.
    norm = mant.to(tl.float32).to(tl.uint32, bitcast=True)
    is_sub = biased == 0
    sig = tl.where(is_sub, (norm & 0x7FFFFF) | 0x800000, mant | 0x800000)
    e = tl.where(is_sub, (norm >> 23).to(tl.int32) - 276, biased - 127)
    is_zero = mag == 0
    sig = tl.where(is_zero, tl.zeros_like(sig), sig)
    e = tl.where(is_zero, tl.full(e.shape, ZERO_EXP, tl.int32), e)
    return sig, e


@triton.jit
def round_to_quanta(sig, shift, rand, STOCHASTIC: tl.constexpr):
    """``sig * 2**-shift`` (``shift >= 1``, int32) rounded to an integer, as uint32.

    Nearest-even, or (``STOCHASTIC``) up with probability equal to the dropped fraction, using the low ``shift``
    bits of ``rand``. Shifts past 30 first truncate ``sig`` to keep sums below 2**31: the value is then below 2**-6 of
    one quantum, nearest-even gives 0 either way and the stochastic bias is under 2**-30 quantum.
    """
    pre = tl.minimum(tl.maximum(shift - 30, 0), 31).to(tl.uint32)
    sig = sig >> pre
    shift_u = tl.minimum(shift, 30).to(tl.uint32)
    one = tl.full(sig.shape, 1, tl.uint32)
    if STOCHASTIC:
        rounded = (sig + (rand & ((one << shift_u) - 1))) >> shift_u
    else:
        rounded = (sig + ((one << (shift_u - 1)) - 1) + ((sig >> shift_u) & 1)) >> shift_u
    return rounded


@triton.jit
def minifloat_code(
    sig, e, rand, MBITS: tl.constexpr, BIAS: tl.constexpr, OVERFLOW_CODE: tl.constexpr, STOCHASTIC: tl.constexpr
):
    """Magnitude code (uint32, sign clear) of ``sig * 2**(e - 23)`` in a float with ``MBITS`` mantissa bits and bias
    ``BIAS``; magnitudes past the largest finite code become ``OVERFLOW_CODE`` (Inf, or the max for saturation).

    The quantum is ``2**(max(e, emin) - MBITS)``, so one formula covers normals and subnormals; a rounding carry
    into the next binade lands on the right code because the exponent field sits just above the mantissa.
    """
    e_target = tl.maximum(e, 1 - BIAS)
    shift = e_target - e + (23 - MBITS)
    quanta = round_to_quanta(sig, shift, rand, STOCHASTIC)
    code = ((e_target + (BIAS - 1)) << MBITS).to(tl.uint32) + quanta
    return tl.minimum(code, OVERFLOW_CODE)


@triton.jit
def pow2(k):
    """fp32 ``2**k`` for int32 ``k`` in [-149, 127], built from bits (exact, subnormals included)."""
    normal = ((k + 127) << 23).to(tl.uint32)
    subnormal = tl.full(k.shape, 1, tl.uint32) << tl.minimum(tl.maximum(k + 149, 0), 31).to(tl.uint32)
    return tl.where(k >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def pow2_exponent_bits(k):
    """fp32 bit pattern (uint32) of ``2**k``, k in [-149, 127]: what row scales store."""
    return pow2(k).to(tl.uint32, bitcast=True)


@triton.jit
def minifloat_value(code, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Exact fp32 value of a finite magnitude code (formats whose smallest subnormal is >= 2**-126)."""
    field = (code >> MBITS).to(tl.int32)
    mantissa = code & ((1 << MBITS) - 1)
    sig = tl.where(field > 0, mantissa | (1 << MBITS), mantissa)
    return sig.to(tl.float32) * pow2(tl.maximum(field, 1) - (BIAS + MBITS))


@triton.jit
def row_scale_exponent(amax_mag, EMAX: tl.constexpr, SIG_LIMIT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Exponent ``s`` of the power-of-two scale of a row whose largest finite magnitude has bits ``amax_mag``.

    ``amax / 2**s`` lands at exponent ``EMAX``, one binade higher when its significand passes ``SIG_LIMIT`` (it would
    round past the format's max); ``s`` is clamped below at ``MIN_EXP``. An all-zero row gets ``s = 0``.
    """
    sig, e = split_magnitude(amax_mag)
    s = e - EMAX + (sig > SIG_LIMIT).to(tl.int32)
    s = tl.maximum(s, MIN_EXP)
    return tl.where(amax_mag == 0, tl.zeros_like(s), s)


@triton.jit
def finite_code_cap(scale_exp, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """Largest magnitude code whose value times ``2**scale_exp`` stays below 2**128, i.e. decodes to a finite fp32:
    ``MAX_CODE`` except in rows whose scale is within the format's range of fp32's top."""
    return tl.minimum(((128 - scale_exp + BIAS) << MBITS) - 1, MAX_CODE).to(tl.uint32)


@triton.jit
def fp32_to_half_bits(v, MBITS: tl.constexpr, BIAS: tl.constexpr, INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr):
    """IEEE cast of fp32 ``v`` to FP16 or BF16 bits (uint32 holding 16 bits): nearest-even, overflow to Inf, every
    NaN to the canonical quiet NaN. Used for decode outputs in half precision."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    mag = bits & 0x7FFFFFFF
    is_inf = mag == 0x7F800000
    is_nan = mag > 0x7F800000
    sig, e = split_magnitude(tl.where(is_inf | is_nan, tl.zeros_like(mag), mag))
    code = minifloat_code(sig, e, mag, MBITS, BIAS, INF_CODE, False)
    code = tl.where(is_inf, tl.full(code.shape, INF_CODE, tl.uint32), code) | (sign << 15)
    return tl.where(is_nan, tl.full(code.shape, NAN_CODE, tl.uint32), code)


@triton.jit
def store_output(out_ptr, offsets, mask, v, OUT_KIND: tl.constexpr):
    """Store fp32 values ``v`` into the decode output: ``OUT_KIND`` 0 = fp32, 1 = fp16 bits, 2 = bf16 bits (the
    output tensor is passed as an int16 view for the half kinds). Every NaN is stored as the canonical +NaN."""
    if OUT_KIND == 0:
        canonical_nan = tl.full(v.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
        tl.store(out_ptr + offsets, tl.where(v != v, canonical_nan, v), mask=mask)
    elif OUT_KIND == 1:
        half = fp32_to_half_bits(v, 10, 15, 0x7C00, 0x7E00)
        tl.store(out_ptr + offsets, half.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        half = fp32_to_half_bits(v, 7, 127, 0x7F80, 0x7FC0)
        tl.store(out_ptr + offsets, half.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


_OUTPUT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def output_view(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The decode output as the kernel stores it (fp32, or an int16 view of fp16/bf16) and its ``OUT_KIND``."""
    kind = _OUTPUT_KINDS[out.dtype]
    return (out if kind == 0 else out.view(torch.int16)), kind
