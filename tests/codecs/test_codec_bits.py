"""The shared integer arithmetic (torch twins in bits_reference; the Triton helpers are covered through every kernel
test): format constants, exact decoding of every code, rounding to quanta, fp32 splitting, the random streams
(host formula, Triton helper against its twin, uniformity)."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.codecs import BF16, FP4_E2M1, FP8_E4M3, FP8_E5M2, FP16, derive_seed
from tritonrec.kernels.codecs import bits_reference as ref
from tritonrec.kernels.random_bits import (
    mix32_,
    mix32_int,
    mix32_int32_,
    random_bits,
    random_bits_range,
    random_bits_range_int32,
    random_bits_reference,
    stream_key_args,
    stream_keys,
)

TORCH_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("spec", [FP16, BF16, FP8_E4M3, FP8_E5M2], ids=lambda s: s.name)
def test_format_constants_match_torch(spec):
    dtype = TORCH_TYPES[spec.name]
    assert spec.max_value == torch.finfo(dtype).max
    assert spec.emax == int(torch.log2(torch.tensor(torch.finfo(dtype).max)).floor())
    max_bits = torch.tensor(spec.max_value).view(torch.int32).item()
    assert spec.max_value_bits == max_bits
    assert (
        torch.tensor([spec.max_code], dtype=torch.int32)
        .to(torch.int16 if spec.ebits + spec.mbits == 15 else torch.uint8)
        .view(dtype)
        .item()
        == spec.max_value
    )


def test_e2m1_constants():
    assert FP4_E2M1.max_value == 6.0 and FP4_E2M1.emax == 2 and FP4_E2M1.emin == 0


@pytest.mark.parametrize("spec", [FP8_E4M3, FP8_E5M2, FP16], ids=lambda s: s.name)
def test_minifloat_value_of_every_finite_code(spec):
    codes = torch.arange(1 << (spec.ebits + spec.mbits), dtype=torch.int32)
    finite = codes <= spec.max_code
    storage = torch.int16 if spec.name == "fp16" else torch.uint8
    expected = codes.to(storage).view(TORCH_TYPES[spec.name]).to(torch.float32)
    assert torch.equal(ref.minifloat_value(codes[finite], spec), expected[finite])


def test_e2m1_values():
    assert ref.minifloat_value(torch.arange(8, dtype=torch.int32), FP4_E2M1).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_round_to_quanta_nearest_even_and_unbiased_stochastic():
    """Exhaustive over small significands and shifts: nearest-even equals torch.round (half to even), and the mean of
    stochastic rounding over every value of the random low bits is exactly sig / 2**shift."""
    for shift in range(1, 7):
        sig = torch.arange(1 << 9, dtype=torch.int32)
        shifts = torch.full_like(sig, shift)
        exact = sig.double() / 2**shift
        assert torch.equal(ref.round_to_quanta(sig, shifts, None).double(), torch.round(exact))
        rand = torch.arange(1 << shift, dtype=torch.int64)[:, None].expand(-1, sig.numel())
        rounded = ref.round_to_quanta(sig[None, :].expand_as(rand), shifts[None, :].expand_as(rand), rand).double()
        assert bool(((rounded == exact.floor()) | (rounded == exact.ceil())).all())  # a neighbour, never farther
        assert torch.equal(rounded.mean(0), exact)


def test_round_to_quanta_long_shifts():
    sig = torch.tensor([0xFFFFFF, 0x800000, 0x800000, 0xC00000], dtype=torch.int32)
    shift = torch.tensor([40, 24, 25, 24], dtype=torch.int32)
    # 2**24 - 1 >> 40 is far below half: 0; 0.5 ties to even 0; 0.25 -> 0; 0.75 -> 1
    assert ref.round_to_quanta(sig, shift, None).tolist() == [0, 0, 0, 1]


def test_split_magnitude_is_exact_for_every_binade():
    generator = torch.Generator().manual_seed(0)
    mag = torch.randint(0, 0x7F800000, (1 << 16,), dtype=torch.int32, generator=generator)
    mag = torch.cat([mag, torch.tensor([0, 1, 2, 3, 0x7FFFFF, 0x800000, 0x7F7FFFFF], dtype=torch.int32)])
    sig, e = ref.split_magnitude(mag)
    value = mag.view(torch.float32).double()
    nonzero = mag != 0
    assert torch.equal(sig[nonzero].double() * torch.pow(2.0, (e[nonzero] - 23).double()), value[nonzero])
    assert bool(((sig[nonzero] >> 23) == 1).all())  # normalised, subnormals included
    assert int(sig[~nonzero].abs().sum()) == 0


def test_pow2_is_exact_over_the_fp32_range():
    k = torch.arange(-149, 128, dtype=torch.int32)
    assert torch.equal(ref.pow2(k).double(), torch.pow(2.0, k.double()))


def test_random_streams_match_the_host_formula_and_high_words():
    seed = 123456789
    k1, k2 = stream_keys(seed)
    index = torch.tensor([0, 1, 2, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3], dtype=torch.int64)
    expected = [mix32_int((int(i) & 0xFFFFFFFF) ^ k1 ^ mix32_int((int(i) >> 32) + k2)) for i in index]
    assert random_bits_reference(index.clone(), seed).tolist() == expected
    assert torch.equal(
        random_bits_range(1000, seed, torch.device("cpu")), random_bits_reference(torch.arange(1000), seed)
    )


@triton.jit
def _random_bits_kernel(index_ptr, out_ptr, k1, k2, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    bits = random_bits(tl.load(index_ptr + i, mask=ok, other=0), k1, k2)
    tl.store(out_ptr + i, bits.to(tl.int64), mask=ok)


def test_triton_random_bits_match_the_twin_for_keys_of_either_sign():
    index = torch.tensor([0, 1, 77, 2**31 + 3, 2**32 - 1, 2**32, 2**40 + 3, 2**62 + 9], dtype=torch.int64)
    # kernels take the keys as int32 values: cover both signs of each key
    seeds = {(k1 < 0, k2 < 0): s for s in range(64) for k1, k2 in [stream_key_args(s)]}
    assert len(seeds) == 4
    for seed in seeds.values():
        out = torch.empty_like(index)
        _random_bits_kernel[(1,)](index, out, *stream_key_args(seed), index.numel(), BLOCK=8)
        assert torch.equal(out, random_bits_reference(index, seed)), seed


def test_random_bits_look_uniform():
    bits = random_bits_range(1 << 16, seed=3, device=torch.device("cpu"))
    for shift in (0, 8, 16, 24):  # every byte of the word: chi-square with 255 degrees of freedom
        counts = torch.bincount((bits >> shift) & 0xFF, minlength=256).double()
        chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
        assert chi2 < 360, (shift, chi2)  # p ~ 1e-5
    neighbours = torch.corrcoef(torch.stack([bits[:-1].double(), bits[1:].double()]))[0, 1]
    assert abs(float(neighbours)) < 0.02


def test_streams_differ_by_seed_and_derive_seed_mixes_every_part():
    a = random_bits_range(64, 1, torch.device("cpu"))
    assert not torch.equal(a, random_bits_range(64, 2, torch.device("cpu")))
    seeds = {derive_seed(base, call) for base in range(8) for call in range(64)}
    assert len(seeds) == 8 * 64 and derive_seed(5, 7) == derive_seed(5, 7)
    assert derive_seed(5, 7) != derive_seed(7, 5) and all(0 <= s < 2**63 for s in seeds)


def test_cast_with_canonical_nan_overrides_torch_nan_bits():
    x = torch.tensor([float("nan"), -float("nan"), 1.0] * 40)
    assert (ref.cast_with_canonical_nan(x, torch.bfloat16).view(torch.int16)[:2] == 0x7FC0).all()
    assert (ref.cast_with_canonical_nan(x, torch.float16).view(torch.int16)[:2] == 0x7E00).all()
    assert (ref.cast_with_canonical_nan(-x, torch.float32).view(torch.int32)[:2] == 0x7FC00000).all()


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5, 2**63 + 11])
def test_int32_random_bits_hold_the_same_words_as_the_int64_twin(seed):
    """The codec twins draw in int32 (CPU-vectorised); every word must equal the int64 twin's, bit for bit."""
    wide = random_bits_range(5000, seed, torch.device("cpu"))
    narrow = random_bits_range_int32(5000, seed, torch.device("cpu"))
    assert narrow.dtype == torch.int32
    assert torch.equal(narrow.to(torch.int64) & 0xFFFFFFFF, wide)
    words = torch.tensor([0, 1, 0x7FFFFFFF, -0x80000000, -1, 0x12345678], dtype=torch.int32)
    assert torch.equal(
        mix32_int32_(words.clone()).to(torch.int64) & 0xFFFFFFFF, mix32_(words.to(torch.int64) & 0xFFFFFFFF)
    )
