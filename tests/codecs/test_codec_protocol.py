"""The comm-op seam: TritonQuantizedCommCodec against the QuantizedCommCodec protocol's contract, for every format.

The contract a comm op relies on: wire sizes from ``calc_quantized_size`` equal the encoded lengths; with rows
padded per rank (``padded_size``), encoding the concatenation equals concatenating the encodings, so each peer's
split of the wire buffer is exactly its encoding; decode restores the values (padding columns dropped by the caller
through ``ctx.padded_dim_sum_per_rank``) in the requested dtype.
"""

from __future__ import annotations

import pytest
import torch

from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec
from tritonrec.dist.qcomm_protocol import (
    NoOpQuantizedCommCodec,
    QuantizationContext,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    RoundingMode,
)

LOSSY = [CommType.FP16, CommType.BF16, CommType.FP8, CommType.INT8, CommType.MX4]
ROWWISE = [CommType.FP8, CommType.INT8, CommType.MX4]
WIRE_DTYPES = {CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


def codec(precision: CommType, **kwargs: object) -> TritonQuantizedCommCodec:
    return TritonQuantizedCommCodec(precision, backend="torch", **kwargs)


SIZE_CASES = [(p, None) for p in [CommType.FP32, *LOSSY]] + [(p, r) for p in ROWWISE for r in (8, 6)]


@pytest.mark.parametrize(("precision", "row_dim"), SIZE_CASES, ids=[f"{p}-{r}" for p, r in SIZE_CASES])
def test_calc_quantized_size_is_the_encoded_length(precision, row_dim):
    c = codec(precision, row_dim=row_dim)
    rows = c.row_dim
    for length in (0, rows, 3 * rows, 64 * rows):
        ctx = c.create_context()
        encoded = c.encode(torch.randn(length), ctx)
        assert encoded.dtype == c.quantized_dtype
        assert encoded.numel() == c.calc_quantized_size(length, ctx)
    for batch, dim in ((5, 3 * rows + 1), (1, 1), (0, 7)):
        ctx = c.create_context()
        padded, _ = c.padded_size(torch.empty(batch, dim), [dim], 0, ctx)
        assert c.encode(torch.randn(batch, dim), ctx).numel() == c.calc_quantized_size(batch * padded, ctx)


@pytest.mark.parametrize("precision", LOSSY, ids=str)
def test_per_rank_splits_are_the_per_rank_encodings(precision, same_bits):
    """All-to-all view: this rank holds [B_global, D] rows; rank r's split is B_r rows. Pooled view: peers with
    different dims concatenate their padded [B, D_r] slices."""
    c = codec(precision)
    dims = [40, 7, 64, 33]
    batch = 6
    ctx = c.create_context()
    slices = [torch.randn(batch, d) for d in dims]
    padded = [c.padded_size(s, dims, rank, ctx)[0] for rank, s in enumerate(slices)]
    assert ctx.padded_dim_sum_per_rank == (padded if precision in ROWWISE else None)
    flat_padded = torch.cat(
        [torch.nn.functional.pad(s, (0, p - s.shape[1])).reshape(-1) for s, p in zip(slices, padded, strict=True)]
    )
    per_rank = [c.encode(s, ctx) for s in slices]
    same_bits(c.encode(flat_padded, ctx).reshape(-1), torch.cat([e.reshape(-1) for e in per_rank]))
    # the receiver splits the wire buffer with calc_quantized_size and decodes it in one go
    sizes = [c.calc_quantized_size(batch * p, ctx) for p in padded]
    wire = torch.cat([e.reshape(-1) for e in per_rank])
    decoded = c.decode(wire, ctx).split([batch * p for p in padded])
    for part, s, p, piece in zip(decoded, slices, padded, wire.split(sizes), strict=True):
        same_bits(part.reshape(batch, p)[:, : s.shape[1]], c.unpad(c.decode(piece, ctx), s.shape, ctx))
        assert float((part.reshape(batch, p)[:, : s.shape[1]] - s).abs().max()) < 0.5 * float(s.abs().max())


@pytest.mark.parametrize("precision", LOSSY, ids=str)
@pytest.mark.parametrize("output_dtype", [None, CommType.FP16, torch.bfloat16], ids=str)
def test_decode_restores_length_and_dtype(precision, output_dtype):
    c = codec(precision, output_dtype=output_dtype)
    x = torch.randn(3, 20)
    ctx = c.create_context()
    decoded = c.unpad(c.decode(c.encode(x, ctx), ctx), x.shape, ctx)
    expected_dtype = {None: torch.float32, CommType.FP16: torch.float16}.get(output_dtype, output_dtype)
    assert decoded.shape == x.shape and decoded.dtype == expected_dtype
    flat = torch.randn(c.row_dim * 4)
    assert c.decode(c.encode(flat, ctx), ctx).shape == flat.shape


def test_quantized_dtypes_and_protocol_conformance():
    for precision in [CommType.FP32, *LOSSY]:
        c = codec(precision)
        assert isinstance(c, QuantizedCommCodec)
        assert c.quantized_dtype == WIRE_DTYPES.get(
            precision, torch.float32 if precision == CommType.FP32 else torch.uint8
        )
    noop = NoOpQuantizedCommCodec()
    assert isinstance(noop, QuantizedCommCodec) and noop.quantized_dtype == torch.float32
    x = torch.randn(4, 3)
    assert noop.encode(x) is x and noop.decode(x) is x and noop.padded_size(x, [3], 0, None) == (3, 0)
    codecs = QuantizedCommCodecs()
    assert isinstance(codecs.forward, NoOpQuantizedCommCodec) and codecs.forward is not QuantizedCommCodecs().forward


def test_context_row_dim_overrides_and_records_row_bytes():
    c = codec(CommType.INT8)
    ctx = QuantizationContext(row_dim=16)
    encoded = c.encode(torch.randn(64), ctx)
    assert encoded.numel() == 4 * 24 and ctx.row_dim_quant == 24
    assert c.decode(encoded, ctx).numel() == 64
    mx4 = codec(CommType.MX4, row_dim=16)
    assert mx4.create_context().mx_group_size == 16 and mx4.calc_quantized_size(64) == 4 * 9


@pytest.mark.parametrize("precision", LOSSY, ids=str)
def test_stochastic_rounding_is_reproducible_per_call_index(precision):
    x = torch.randn(8, 32)
    first, second = (
        codec(precision, stochastic_rounding=True, seed=3),
        codec(precision, stochastic_rounding=True, seed=3),
    )
    ctx = first.create_context()
    calls = [first.encode(x, ctx) for _ in range(3)]
    assert ctx.call_index == 2
    assert not torch.equal(calls[0].view(torch.uint8), calls[1].view(torch.uint8))  # fresh draws per call
    assert all(torch.equal(a.view(torch.uint8), second.encode(x).view(torch.uint8)) for a in calls)  # same sequence
    other_seed = codec(precision, stochastic_rounding=True, seed=4).encode(x)
    assert not torch.equal(calls[0].view(torch.uint8), other_seed.view(torch.uint8))


def test_fp8_direction_and_mx4_rounding_mode():
    x = torch.linspace(0.01, 1.0, 32)
    fwd, bwd = codec(CommType.FP8), codec(CommType.FP8, is_fwd=False)  # E4M3 (3 mantissa bits) / E5M2 (2)
    fwd_error = (fwd.decode(fwd.encode(x)) - x).abs().max()
    bwd_error = (bwd.decode(bwd.encode(x)) - x).abs().max()
    assert fwd_error <= 2.0**-5 < bwd_error <= 2.0**-4
    assert codec(CommType.MX4, rounding_mode=RoundingMode.stochastic).stochastic_rounding
    assert not codec(CommType.MX4, rounding_mode=RoundingMode.nearest).stochastic_rounding


def test_bad_inputs_raise_naming_the_argument():
    c = codec(CommType.INT8)
    with pytest.raises(TypeError, match="input"):
        c.encode(torch.randn(32).half())
    with pytest.raises(ValueError, match="input"):
        c.encode(torch.randn(2, 2, 32))
    with pytest.raises(ValueError, match="input_len=40 is not a multiple of the int8 row size 32.*padded_size"):
        c.calc_quantized_size(40)
    with pytest.raises(ValueError, match="input_len"):
        c.calc_quantized_size(-32)
    with pytest.raises(TypeError, match="input_len"):
        c.calc_quantized_size(32.0)
    with pytest.raises(ValueError, match="dim_per_rank"):
        c.padded_size(torch.randn(2, 3), [3, -1], 0, None)
    with pytest.raises(ValueError, match="my_rank"):
        c.padded_size(torch.randn(2, 3), [3], 1, None)
    with pytest.raises(ValueError, match=r"dim_per_rank\[0\] = 4"):
        c.padded_size(torch.randn(2, 3), [4], 0, None)
    with pytest.raises(TypeError, match="input"):
        c.decode(torch.randn(40))
    with pytest.raises(ValueError, match="ctx.row_dim"):
        c.encode(torch.randn(32), QuantizationContext(row_dim=0))
    with pytest.raises(TypeError, match="comm_precision"):
        TritonQuantizedCommCodec("int8")
    with pytest.raises(ValueError, match="loss_scale applies to FP16/BF16 only"):
        TritonQuantizedCommCodec(CommType.INT8, loss_scale=2.0)
    with pytest.raises(ValueError, match="loss_scale"):
        TritonQuantizedCommCodec(CommType.FP16, loss_scale=-1.0)
    with pytest.raises(ValueError, match="rounding_mode applies to MX4 only"):
        TritonQuantizedCommCodec(CommType.FP8, rounding_mode=RoundingMode.even)
    with pytest.raises(ValueError, match="rounding_mode must be even, nearest or stochastic"):
        TritonQuantizedCommCodec(CommType.MX4, rounding_mode=RoundingMode.floor)
    with pytest.raises(ValueError, match="row_dim must be an even int"):
        TritonQuantizedCommCodec(CommType.MX4, row_dim=5)
    with pytest.raises(TypeError, match="output_dtype"):
        TritonQuantizedCommCodec(CommType.FP8, output_dtype=torch.int8)
    with pytest.raises(ValueError, match="output_dtype"):
        TritonQuantizedCommCodec(CommType.FP8, output_dtype=CommType.INT8)
    with pytest.raises(ValueError, match="nonfinite"):
        TritonQuantizedCommCodec(CommType.FP8, nonfinite="clip")
