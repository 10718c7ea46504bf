"""Row-wise INT8 / INT4 tables: quantization error bounds, packing of odd dims, and the quantized pooled lookup
against the dequantized reference (exact) and the float lookup (within the quantization error)."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, make_case, make_layout

from tritonrec.kernels.embedding import (
    PoolingMode,
    QuantizedTables,
    dequantize_rowwise,
    pooled_embedding_lookup,
    quantize_rowwise,
    quantized_pooled_lookup,
)

SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [1, 3, 64, 129])
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


def _quantized_case(bits: int, weighted: bool):
    layout = make_layout([3, 129, 8], rows=[5, 4, 6], poolings=[SUM, MEAN, SUM], feature_tables=[0, 1, 2, 0])
    case = make_case(layout, [3, 0, 2, 4, 1, 2, 5, 2, 0, 1, 3, 2], batch_size=3, weighted=weighted, seed=bits)
    tables = [layout.table_view(case.weights, t) for t in range(layout.num_tables)]
    return case, QuantizedTables.from_float(layout, tables, bits)


@pytest.mark.parametrize("bits", [8, 4])
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


@pytest.mark.parametrize("bits", [8, 4])
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
        QuantizedTables(layout, 2, codes.reshape(-1), scale, bias)
    with pytest.raises(TypeError, match="scale must have dtype in \\[torch.float16\\], got torch.float32"):
        QuantizedTables(layout, 8, codes.reshape(-1), scale.float(), bias)
    with pytest.raises(ValueError, match="bits must be one of \\(8, 4\\), got bits=3"):
        quantize_rowwise(torch.randn(2, 2), 3)
