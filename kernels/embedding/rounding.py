"""Rounding updated fp32 weights back into fp16 / bf16 storage, to nearest or stochastically, bit-identically in
Triton and torch.

Why integer arithmetic: under the Triton interpreter ``x.to(tl.bfloat16)`` truncates instead of rounding, and
stochastic rounding needs random bits the torch twin can reproduce. So both rules are written on the fp32 bit
pattern: to keep the top bits of a value, add a bias to the bits that will be dropped, then clear them. Round to
nearest even adds ``half - 1 + lsb``; stochastic rounding adds a uniform random integer below ``2**dropped``, which
rounds up with probability equal to the dropped fraction (so the stored value is unbiased). The cleared pattern is
exactly representable in the target dtype, so the final conversion is exact everywhere.

* bf16 shares fp32's exponent, so 16 bits are always dropped (subnormals included).
* fp16 keeps 10 mantissa bits (13 dropped) down to 2**-14; below that its subnormal spacing is 2**-24, so more bits
  are dropped. Round to nearest fp16 uses the hardware / numpy / torch conversion, which all round to nearest even;
  stochastic fp16 rounding of magnitudes below 2**-24 (fp16's smallest subnormal) also rounds to nearest.
* Infinities and NaNs pass through (NaN stays NaN).

Random bits: :func:`tritonrec.kernels.random_bits.random_bits` of the element's global index in the flat weight
buffer, in the stream of the update's seed (the kernel takes its keys, ``stream_key_args(seed)``), so every element
of every step gets an independent, reproducible draw.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.random_bits import random_bits, random_bits_reference

# Weight storage codes shared by launchers and kernels (a tl.constexpr cannot hold a torch.dtype).
WEIGHT_FP32, WEIGHT_FP16, WEIGHT_BF16 = 0, 1, 2
WEIGHT_CODES: dict[torch.dtype, int] = {
    torch.float32: WEIGHT_FP32,
    torch.float16: WEIGHT_FP16,
    torch.bfloat16: WEIGHT_BF16,
}


@triton.jit
def round_fp32_to_storage(x, element_index, k1, k2, WEIGHT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 ``x`` -> the same shape in the storage dtype (WEIGHT_FP32 / FP16 / BF16), see the module docstring.

    ``element_index`` (int64, ``x``'s shape) keys each element's draw in the stream of keys ``(k1, k2)``
    (``stream_key_args(seed)``); both are ignored unless ``STOCHASTIC``."""
    if WEIGHT_DTYPE == 0:
        return x
    elif WEIGHT_DTYPE == 1 and not STOCHASTIC:
        return x.to(tl.float16)  # compiled and interpreted conversions both round to nearest even
    else:
        bits = x.to(tl.uint32, bitcast=True)
        biased_exp = ((bits >> 23) & 0xFF).to(tl.int32)
        if WEIGHT_DTYPE == 2:
            dropped = tl.full(x.shape, 16, tl.uint32)
        else:
            extra = tl.maximum(113 - biased_exp, 0)  # 113 = biased exponent of 2**-14, fp16's smallest normal
            dropped = (13 + tl.minimum(extra, 10)).to(tl.uint32)
        low_mask = (tl.full(x.shape, 1, tl.uint32) << dropped) - 1
        if STOCHASTIC:
            bias = random_bits(element_index, k1, k2) & low_mask
        else:
            bias = (low_mask >> 1) + ((bits >> dropped) & 1)
        rounded = (bits + bias) & ~low_mask
        quieted = tl.where((bits & 0x7FFFFF) != 0, bits | 0x400000, bits)
        rounded = tl.where(biased_exp == 255, quieted, rounded)
        if WEIGHT_DTYPE == 2:
            return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            # below 2**-24 there are no bits left to randomise: round to nearest instead
            return tl.where(biased_exp < 103, x, rounded.to(tl.float32, bitcast=True)).to(tl.float16)


def round_fp32_to_storage_reference(
    x: torch.Tensor,
    dtype: torch.dtype,
    stochastic: bool = False,
    element_index: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """The specification: fp32 ``x`` -> ``dtype`` (fp32 / fp16 / bf16), to nearest even or stochastically.

    ``element_index`` (int64, broadcastable to ``x``) keys the random draw of each element; required when
    ``stochastic``.
    """
    if dtype == torch.float32:
        return x
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got dtype={dtype}")
    if dtype == torch.float16 and not stochastic:
        return x.to(torch.float16)
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    biased_exp = (bits >> 23) & 0xFF
    if dtype == torch.bfloat16:
        dropped = torch.full_like(bits, 16)
    else:
        dropped = 13 + (113 - biased_exp).clamp(min=0, max=10)
    low_mask = (torch.ones_like(bits) << dropped) - 1
    if stochastic:
        if element_index is None:
            raise ValueError("element_index is required for stochastic rounding, got element_index=None")
        bias = random_bits_reference(torch.broadcast_to(element_index, x.shape), seed) & low_mask
    else:
        bias = (low_mask >> 1) + ((bits >> dropped) & 1)
    rounded = ((bits + bias) & ~low_mask) & 0xFFFFFFFF
    quieted = torch.where((bits & 0x7FFFFF) != 0, bits | 0x400000, bits)
    rounded = torch.where(biased_exp == 255, quieted, rounded)
    if dtype == torch.bfloat16:
        return _as_signed(rounded >> 16, 16).to(torch.int16).view(torch.bfloat16).reshape(x.shape)
    as_fp32 = _as_signed(rounded, 32).to(torch.int32).view(torch.float32).reshape(x.shape)
    return torch.where(biased_exp.reshape(x.shape) < 103, x, as_fp32).to(torch.float16)


def _as_signed(unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 holding an unsigned ``bits``-wide value -> the same bits as a signed value (two's complement)."""
    return torch.where(unsigned >= 1 << (bits - 1), unsigned - (1 << bits), unsigned)


__all__ = [
    "WEIGHT_BF16",
    "WEIGHT_CODES",
    "WEIGHT_FP16",
    "WEIGHT_FP32",
    "round_fp32_to_storage",
    "round_fp32_to_storage_reference",
]
