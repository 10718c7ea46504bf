"""Quality of every format on fixed seeds: SQNR goals on N(0,1) at no more bits per value than FBGEMM, and
unbiased stochastic rounding (4096 independent draws per value, vectorised as 4096 copies in one tensor: each
position draws its own random bits)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tritonrec.kernels.codecs import (
    dequantize_fp8_rowwise,
    dequantize_half,
    dequantize_int8_rowwise,
    dequantize_mx4,
    quantize_fp8_rowwise,
    quantize_half,
    quantize_int8_rowwise,
    quantize_mx4,
)

Roundtrip = Callable[[torch.Tensor, bool], torch.Tensor]
TWIN = {"backend": "torch"}  # the kernels equal the twins byte for byte (test_codec_*_kernels); this is about numbers


def _half(fmt: str) -> Roundtrip:
    return lambda x, sr: dequantize_half(quantize_half(x, fmt, stochastic_rounding=sr, **TWIN), **TWIN)


def _fp8(x: torch.Tensor, sr: bool) -> torch.Tensor:
    return dequantize_fp8_rowwise(
        quantize_fp8_rowwise(x, 32, "e4m3", stochastic_rounding=sr, **TWIN), 32, "e4m3", **TWIN
    )


def _int8(x: torch.Tensor, sr: bool) -> torch.Tensor:
    return dequantize_int8_rowwise(quantize_int8_rowwise(x, 32, stochastic_rounding=sr, **TWIN), 32, **TWIN)


def _mx4(x: torch.Tensor, sr: bool) -> torch.Tensor:
    return dequantize_mx4(quantize_mx4(x, 32, stochastic_rounding=sr, **TWIN), 32, **TWIN)


# name -> (round trip of a [rows, 32] fp32 tensor (stochastic?), SQNR goal on N(0,1) in dB, FBGEMM's bits per value)
FORMATS: dict[str, tuple[Roundtrip, float, float]] = {
    "fp16": (_half("fp16"), 73.0, 16.0),
    "bf16": (_half("bf16"), 55.0, 16.0),
    "int8": (_int8, 46.5, 10.0),
    "fp8_e4m3": (_fp8, 31.0, 10.0),
    "mx4": (_mx4, 19.0, 4.25),
}
ENCODED_BYTES = {
    "fp16": lambda x: quantize_half(x, "fp16", **TWIN).numel() * 2,
    "bf16": lambda x: quantize_half(x, "bf16", **TWIN).numel() * 2,
    "int8": lambda x: quantize_int8_rowwise(x, 32, **TWIN).numel(),
    "fp8_e4m3": lambda x: quantize_fp8_rowwise(x, 32, **TWIN).numel(),
    "mx4": lambda x: quantize_mx4(x, 32, **TWIN).numel(),
}


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - y) ** 2).sum()))


@pytest.mark.parametrize("name", list(FORMATS))
def test_sqnr_goal_on_standard_normal(name):
    roundtrip, goal, fbgemm_bits = FORMATS[name]
    x = torch.randn(1 << 11, 32, generator=torch.Generator().manual_seed(0))
    assert sqnr_db(x, roundtrip(x, False)) >= goal
    assert ENCODED_BYTES[name](x) * 8 / x.numel() <= fbgemm_bits


def test_fp8_keeps_its_sqnr_on_heavy_tails():
    """Row-scaled floats are scale invariant: student-t (df=3) data loses under 1 dB against N(0,1)."""
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((1 << 11, 32))
    assert sqnr_db(x, FORMATS["fp8_e4m3"][0](x, False)) >= 30.5


@pytest.mark.parametrize("name", list(FORMATS))
def test_stochastic_rounding_is_unbiased(name):
    roundtrip = FORMATS[name][0]
    draws = 4096
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)) * (100.0 if name in ("fp16", "bf16") else 1.0)
    copies = x.repeat(draws, 1)  # every copy's rows get the same scale; each position draws its own bits
    error = (roundtrip(copies, True).double() - copies.double()).view(draws, -1)
    mean, std = error.mean(0), error.std(0)
    # Values on the grid never move; their error is the decode arithmetic's rounding (INT8's code * scale + bias).
    exact = std == 0
    assert bool((mean[exact].abs() <= 4 * torch.finfo(torch.float32).eps * x.double().view(-1)[exact].abs()).all())
    z = mean[~exact] / (std[~exact] / math.sqrt(draws))
    assert float(z.abs().max()) < 5.0, float(z.abs().max())
    relative = (error / x.double().view(1, -1).abs()).flatten()
    assert abs(float(relative.mean())) < 5 * float(relative.std()) / math.sqrt(relative.numel())
    # The same statistic flags nearest-even rounding, whose error is the same in every copy.
    nearest = (roundtrip(copies, False).double() - copies.double()).view(draws, -1)[0]
    assert bool((nearest[~exact].abs() > 0).any())
