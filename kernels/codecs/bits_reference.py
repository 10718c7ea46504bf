"""Torch twins of :mod:`.bits`: the same integer algorithms on int32/int64 tensors, vectorised, CPU or GPU.

Magnitudes, significands, exponents and codes are int32 (every value here is below 2**31); random bits (from
:mod:`tritonrec.kernels.random_bits`) are int64 tensors holding unsigned 32-bit values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tritonrec.kernels.codecs.formats import MiniFloat

ZERO_EXP = -512


def magnitude_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tensor -> (magnitude bits int32, sign bit int32 in {0, 1})."""
    bits = x.view(torch.int32)
    return bits & 0x7FFFFFFF, (bits >> 31) & 1


def split_magnitude(mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite fp32 magnitude bits (int32) -> ``(sig, e)`` with ``|x| = sig * 2**(e - 23)``; zero -> (0, ZERO_EXP)."""
    # Two fresh tensors, updated in place: every extra temporary of the input's size costs as much as the arithmetic.
    e = torch.bitwise_right_shift(mag, 23).sub_(127)
    sig = (mag & 0x7FFFFF).bitwise_or_(0x800000)
    # fp32 subnormals and zeros are rare: normalise them only when present (a min is cheaper than a mask and any()).
    if mag.numel() and int(mag.amin()) < 1 << 23:
        is_sub = mag < 1 << 23
        norm = (mag & 0x7FFFFF).to(torch.float32).view(torch.int32)
        sig = torch.where(is_sub, (norm & 0x7FFFFF) | 0x800000, sig)
        e = torch.where(is_sub, (norm >> 23) - 276, e)
        is_zero = mag == 0
        sig = sig.masked_fill(is_zero, 0)
        e = e.masked_fill(is_zero, ZERO_EXP)
    return sig, e


def round_to_quanta(sig: torch.Tensor, shift: torch.Tensor, rand: torch.Tensor | None) -> torch.Tensor:
    """``sig * 2**-shift`` rounded to an int32: nearest-even (``rand is None``) or stochastically with the low
    ``shift`` bits of ``rand`` (int64 random bits, or int32 holding at least their low 30 bits: at most 30 are
    used). Inputs are not modified; the temporaries are updated in place."""
    if shift.numel() and int(shift.amax()) > 30:  # values 2**30 quanta below their group's top: mostly zeros
        sig = sig >> (shift - 30).clamp_(0, 31)
        shift = shift.clamp(max=30)
    if rand is None:
        # (sig + 2**(shift - 1) - 1 + lowest kept bit) >> shift
        code = (sig >> shift).bitwise_and_(1).sub_(1).add_(sig)
        code += torch.ones_like(code).bitwise_left_shift_(shift - 1)
    else:
        if rand.dtype != torch.int32:
            rand = (rand & 0x3FFFFFFF).to(torch.int32)
        ones = torch.ones(torch.broadcast_shapes(sig.shape, shift.shape), dtype=torch.int32, device=sig.device)
        code = ones.bitwise_left_shift_(shift).sub_(1)
        code = (code & rand).add_(sig)
    return torch.bitwise_right_shift(code, shift, out=code)


def minifloat_code(sig: torch.Tensor, e: torch.Tensor, rand: torch.Tensor | None, fmt: MiniFloat) -> torch.Tensor:
    """Magnitude code (int32) of ``sig * 2**(e - 23)`` in ``fmt``, overflowing to ``fmt.overflow_code``."""
    e_target = e.clamp(min=fmt.emin)
    quanta = round_to_quanta(sig, (e_target - e).add_(23 - fmt.mbits), rand)
    code = e_target.add_(fmt.bias - 1).bitwise_left_shift_(fmt.mbits).add_(quanta)
    return code.clamp_(max=fmt.overflow_code)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**k`` for int32 ``k`` in [-149, 127], from bits."""
    normal = (k + 127) << 23
    subnormal = 1 << (k + 149).clamp(0, 31)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def minifloat_value(code: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Exact fp32 value of finite magnitude codes (int32)."""
    field = code >> fmt.mbits
    mantissa = code & ((1 << fmt.mbits) - 1)
    sig = torch.where(field > 0, mantissa | (1 << fmt.mbits), mantissa)
    return sig.to(torch.float32) * pow2(field.clamp(min=1) - (fmt.bias + fmt.mbits))


def row_scale_exponent(amax_mag: torch.Tensor, fmt: MiniFloat, stochastic: bool, min_exp: int) -> torch.Tensor:
    """Twin of ``bits.row_scale_exponent``: power-of-two scale exponent per row from its max magnitude bits."""
    sig, e = split_magnitude(amax_mag)
    s = e - fmt.emax + (sig > fmt.scale_sig_limit(stochastic)).to(torch.int32)
    s = s.clamp(min=min_exp)
    return s.masked_fill(amax_mag == 0, 0)


def finite_code_cap(scale_exp: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Twin of ``bits.finite_code_cap``: per-row largest magnitude code that decodes below 2**128."""
    return (((128 - scale_exp + fmt.bias) << fmt.mbits) - 1).clamp(max=fmt.max_code)


def encode_scaled_minifloat(
    mag: torch.Tensor, sign: torch.Tensor, scale_exp: torch.Tensor, rand: torch.Tensor | None, fmt: MiniFloat
) -> torch.Tensor:
    """Signed codes (int32) of the finite magnitudes ``mag`` divided by ``2**scale_exp`` (broadcast), rounded into
    ``fmt`` and capped by :func:`finite_code_cap`. The division is exact: it only moves the exponent."""
    sig, e = split_magnitude(mag)
    code = torch.minimum(minifloat_code(sig, e - scale_exp, rand, fmt), finite_code_cap(scale_exp, fmt))
    return code | (sign << fmt.sign_shift)


_CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``, from two reductions (max and min propagate NaN) instead of an elementwise mask."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def row_abs_max(groups: torch.Tensor) -> torch.Tensor:
    """``[G, 1]`` largest magnitude per row (NaN if the row holds one) from two reductions, without writing
    ``|groups|``; the sign bit is cleared so that zero rows give +0.0."""
    if groups.shape[1] == 0 or groups.shape[0] == 0:
        return groups.new_zeros((groups.shape[0], 1))
    high = torch.maximum(groups.amax(dim=1, keepdim=True), -groups.amin(dim=1, keepdim=True))
    return (high.view(torch.int32) & 0x7FFFFFFF).view(torch.float32)


def has_nan(x: torch.Tensor) -> bool:
    return x.numel() > 0 and bool(torch.isnan(x.amax()))


def cast_with_canonical_nan(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's nearest-even cast of fp32 ``v`` to ``dtype``, every NaN replaced by the canonical +NaN bits.

    torch's own NaN results differ by path (the AVX2 bf16 cast gives 0xFFFF, the scalar one 0x7FC0, CUDA 0x7FFF)
    and CPUs and GPUs propagate NaN payloads differently, so the bits are set explicitly.
    """
    cast = v if dtype == torch.float32 else v.to(dtype)
    if not has_nan(v):
        return cast
    nan = torch.tensor(_CANONICAL_NAN_BITS[dtype], dtype=_INT_VIEW[dtype], device=v.device).view(dtype)
    return torch.where(torch.isnan(v), nan, cast)


def to_output(v: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
    """fp32 decode result -> ``output_dtype`` (nearest-even, overflow to Inf, canonical NaN)."""
    return cast_with_canonical_nan(v, output_dtype)


def scale_by_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` for int32 ``k`` in [-126, 127] (broadcast): one fp32 multiply by an exact power of two, so the
    result is exact unless it falls below 2**-126 (where every codec format rounds to zero anyway)."""
    return x * ((k + 127) << 23).view(torch.float32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def lookup_table(name: str, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A small constant table (built once on CPU by ``build``) cached per device."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = build().to(device)
    return _TABLES[key]
