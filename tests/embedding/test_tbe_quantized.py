"""Row-wise INT8 / INT4 / INT2 and FP16 / FP32 tables: quantization error bounds, literal packed bytes, odd dims, and
the quantized pooled lookup against the dequantized reference (exact), a per-table ``embedding_bag`` on rows
dequantized by hand, and the float lookup (within the quantization error)."""

from __future__ import annotations

import struct

import pytest
import torch
from embedding.tbe_testing import BACKENDS, make_case, make_layout, pooled_reference

from tritonrec.kernels.embedding import (
    PoolingMode,
    QuantizedTables,
    dequantize_rowwise,
    pooled_embedding_lookup,
    quantize_rowwise,
    quantized_pooled_lookup,
)

SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN


ROWWISE_BITS = [8, 4, 2]
ALL_BITS = [32, 16, 8, 4, 2]


@pytest.mark.parametrize("bits", ROWWISE_BITS)
@pytest.mark.parametrize("dim", [1, 3, 5, 64, 129])
def test_quantize_dequantize_error_is_half_a_step(bits, dim):
    table = torch.randn(6, dim) * torch.logspace(-2, 2, 6)[:, None]
    table[0] = 0.25  # a constant row keeps scale 1 and is exact
    codes, scale, bias = quantize_rowwise(table, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (6, (dim * bits + 7) // 8)
    assert scale.dtype == bias.dtype == torch.float16
    restored = dequantize_rowwise(codes, scale, bias, dim, bits)
    assert torch.equal(restored[0], table[0])
    # half a quantization step, plus what fp16 rounding of the scale and the bias can add
    bound = 0.5 * scale.float() * (1 + 2 * (2**bits - 1) * 2.0**-11) + bias.float().abs() * 2.0**-10 + 1e-7
    assert bool(((restored - table).abs() <= bound[:, None]).all())


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    table = torch.tensor([[0.0, 15.0, 5.0]])  # scale 1, bias 0: codes are the values
    codes, scale, bias = quantize_rowwise(table, 4)
    assert codes.tolist() == [[0xF0, 0x05]] and scale.item() == 1.0 and bias.item() == 0.0


def test_int2_packs_four_codes_per_byte_low_bits_first():
    # row 0: scale 1, bias 0, codes 0 3 1 2 | 3 (dim 5: the second byte's upper six bits stay 0)
    # row 1: bias -1, scale fp16(6 / 3) = 2; (x + 1) / 2 = 0.5, 1.5, 2.5 are ties that round to even: 0, 2, 2
    table = torch.tensor([[0.0, 3.0, 1.0, 2.0, 3.0], [-1.0, 0.0, 2.0, 4.0, 5.0]])
    codes, scale, bias = quantize_rowwise(table, 2)
    assert codes.tolist() == [[0 | 3 << 2 | 1 << 4 | 2 << 6, 3], [0 | 0 << 2 | 2 << 4 | 2 << 6, 3]]
    assert scale.tolist() == [1.0, 2.0] and bias.tolist() == [0.0, -1.0]


def test_float_tables_store_the_weights_bytes():
    """FP16: rounded to nearest (0.1 -> 0x2E66, 1 + 2**-11 ties to even 0x3C00, 70000 overflows to inf); FP32: as
    is; both little-endian, no scale or bias."""
    table = torch.tensor([[0.1, 1.0 + 2.0**-11, -2.0], [70000.0, 0.0, 65504.0]])
    codes, scale, bias = quantize_rowwise(table, 16)
    assert codes.tolist() == [[0x66, 0x2E, 0x00, 0x3C, 0x00, 0xC0], [0x00, 0x7C, 0x00, 0x00, 0xFF, 0x7B]]
    assert scale.numel() == bias.numel() == 0
    codes, _, _ = quantize_rowwise(table[:, :1], 32)
    assert codes.tolist() == [list(struct.pack("<f", 0.1)), list(struct.pack("<f", 70000.0))]
    assert torch.equal(dequantize_rowwise(codes, scale, bias, 1, 32), table[:, :1])


def _dequantize_by_hand(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dim: int, bits: int):
    """Independent of the codec: column ``c``'s code sits at bit ``c * bits % 8`` of byte ``c * bits // 8``;
    FP16 / FP32 bytes are unpacked by ``struct``."""
    rows = []
    for r in range(codes.shape[0]):
        raw = bytes(codes[r].tolist())
        if bits in (16, 32):
            rows.append(struct.unpack(f"<{dim}{'e' if bits == 16 else 'f'}", raw))
        else:
            s, b = float(scale[r]), float(bias[r])  # code * s is exact and the sum is exact in float64: one rounding
            rows.append([((raw[c * bits // 8] >> (c * bits % 8)) & ((1 << bits) - 1)) * s + b for c in range(dim)])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, dim)


def _quantized_case(bits: int, weighted: bool):
    layout = make_layout([3, 129, 8], rows=[5, 4, 6], poolings=[SUM, MEAN, SUM], feature_tables=[0, 1, 2, 0])
    case = make_case(layout, [3, 0, 2, 4, 1, 2, 5, 2, 0, 1, 3, 2], batch_size=3, weighted=weighted, seed=bits)
    tables = [layout.table_view(case.weights, t) for t in range(layout.num_tables)]
    return case, QuantizedTables.from_float(layout, tables, bits)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_matches_dequantized_reference_exactly(bits, weighted):
    case, q = _quantized_case(bits, weighted)
    dequantized = torch.cat([q.dequantized(t).reshape(-1) for t in range(q.layout.num_tables)])
    for backend in BACKENDS:
        # same kernel structure / same twin as the float path, on the dequantized weights: bit-identical sums
        float_path = pooled_embedding_lookup(
            dequantized, q.layout, case.indices, case.offsets, case.per_sample_weights, backend=backend
        )
        got = quantized_pooled_lookup(q, case.indices, case.offsets, case.per_sample_weights, backend=backend)
        assert torch.equal(got, float_path)


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_lookup_is_within_the_quantization_error_of_the_float_lookup(bits):
    case, q = _quantized_case(bits, weighted=True)
    exact = pooled_embedding_lookup(case.weights, q.layout, case.indices, case.offsets, case.per_sample_weights)
    got = quantized_pooled_lookup(q, case.indices, case.offsets, case.per_sample_weights)
    # every pooled element is a (weighted, maybe averaged) sum of rows each off by at most half a step (+ fp16 slack)
    dequantized = torch.cat([q.dequantized(t).reshape(-1) for t in range(q.layout.num_tables)])
    row_error = (dequantized - case.weights).abs()
    bound = pooled_embedding_lookup(row_error, q.layout, case.indices, case.offsets, case.per_sample_weights.abs())
    assert bool(((got - exact).abs() <= bound + 1e-5).all())
    assert (got - exact).abs().max() > 0  # the comparison is not vacuous: quantization does change the result


@pytest.mark.parametrize("backend", BACKENDS)
def test_bag_divisors_and_int32_inputs(backend):
    case, q = _quantized_case(8, weighted=False)
    divisors = torch.arange(1, 13, dtype=torch.float32)
    got = quantized_pooled_lookup(q, case.indices.int(), case.offsets.int(), bag_divisors=divisors, backend=backend)
    dequantized = torch.cat([q.dequantized(t).reshape(-1) for t in range(q.layout.num_tables)])
    expected = pooled_embedding_lookup(
        dequantized, q.layout, case.indices, case.offsets, bag_divisors=divisors, backend=backend
    )
    assert torch.equal(got, expected)


def test_quantized_tables_check_their_buffers():
    layout = make_layout([3])
    codes, scale, bias = quantize_rowwise(torch.randn(7, 3), 8)
    with pytest.raises(ValueError, match="codes must hold 21 bytes for this layout, got 20"):
        QuantizedTables(layout, 8, codes.reshape(-1)[:20], scale, bias)
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizedTables(layout, 3, codes.reshape(-1), scale, bias)
    with pytest.raises(TypeError, match="scale must have dtype in \\[torch.float16\\], got torch.float32"):
        QuantizedTables(layout, 8, codes.reshape(-1), scale.float(), bias)
    with pytest.raises(ValueError, match="bits must be one of \\(32, 16, 8, 4, 2\\), got bits=3"):
        quantize_rowwise(torch.randn(2, 2), 3)
    half, _, _ = quantize_rowwise(torch.randn(7, 3), 16)
    with pytest.raises(ValueError, match="scale must be empty for 16-bit float tables, got 7 entries"):
        QuantizedTables(layout, 16, half.reshape(-1), scale, bias)
    with pytest.raises(ValueError, match="codes must hold 42 bytes for this layout, got 21"):
        QuantizedTables(layout, 16, codes.reshape(-1), scale[:0], bias[:0])


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize(
    ("dims", "lengths", "batch_size"), [([1, 3, 5], [2, 0, 3], 1), ([5, 1, 3], [0, 1, 0, 0, 2, 3], 2)]
)
def test_odd_dims_empty_bags_and_one_sample_against_rows_dequantized_by_hand(bits, dims, lengths, batch_size):
    """Odd widths (INT2 dim 1, 3, 5: one or two bytes, the unused bits zero), empty bags and B=1, weighted, one
    MEAN table; triton, the torch twin and ``embedding_bag`` on hand-dequantized rows agree."""
    layout = make_layout(dims, rows=[4, 3, 5], poolings=[SUM, MEAN, SUM])
    case = make_case(layout, lengths, batch_size=batch_size, weighted=True, seed=bits)
    tables = [layout.table_view(case.weights, t) for t in range(layout.num_tables)]
    q = QuantizedTables.from_float(layout, tables, bits)
    by_hand = []
    for t, spec in enumerate(layout.tables):
        codes = q.table_codes(t)
        assert codes.shape == (spec.num_rows, (spec.dim * bits + 7) // 8)
        if bits < 8 and spec.dim * bits % 8:  # the padding bits of the last byte are zero
            assert bool((codes[:, -1] >> (spec.dim * bits % 8) == 0).all())
        rows = _dequantize_by_hand(codes, *q.table_scale_bias(t), spec.dim, bits)
        assert torch.equal(rows, q.dequantized(t))
        by_hand.append(rows.reshape(-1))
    expected = pooled_reference(case, torch.cat(by_hand))
    outputs = {
        backend: quantized_pooled_lookup(q, case.indices, case.offsets, case.per_sample_weights, backend=backend)
        for backend in BACKENDS
    }
    for got in outputs.values():
        assert got.shape == (batch_size, sum(dims))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-6, atol=1e-6)
