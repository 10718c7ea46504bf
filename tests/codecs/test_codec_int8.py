"""INT8 row-wise codec specifics: layout and rounding rule, constant/zero rows, the fast path against the
floor-and-fraction rule, NaN poisoning, and FBGEMM as an oracle where installed."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels.codecs import dequantize_int8_rowwise, quantize_int8_rowwise
from tritonrec.kernels.codecs.int8_rowwise import _round_codes
from tritonrec.kernels.codecs.rowwise import padded_groups


def split_rows(encoded: torch.Tensor, row_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = encoded.reshape(-1, (row_dim + 3) // 4 * 4 + 8)
    meta = rows[:, -8:].contiguous().view(torch.float32)
    return rows[:, :row_dim], meta[:, 0], meta[:, 1]


def test_layout_and_round_half_even():
    # min 0, max 255 -> scale 1: the codes are x rounded half to even; ties 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 254.5, 255.0, 3.49]])
    encoded = quantize_int8_rowwise(x, 7, backend="torch")
    assert encoded.shape == (1, 16)
    codes, scale, bias = split_rows(encoded, 7)
    assert codes.tolist() == [[0, 0, 2, 2, 254, 255, 3]]
    assert encoded[0, 7].item() == 0  # padding byte
    assert scale.tolist() == [1.0] and bias.tolist() == [0.0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_constant_and_zero_rows_decode_exactly(backend):
    x = torch.tensor([[3.25] * 8, [0.0] * 8, [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0], [-7e-42] * 8])
    encoded = quantize_int8_rowwise(x, 8, backend=backend)
    _, scale, bias = split_rows(encoded, 8)
    assert scale.tolist() == [0.0] * 4
    assert torch.equal(bias[2:3].view(torch.int32), torch.zeros(1, dtype=torch.int32))  # +0.0 whatever the input
    assert torch.equal(dequantize_int8_rowwise(encoded, 8, backend=backend).abs(), x.abs())


@pytest.mark.parametrize("magnitude", [1e-42, 1e-38, 1.0, 1e36, 1e38])
def test_fast_path_equals_floor_and_fraction_rule(magnitude, values, same_bits):
    x = (values((64, 32), seed=5, finite=True, scale=1.0) * magnitude).clamp(-1.6e38, 1.6e38)
    groups = padded_groups(x, 32)
    low = groups.amin(1, keepdim=True) + 0.0
    span = groups.amax(1, keepdim=True) + 0.0 - low
    scale = span / 255.0
    has_scale = scale > 0
    codes = _round_codes(groups, low, torch.where(has_scale, scale, 1.0), has_scale, torch.zeros_like(has_scale), None)
    same_bits(split_rows(quantize_int8_rowwise(x, 32, backend="torch"), 32)[0], codes)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_error_is_at_most_half_a_step(backend):
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(0)) * 5
    decoded = dequantize_int8_rowwise(quantize_int8_rowwise(x, 32, backend=backend), 32, backend=backend)
    step = (x.amax(1) - x.amin(1)) / 255
    assert bool(((decoded - x).abs() <= step[:, None] * (0.5 + 1e-4)).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_and_overflowing_rows_decode_as_nan(backend):
    x = torch.randn(4, 16)
    x[1, 2] = float("nan")
    x[2, 9] = float("inf")
    x[3, 0], x[3, 1] = 3e38, -3e38  # finite, but max - min overflows fp32
    encoded = quantize_int8_rowwise(x, 16, backend=backend)
    codes, scale, bias = split_rows(encoded, 16)
    assert bool(scale[1:].isnan().all()) and bool(bias[1:].isnan().all()) and int(codes[1:].sum()) == 0
    decoded = dequantize_int8_rowwise(encoded, 16, backend=backend)
    assert bool(decoded[1:].isnan().all()) and bool(decoded[0].isfinite().all())
    with pytest.raises(ValueError, match="input group 0 .*spans more than fp32's range"):
        quantize_int8_rowwise(x[3:], 16, nonfinite="raise")


def test_fbgemm_oracle():
    """FBGEMM's fused 8-bit row-wise ops use the same layout: they decode our bytes (up to their fused multiply-add)
    and, on random rows, encode the same bytes."""
    pytest.importorskip("fbgemm_gpu")
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
    ours = quantize_int8_rowwise(x, 32, backend="torch")
    assert torch.equal(ours, torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x))
    theirs = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(ours)
    torch.testing.assert_close(theirs, dequantize_int8_rowwise(ours, 32, backend="torch"), rtol=0, atol=1e-6)
