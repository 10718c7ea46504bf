"""FP8 row-wise codec specifics: torch's float8 types as an independent oracle, the twin's fast path against the
integer algorithm, the power-of-two scale rule, and the non-finite policy."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels.codecs import FP8_E4M3, FP8_E5M2, dequantize_fp8_rowwise, quantize_fp8_rowwise
from tritonrec.kernels.codecs.fp8_rowwise import _encode_fp8_bits
from tritonrec.kernels.codecs.rowwise import padded_groups

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SPECS = {"e4m3": FP8_E4M3, "e5m2": FP8_E5M2}


def split_rows(encoded: torch.Tensor, row_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = encoded.reshape(-1, (row_dim + 3) // 4 * 4 + 4)
    return rows[:, :row_dim], rows[:, -4:].contiguous().view(torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_integer_rounding_matches_torch_float8_cast(fmt, values, same_bits):
    """The kernel's integer algorithm (twin form) against torch's own float8 conversion of the scaled values."""
    x = values((512, 32), seed=1, finite=True, scale=3.0).clamp(-1e38, 1e38)  # rows near fp32's max are capped
    codes, scale_exp = _encode_fp8_bits(x, SPECS[fmt], None)
    scaled = x * torch.pow(2.0, -scale_exp.double()).float()
    same_bits(codes, scaled.to(TORCH_FP8[fmt]).view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude", [1e-42, 1e-39, 1e-20, 1.0, 1e30, 3e38])
def test_fast_path_equals_integer_algorithm(fmt, magnitude, values, same_bits):
    x = (values((64, 16), seed=2, finite=True, scale=1.0) * magnitude).nan_to_num(posinf=3e38, neginf=-3e38)
    codes, scale_exp = _encode_fp8_bits(padded_groups(x, 16), SPECS[fmt], None)
    encoded_codes, scale = split_rows(quantize_fp8_rowwise(x, 16, fmt, backend="torch"), 16)
    same_bits(encoded_codes, codes)
    same_bits(scale, torch.pow(2.0, scale_exp.double()).float())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_scale_is_the_smallest_power_of_two_without_saturation(fmt, stochastic):
    """Row maxima just below / at / above the bump threshold: no value saturates, and halving the scale would."""
    spec = SPECS[fmt]
    limit = spec.scale_sig_limit(stochastic) / 2**23
    maxima = torch.tensor([limit * (1 - 2**-20), limit, limit * (1 + 2**-20), 1.0, 1.5, 1.9999999])
    x = torch.stack([torch.linspace(-1, 1, 32) * m for m in maxima]) * 2.0**-3
    _, scale = split_rows(quantize_fp8_rowwise(x, 32, fmt, stochastic_rounding=stochastic, backend="torch"), 32)
    amax = x.abs().amax(1)
    tolerance = 0.0 if stochastic else 2.0 ** (spec.emax - spec.mbits - 1)  # nearest-even may round up to max
    assert bool((amax / scale.flatten() <= spec.max_value + tolerance).all())
    assert bool((amax / (scale.flatten() / 2) > spec.max_value + tolerance).all())
    decoded = dequantize_fp8_rowwise(quantize_fp8_rowwise(x, 32, fmt, backend="torch"), 32, fmt)
    assert bool(((decoded - x).abs() <= x.abs() * 2.0 ** -(spec.mbits + 1) + 1e-30).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_policy(backend):
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 2.0, -1.0, 0.5, 0.0, 1.0]])
    for fmt, inf_decodes_to in (("e5m2", float("inf")), ("e4m3", float("nan"))):
        encoded = quantize_fp8_rowwise(x, 8, fmt, backend=backend)
        decoded = dequantize_fp8_rowwise(encoded, 8, fmt, backend=backend)[0]
        assert torch.isnan(decoded[0])
        if inf_decodes_to == float("inf"):
            assert decoded[1] == float("inf") and decoded[2] == float("-inf")
        else:
            assert torch.isnan(decoded[1]) and torch.isnan(decoded[2])
        # the scale comes from the finite values, which decode exactly here
        assert torch.equal(decoded[3:], x[0, 3:])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_denormal_and_extreme_rows_round_trip(fmt, backend):
    x = torch.tensor(
        [
            [1e-45, -3e-45, 1e-44, 0.0],
            [3.4028235e38, -1e38, 2.0, 0.0],
            [-3.4e38, 3.3e38, 0.0, 1.0],
            [1e-38, 2e-38, -3e-38, 4e-38],
        ]
    )
    decoded = dequantize_fp8_rowwise(quantize_fp8_rowwise(x, 4, fmt, backend=backend), 4, fmt, backend=backend)
    assert torch.equal(decoded[0], torch.tensor([1.4e-45, -2.8e-45, 9.8e-45, 0.0]))  # exact multiples of 2**-149
    # rows at fp32's top stay finite (their codes are capped below 2**128) and within one step of the row max
    assert bool(decoded.isfinite().all())
    assert bool(((decoded - x).abs() <= x.abs().amax(1, keepdim=True) / 8).all())


def test_layout_codes_padding_then_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0, 3.0]])
    encoded = quantize_fp8_rowwise(x, 5, "e4m3", backend="torch")
    assert encoded.shape == (1, 12)
    assert encoded[0, :5].tolist() == x[0].to(torch.float8_e4m3fn).view(torch.uint8).tolist()  # scale 2**0
    assert encoded[0, 5:8].tolist() == [0, 0, 0]
    assert encoded[0, 8:].tolist() == list(torch.tensor([1.0]).view(torch.uint8).tolist())
