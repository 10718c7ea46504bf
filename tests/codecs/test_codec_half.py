"""FP16 / BF16 codec: kernel vs twin bytes, the twin's torch casts vs the integer algorithm, loss scale, non-finite
policy and input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.kernels.codecs import dequantize_half, quantize_half
from tritonrec.kernels.codecs.formats import HALF_FORMATS
from tritonrec.kernels.codecs.half import _quantize_half_bits

FORMATS = ["fp16", "bf16"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("loss_scale", [None, 3.7, 1024.0])
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (2049,)], ids=str)
def test_kernel_encode_matches_twin_bytes(fmt, stochastic, loss_scale, shape, values, same_bits):
    x = values(shape, seed=sum(shape))
    kwargs = {"loss_scale": loss_scale, "stochastic_rounding": stochastic, "seed": 3}
    kernel = quantize_half(x, fmt, backend="triton", **kwargs)
    same_bits(kernel, quantize_half(x, fmt, backend="torch", **kwargs))
    assert kernel.shape == x.shape and kernel.dtype == DTYPES[fmt]


@given(
    fmt=st.sampled_from(FORMATS),
    x=st.lists(st.floats(width=32, allow_subnormal=True), max_size=40),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
)
def test_kernel_matches_twin_hypothesis(fmt, x, stochastic, seed, same_bits):
    t = torch.tensor(x, dtype=torch.float32)
    kernel = quantize_half(t, fmt, stochastic_rounding=stochastic, seed=seed, backend="triton")
    same_bits(kernel, quantize_half(t, fmt, stochastic_rounding=stochastic, seed=seed, backend="torch"))
    same_bits(dequantize_half(kernel, backend="triton"), dequantize_half(kernel, backend="torch"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_scale", [None, 3.7])
def test_kernel_decode_matches_twin_on_every_code(fmt, output_dtype, loss_scale, same_bits):
    every_code = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(DTYPES[fmt])
    kwargs = {"loss_scale": loss_scale, "output_dtype": output_dtype}
    same_bits(
        dequantize_half(every_code, backend="triton", **kwargs), dequantize_half(every_code, backend="torch", **kwargs)
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_cast_path_equals_integer_rounding(fmt, same_bits):
    """The twin rounds with torch's casts; on a million random fp32 bit patterns (every exponent, NaN payloads, Inf,
    subnormals) and every tie just above 1 they give the kernel's integer nearest-even bits."""
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64, generator=generator).to(torch.int32)
    fp16_ties = (torch.arange(1 << 10, dtype=torch.int32) << 13) | 0x3F801000  # halfway between fp16 codes in [1, 2)
    bf16_ties = (torch.arange(1 << 7, dtype=torch.int32) << 16) | 0x3F808000
    subnormal_ties = torch.tensor([0x33000000, 0x33C00000, 0x00008000, 0x00018000], dtype=torch.int32)
    ties = torch.cat([fp16_ties, bf16_ties, subnormal_ties])
    x = torch.cat([patterns, ties, ties | (1 << 31)]).view(torch.float32)
    same_bits(quantize_half(x, fmt, backend="torch"), _quantize_half_bits(x, x, HALF_FORMATS[fmt], None))


@pytest.mark.parametrize("fmt", FORMATS)
def test_loss_scale_multiplies_then_divides(fmt):
    x = torch.tensor([1e-6, -3e-7, 0.5, 2.0])
    scaled = quantize_half(x, fmt, loss_scale=1024.0, backend="torch")
    assert torch.equal(scaled, (x * 1024.0).to(DTYPES[fmt]))
    assert torch.equal(dequantize_half(scaled, loss_scale=1024.0, backend="torch"), scaled.float() / 1024.0)


def test_fp16_loss_scale_recovers_small_gradients():
    """Gradients below fp16's subnormal range vanish without a loss scale and survive with one."""
    grads = torch.full((8,), 1e-8)
    assert float(dequantize_half(quantize_half(grads, "fp16"))[0]) == 0.0
    recovered = dequantize_half(quantize_half(grads, "fp16", loss_scale=2.0**16), loss_scale=2.0**16)
    assert torch.allclose(recovered, grads, rtol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_propagates_and_finite_values_saturate(fmt, backend):
    big = 1e5 if fmt == "fp16" else 3.4e38
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), big, -big, 1.0])
    encoded = quantize_half(x, fmt, backend=backend)
    decoded = dequantize_half(encoded, backend=backend)
    assert torch.isnan(decoded[0])
    assert decoded[1] == float("inf") and decoded[2] == float("-inf")
    top = torch.finfo(DTYPES[fmt]).max
    assert decoded[3] == top and decoded[4] == -top  # clamped, not Inf
    assert bits_of(encoded[0]) == {"fp16": 0x7E00, "bf16": 0x7FC0}[fmt]  # canonical NaN
    # a finite value pushed past the range by the loss scale also saturates
    assert (
        dequantize_half(quantize_half(torch.tensor([60000.0]), fmt, loss_scale=4.0, backend=backend)).isfinite().all()
    )


def bits_of(scalar: torch.Tensor) -> int:
    return int(scalar.view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_raise_policy(fmt):
    with pytest.raises(ValueError, match=r"input holds a non-finite value: input.flatten\(\)\[1\] = inf"):
        quantize_half(torch.tensor([1.0, float("inf")]), fmt, nonfinite="raise")


def test_stochastic_rounding_picks_a_neighbour():
    x = torch.full((4096,), 1.0 + 2.0**-12)  # between fp16 1.0 and 1.0 + 2**-10
    decoded = dequantize_half(quantize_half(x, "fp16", stochastic_rounding=True, seed=1))
    assert set(decoded.unique().tolist()) == {1.0, 1.0 + 2.0**-10}


def test_bad_inputs_raise_naming_the_argument():
    x = torch.randn(4)
    with pytest.raises(TypeError, match="input"):
        quantize_half(x.half(), "fp16")
    with pytest.raises(ValueError, match="fmt"):
        quantize_half(x, "fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        quantize_half(x, "fp16", loss_scale=0.0)
    with pytest.raises(ValueError, match="loss_scale"):
        quantize_half(x, "fp16", loss_scale=float("inf"))
    with pytest.raises(TypeError, match="loss_scale"):
        quantize_half(x, "fp16", loss_scale="2")
    with pytest.raises(ValueError, match="seed"):
        quantize_half(x, "fp16", seed=2**64)
    with pytest.raises(TypeError, match="input"):
        dequantize_half(x)
    with pytest.raises(TypeError, match="output_dtype"):
        dequantize_half(x.half(), output_dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        quantize_half(x, "fp16", backend="cuda")
