"""MX4 codec specifics: OCP layout and rounding, the twin's lookup table against the integer algorithm, the shared
exponent rule, NaN groups, and FBGEMM as an oracle where installed."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels.codecs import FP4_E2M1, dequantize_mx4, quantize_mx4
from tritonrec.kernels.codecs import bits_reference as ref
from tritonrec.kernels.codecs.mx4 import _e2m1_code_table, _e2m1_pair_values, _encode_e2m1_bits, _pack
from tritonrec.kernels.codecs.rowwise import padded_groups


def test_layout_nibbles_then_exponent():
    x = torch.tensor([1.0, -0.5, 6.0, 0.0, 3.0, -4.0, 1.5, 2.0])  # amax 6 -> shared exponent 0
    encoded = quantize_mx4(x, 8, backend="torch")
    assert encoded.tolist() == [0x2 | (0x9 << 4), 0x7 | (0x0 << 4), 0x5 | (0xE << 4), 0x3 | (0x4 << 4), 127]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ties_round_to_even(backend):
    """Halfway values go to the even code (FBGEMM rounds them away from zero); a max of 7 bumps the exponent."""
    x = torch.tensor([[5.0, 2.5, 1.25, 0.25, 0.75, 1.75, -5.0, 6.0], [7.0, 6.5, 3.5, 1.75, 0.25, 0.75, 5.0, -7.0]])
    decoded = dequantize_mx4(quantize_mx4(x, 8, backend=backend), 8, backend=backend)
    assert decoded[0].tolist() == [4.0, 2.0, 1.0, 0.0, 1.0, 2.0, -4.0, 6.0]
    assert decoded[1].tolist() == [8.0, 6.0, 4.0, 2.0, 0.0, 1.0, 4.0, -8.0]


def test_lookup_tables_equal_the_integer_algorithm():
    """The twin's encode table is keyed by sign, exponent, top three mantissa bits and a sticky bit: any low bits
    behind a key must round the same way. Its decode table holds the exact values of both nibbles of every byte."""
    key = torch.arange(8192, dtype=torch.int32)
    table = _e2m1_code_table().to(torch.int32)
    for low_bits in (1, 0x80000, 0xFFFFF):
        magnitude = (((key >> 1) & 0x7FF) << 20) | ((key & 1) * low_bits)
        below_8 = magnitude.view(torch.float32) < 8  # the table only serves scaled values below 8
        expected = _encode_e2m1_bits(magnitude, torch.zeros_like(key), None) | ((key >> 12) << 3)
        assert torch.equal(table[below_8], expected[below_8])
    pairs = _e2m1_pair_values()
    assert pairs[0x7A].tolist() == [-1.0, 6.0] and pairs[0x80].tolist() == [0.0, -0.0]


@pytest.mark.parametrize("magnitude", [1e-40, 1e-30, 1.0, 1e30, 3.4e38])
def test_fast_path_equals_integer_algorithm(magnitude, values, same_bits):
    x = (values((64, 32), seed=4, finite=True, scale=1.0) * magnitude).nan_to_num(posinf=3e38, neginf=-3e38)
    groups = padded_groups(x, 32)
    mag = groups.view(torch.int32) & 0x7FFFFFFF
    amax = mag.amax(1, keepdim=True)
    scale_exp = ref.row_scale_exponent(amax, FP4_E2M1, False, -127)
    code = _encode_e2m1_bits(mag, scale_exp, None) | (((groups.view(torch.int32) >> 31) & 1) << 3)
    same_bits(quantize_mx4(x, 32, backend="torch"), _pack(x, 32, code, scale_exp + 127))


@pytest.mark.parametrize("stochastic", [False, True])
def test_shared_exponent_is_smallest_without_saturation(stochastic):
    maxima = torch.tensor([1.5, 1.5000001, 1.7499999, 1.75, 1.0, 1.9999999]) * 2.0**5
    x = torch.stack([torch.linspace(-1, 1, 32) * m for m in maxima])
    exponent = quantize_mx4(x, 32, stochastic_rounding=stochastic, backend="torch").reshape(6, 17)[:, 16].long() - 127
    # amax / 2**e lies in [4, 6] (stochastic) or [4, 7) (nearest-even, which rounds it to at most 6), else [2, 4)
    scaled = maxima / 2.0**3
    expected = torch.where(scaled <= 6.0 if stochastic else scaled < 7.0, 3, 4)
    assert exponent.tolist() == expected.tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_poisons_the_group_as_nan(backend):
    x = torch.randn(3, 32)
    x[1, 5] = float("nan")
    x[2, 0] = float("-inf")
    encoded = quantize_mx4(x, 32, backend=backend).reshape(3, 17)
    assert encoded[1:, 16].tolist() == [0xFF, 0xFF]
    decoded = dequantize_mx4(encoded.reshape(-1), 32, backend=backend).reshape(3, 32)
    assert bool(decoded[1:].isnan().all()) and bool(decoded[0].isfinite().all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extreme_groups(backend):
    x = torch.tensor([[3.4028235e38, -3e38, 1.0, 0.0], [1e-45, -1e-44, 0.0, 0.0], [0.0, -0.0, 0.0, 0.0]])
    decoded = dequantize_mx4(quantize_mx4(x, 4, backend=backend), 4, backend=backend)
    assert bool(decoded.isfinite().all())  # codes of the top group are capped below 2**128
    assert bool(((decoded[0] - x[0]).abs() <= x[0].abs().max() / 2).all())
    # E8M0's smallest scale is 2**-127: a group whose max is below 2**-129 flushes to signed zeros
    assert torch.equal(decoded[1:], torch.zeros(2, 4)) and torch.equal(torch.signbit(decoded[1:]), torch.signbit(x[1:]))


def test_fbgemm_oracle_bytes_and_decode():
    """FBGEMM's MX4 ("even" mode) writes the same bytes on random data (ties, where it rounds away from zero, are
    measure-zero there) and decodes our bytes to our values."""
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.quantize_utils import fp32_to_mx4, mx4_to_fp32
    from fbgemm_gpu.triton.common import RoundingMode

    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    ours = quantize_mx4(x, 32, backend="torch")
    assert torch.equal(ours, fp32_to_mx4(x, 32, rounding_mode=RoundingMode.even))
    assert torch.equal(mx4_to_fp32(ours, 32), dequantize_mx4(ours, 32, backend="torch"))
