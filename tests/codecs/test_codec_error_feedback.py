"""ErrorFeedbackCodec: residuals carried per call site shrink the accumulated error of repeated sends."""

from __future__ import annotations

import pytest
import torch

from tritonrec.dist.error_feedback import ErrorFeedbackCodec
from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec

LOSSY = [CommType.FP16, CommType.BF16, CommType.FP8, CommType.INT8, CommType.MX4]


def accumulated_error(codec, x: torch.Tensor, sends: int) -> float:
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(sends):
        ctx = codec.create_context()
        total += codec.unpad(codec.decode(codec.encode(x, ctx), ctx), x.shape, ctx).double()
    return float((total - sends * x.double()).norm())


@pytest.mark.parametrize("precision", LOSSY, ids=str)
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_feedback_cuts_accumulated_error(precision, stochastic):
    """Nearest-even repeats one error 100 times; feedback telescopes the sum down to one residual: >= 10x (about
    100x). Stochastic rounding's errors already partly cancel (they grow like sqrt(100) = 10), so feedback's gain is
    about 10x there; 4x is asserted."""
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(0))  # 40 columns: padded rows too
    plain = TritonQuantizedCommCodec(precision, stochastic_rounding=stochastic, backend="torch")
    feedback = ErrorFeedbackCodec(TritonQuantizedCommCodec(precision, stochastic_rounding=stochastic, backend="torch"))
    without, with_feedback = accumulated_error(plain, x, 100), accumulated_error(feedback, x, 100)
    assert with_feedback * (4 if stochastic else 10) <= without, (with_feedback, without)


def test_residuals_are_kept_per_call_site():
    codec = ErrorFeedbackCodec(TritonQuantizedCommCodec(CommType.MX4, backend="torch"))
    a, b = torch.randn(4, 32), torch.randn(4, 32)
    ctx_a, ctx_b = codec.create_context(), codec.create_context()
    ctx_a.feedback_key, ctx_b.feedback_key = "ebc.output_dist", "sequence.output_dist"
    codec.encode(a, ctx_a)
    codec.encode(b, ctx_b)
    residual_a = codec.residual("ebc.output_dist")
    expected = a - codec.unpad(codec.decode(codec.codec.encode(a)), a.shape)
    torch.testing.assert_close(residual_a, expected, rtol=0, atol=0)
    assert not torch.equal(residual_a, codec.residual("sequence.output_dist"))
    shape_key = codec.call_site_key(a, None)  # without a key, the input shape names the call site
    codec.encode(a)
    assert codec.residual(shape_key) is not None
    codec.reset()
    assert codec.residual("ebc.output_dist") is None


def test_shape_change_drops_the_residual_and_nonfinite_resets_it():
    codec = ErrorFeedbackCodec(TritonQuantizedCommCodec(CommType.INT8, backend="torch"))
    ctx = codec.create_context()
    ctx.feedback_key = "site"
    codec.encode(torch.randn(8, 32), ctx)
    smaller = torch.randn(3, 32)
    plain = TritonQuantizedCommCodec(CommType.INT8, backend="torch")
    assert torch.equal(codec.encode(smaller, ctx), plain.encode(smaller))  # no stale residual added
    poisoned = torch.randn(3, 32)
    poisoned[0, 0] = float("nan")
    codec.encode(poisoned, ctx)
    residual = codec.residual("site")
    assert bool(residual.isfinite().all()) and torch.equal(residual[0], torch.zeros(32))


def test_wrapping_checks():
    with pytest.raises(TypeError, match="codec"):
        ErrorFeedbackCodec(object())
    codec = ErrorFeedbackCodec(TritonQuantizedCommCodec(CommType.FP16, backend="torch"))
    with pytest.raises(TypeError, match="input"):
        codec.encode(torch.randn(3).double())
    assert codec.quantized_dtype == torch.float16 and codec.calc_quantized_size(10) == 10
