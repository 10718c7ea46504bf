"""Counter-based random bits for stochastic rounding: one uint32 draw per (seed, element index), computed bit for bit
the same by the Triton helpers here and their torch twins, on any device, in any launch order.

Used by the comm codecs (:mod:`tritonrec.kernels.codecs`) and by the fused embedding update's fp16/bf16 weight
rounding (:mod:`tritonrec.kernels.embedding.rounding`); neither package owns it.

Algorithm. A seed (any non-negative int below 2**64) is hashed on the host into two 32-bit stream keys
(:func:`stream_keys`)::

    k1 = mix32(mix32(lo32(seed)) ^ hi32(seed) ^ 0x9E3779B9)
    k2 = mix32(k1 ^ 0x85EBCA6B)

and element ``i`` (int64) of the stream draws ``mix32(lo32(i) ^ k1 ^ mix32(hi32(i) + k2))``. Below 2**32 elements
the inner hash is one constant per stream, so a draw costs a single ``mix32``. ``mix32`` is an xorshift-multiply
avalanche hash (shifts 16 / 15 / 15, multipliers ``0x21F0AAAD`` / ``0x735A2D97``, a result of C. Wellons'
hash-prospector search); it is a bijection on 32 bits, so distinct indices below 2**32 never share a draw.

Why integers only: the draws must be identical in compiled Triton, the Triton interpreter and torch on CPU and GPU,
and only integer operations are exact everywhere (no fp contraction, no approximate transcendental functions).

Why both multipliers are below 2**31: torch has no uint32 arithmetic, so the twins hold uint32 values in int64
tensors and multiply there; a value below 2**32 times a constant below 2**31 stays below 2**63, so every int64
product is exact and masking it to 32 bits gives the uint32 wrap-around product the kernels compute. (MurmurHash3's
finaliser, ``0x85EBCA6B`` / ``0xC2B2AE35``, which the embedding rounding used before, has a multiplier above 2**31:
its int64 products overflow, and the twin relied on int64 wrap-around to get the low 32 bits right.)

Why the seed is hashed into keys instead of mixed into each draw: every stream below 2**32 elements is the same
bijection applied to ``i ^ k1 ^ c``, i.e. two seeds' streams are the same values at xor-shifted positions. Hashing
the seed makes that shift pseudo-random even for neighbouring seeds (0, 1, 2, ...) and lets callers pass raw
counters; all 64 bits of the seed count.

The codec twins draw through :func:`random_bits_range_int32`: the same uint32 bits held in int32 tensors, hashed
with :func:`mix32_int32_`. int32 is what CPUs vectorise (torch's int64 ``>>`` and ``arange`` are scalar loops, about
15x slower than the int32 ones); torch's int32 multiply wraps modulo 2**32 like the kernels' uint32 one, and the
arithmetic ``>>`` is made logical by masking off the copied sign bits.

Kernel arguments: pass :func:`stream_key_args` (the keys as signed int32 values), not :func:`stream_keys`. Triton
types a Python int argument as i32 below 2**31 and u32 above, so raw keys would compile up to four variants of
every kernel depending on the seed; ``random_bits`` reinterprets either type as uint32 bits.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton

_MASK32 = 0xFFFFFFFF


@triton.jit
def mix32(x):
    """32-bit avalanche hash of a uint32 tensor (wrapping multiplies); see the module docstring."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def random_bits(index, k1, k2):
    """uint32 random bits, same shape as the int64 element indices ``index``, in the stream keyed by scalars
    ``(k1, k2)`` (from :func:`stream_key_args`): ``mix32(lo32(index) ^ k1 ^ mix32(hi32(index) + k2))``."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return mix32(lo ^ k1.to(tl.uint32) ^ mix32(hi + k2.to(tl.uint32)))


def mix32_int(x: int) -> int:
    """:func:`mix32` of a Python int's low 32 bits (host side: stream keys, seed derivation)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK32
    x ^= x >> 15
    return x


def stream_keys(seed: int) -> tuple[int, int]:
    """The two uint32 keys (Python ints in [0, 2**32)) of the random stream of ``seed`` (int in [0, 2**64))."""
    k1 = mix32_int(mix32_int(seed & _MASK32) ^ ((seed >> 32) & _MASK32) ^ 0x9E3779B9)
    k2 = mix32_int(k1 ^ 0x85EBCA6B)
    return k1, k2


def stream_key_args(seed: int) -> tuple[int, int]:
    """:func:`stream_keys` as signed int32 values with the same bits: what kernels take, so that every launch has
    the same argument types whatever the seed."""
    k1, k2 = stream_keys(seed)
    return _as_int32(k1), _as_int32(k2)


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`mix32`, in place on an int64 tensor holding values in [0, 2**32); returns ``x``."""
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def _as_int32(k: int) -> int:
    """A uint32 Python int as the int32 value with the same bits."""
    return k - (1 << 32) if k >= 1 << 31 else k


def mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`mix32`, in place on an int32 tensor holding uint32 bits (two's complement); returns ``x``.

    Bit for bit :func:`mix32_` on the same bits: int32 multiplies wrap modulo 2**32, and the masks turn torch's
    arithmetic shifts into the kernels' logical ones. One scratch tensor serves every shift."""
    tmp = torch.bitwise_right_shift(x, 16)
    x ^= tmp.bitwise_and_(0xFFFF)
    x.mul_(0x21F0AAAD)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp).bitwise_and_(0x1FFFF)
    x.mul_(0x735A2D97)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp).bitwise_and_(0x1FFFF)
    return x


def random_bits_reference(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Twin of :func:`random_bits`: int64 element indices (any shape, >= 0; not modified) -> int64 tensor of the
    same shape holding the uint32 draws in [0, 2**32)."""
    k1, k2 = stream_keys(seed)
    high = mix32_((index >> 32).add_(k2).bitwise_and_(_MASK32))
    return mix32_((index & _MASK32).bitwise_xor_(high).bitwise_xor_(k1))


def random_bits_range(num_elements: int, seed: int, device: torch.device) -> torch.Tensor:
    """``[num_elements]`` int64 draws of elements ``0 .. num_elements - 1``: :func:`random_bits_reference` of an
    arange, computing the high word's hash once when every index is below 2**32."""
    index = torch.arange(num_elements, device=device, dtype=torch.int64)
    if num_elements > 1 << 32:
        return random_bits_reference(index, seed)
    k1, k2 = stream_keys(seed)
    return mix32_(index.bitwise_xor_(k1 ^ mix32_int(k2)))


def random_bits_range_int32(num_elements: int, seed: int, device: torch.device) -> torch.Tensor:
    """:func:`random_bits_range` as an int32 tensor with the same 32 bits per draw (negative where bit 31 is set),
    computed in int32 below 2**31 elements (``mix32`` of ``index ^ key`` for one key per stream)."""
    if num_elements >= 1 << 31:
        wide = random_bits_range(num_elements, seed, device)
        return (wide - ((wide & 0x80000000) << 1)).to(torch.int32)
    k1, k2 = stream_keys(seed)
    index = torch.arange(num_elements, device=device, dtype=torch.int32)
    return mix32_int32_(index.bitwise_xor_(_as_int32(k1 ^ mix32_int(k2))))


__all__ = [
    "mix32",
    "mix32_",
    "mix32_int",
    "mix32_int32_",
    "random_bits",
    "random_bits_range",
    "random_bits_range_int32",
    "random_bits_reference",
    "stream_key_args",
    "stream_keys",
]
