"""fp32 -> fp16 / bf16 weight rounding: the Triton helper (interpreter) and its torch twin agree bit for bit, round
to nearest like torch, and stochastic rounding picks a neighbour with the right probability."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.embedding.rounding import WEIGHT_CODES, round_fp32_to_storage, round_fp32_to_storage_reference
from tritonrec.kernels.random_bits import stream_key_args


@triton.jit
def _round_kernel(
    x_ptr, out_ptr, index_ptr, k1, k2, N, WEIGHT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    index = tl.load(index_ptr + i, mask=ok, other=0)
    tl.store(out_ptr + i, round_fp32_to_storage(x, index, k1, k2, WEIGHT_DTYPE, STOCHASTIC), mask=ok)


def _kernel_round(x: torch.Tensor, dtype: torch.dtype, stochastic: bool, index: torch.Tensor, seed: int):
    out = torch.empty(x.shape, dtype=dtype)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](
        x,
        out,
        index,
        *stream_key_args(seed),
        x.numel(),
        WEIGHT_DTYPE=WEIGHT_CODES[dtype],
        STOCHASTIC=stochastic,
        BLOCK=256,
    )
    return out


def _values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            3.0e38,
            3.4028e38,
            1e-45,
            -1e-40,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-25,
            2.0**-14 * 0.75,
            6e-8,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
        ]
    )
    wide = torch.randn(300, generator=gen) * torch.logspace(-30, 30, 300)
    fp16_range = torch.randn(300, generator=gen) * torch.logspace(-9, 4, 300)
    return torch.cat([special, wide, fp16_range]).float()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_to_nearest_matches_torch_conversion(dtype):
    x = _values()
    index = torch.arange(x.numel())
    expected = x.to(dtype)
    twin = round_fp32_to_storage_reference(x, dtype)
    kernel = _kernel_round(x, dtype, False, index, 0)
    assert torch.equal(twin.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(kernel.view(torch.int16), expected.view(torch.int16))


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), -float("nan")])
    for dtype in (torch.float16, torch.bfloat16):
        for stochastic in (False, True):
            assert torch.isnan(_kernel_round(x, dtype, stochastic, torch.arange(2), 7)).all()
            assert torch.isnan(round_fp32_to_storage_reference(x, dtype, stochastic, torch.arange(2), 7)).all()


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest ``dtype`` value <= x and the smallest >= x, as fp32."""
    nearest = x.to(dtype)
    below = torch.nextafter(nearest, torch.tensor(-float("inf"), dtype=dtype))
    above = torch.nextafter(nearest, torch.tensor(float("inf"), dtype=dtype))
    down = torch.where(nearest.float() > x, below.float(), nearest.float())
    up = torch.where(nearest.float() < x, above.float(), nearest.float())
    return down, up


# numpy warns when fp16 conversion of out-of-range values gives inf, which is the intended result
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_kernel_and_twin_agree_and_pick_a_neighbour(dtype):
    x = _values()
    finite = torch.isfinite(x) & (x.abs() < 6.5e4 if dtype == torch.float16 else torch.ones_like(x, dtype=torch.bool))
    index = torch.arange(x.numel()) * 977 + (1 << 33)  # large indices exercise the high word of the hash
    for seed in (1, 12345):
        twin = round_fp32_to_storage_reference(x, dtype, True, index, seed)
        kernel = _kernel_round(x, dtype, True, index, seed)
        assert torch.equal(twin.view(torch.int16), kernel.view(torch.int16))
        # the result is x itself or one of the two representable neighbours around it
        down = torch.where(
            x.to(dtype).float() > x,
            torch.nextafter(x.to(dtype), torch.tensor(-float("inf"), dtype=dtype)).float(),
            x.to(dtype).float(),
        )
        up = torch.where(
            x.to(dtype).float() < x,
            torch.nextafter(x.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float(),
            x.to(dtype).float(),
        )
        got = kernel.float()
        assert bool((((got == down) | (got == up)) | ~finite).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased(dtype):
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    x = torch.full((20000,), 1.0 + 0.3 * ulp)  # 30 % of the way from 1 to the next representable value
    rounded = round_fp32_to_storage_reference(x, dtype, True, torch.arange(20000), seed=99).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + ulp}
    up_fraction = (rounded > 1.0).float().mean().item()
    assert abs(up_fraction - 0.3) < 0.02
    # a different seed draws differently
    other = round_fp32_to_storage_reference(x, dtype, True, torch.arange(20000), seed=100).float()
    assert not torch.equal(rounded, other)


def test_fp32_storage_is_untouched_and_other_dtypes_are_rejected():
    x = torch.randn(5)
    assert round_fp32_to_storage_reference(x, torch.float32) is x
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16, got dtype=torch.float64"):
        round_fp32_to_storage_reference(x, torch.float64)
    with pytest.raises(ValueError, match="element_index is required for stochastic rounding"):
        round_fp32_to_storage_reference(x, torch.bfloat16, stochastic=True)
