"""Compiled Triton kernels on CUDA against their torch twins at production-like sizes (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import make_case, make_layout

from tritonrec.kernels.embedding import (
    OptimType,
    PoolingMode,
    QuantizedTables,
    create_fused_optimizer_state,
    pooled_embedding_lookup,
    quantized_pooled_lookup,
    sequence_embedding_lookup,
)

pytestmark = pytest.mark.gpu


def _case(dtype: torch.dtype = torch.float32):
    layout = make_layout(
        [128, 64, 3, 129],
        rows=[5000, 3000, 100, 2000],
        poolings=[PoolingMode.SUM, PoolingMode.MEAN] * 2,
        feature_tables=[0, 1, 2, 3, 0],
    )
    lengths = torch.randint(0, 40, (5 * 256,), generator=torch.Generator().manual_seed(0))
    case = make_case(layout, lengths, batch_size=256, weighted=True, seed=1, weight_dtype=dtype)
    for name in ("weights", "indices", "offsets", "per_sample_weights"):
        setattr(case, name, getattr(case, name).cuda())
    return case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pooled_forward_and_sequence(dtype):
    case = _case(dtype)
    args = (case.weights, case.layout, case.indices, case.offsets, case.per_sample_weights)
    torch.testing.assert_close(
        pooled_embedding_lookup(*args, backend="triton"),
        pooled_embedding_lookup(*args, backend="torch"),
        rtol=1e-5,
        atol=1e-4,
    )
    starts = case.feature_value_offsets()
    assert torch.equal(
        sequence_embedding_lookup(case.weights, case.layout, case.indices, starts, backend="triton"),
        sequence_embedding_lookup(case.weights, case.layout, case.indices, starts, backend="torch"),
    )


@pytest.mark.parametrize(
    "optim", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD]
)
def test_fused_updates_and_gradients(optim):
    case = _case()
    grad = torch.randn(case.batch_size, case.layout.total_dim, device="cuda")
    results = []
    for backend in ("triton", "torch"):
        weights = case.weights.clone()
        state = create_fused_optimizer_state(case.layout, optim, "cuda", lr=0.05)
        psw = case.per_sample_weights.clone().requires_grad_()
        out = pooled_embedding_lookup(
            weights, case.layout, case.indices, case.offsets, psw, fused=state, backend=backend
        )
        out.backward(grad)
        results.append((weights, psw.grad, *state.state_tensors().values()))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2])
def test_quantized_lookup(bits):
    case = _case()
    q = QuantizedTables.from_float(case.layout, [case.layout.table_view(case.weights, t) for t in range(4)], bits)
    args = (q, case.indices, case.offsets, case.per_sample_weights)
    torch.testing.assert_close(
        quantized_pooled_lookup(*args, backend="triton"),
        quantized_pooled_lookup(*args, backend="torch"),
        rtol=1e-5,
        atol=1e-4,
    )
