"""Every autotune config of every embedding kernel computes the same result (on a GPU autotuning may pick any of
them; under the interpreter only the first runs unless a test pins another, as here)."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import make_case, make_layout, pooled_reference

from tritonrec.kernels.embedding import (
    OptimType,
    PoolingMode,
    QuantizedTables,
    create_fused_optimizer_state,
    fused_update,
    pooled_embedding_lookup,
    pooled_forward,
    quantized_pooled_lookup,
    row_gradients,
    sequence,
    sequence_embedding_lookup,
)

KERNELS = {
    "pooled_forward": pooled_forward._pooled_forward_kernel,
    "segment_sum": row_gradients._segment_sum_kernel,
    "fused_update": fused_update._fused_update_kernel,
    "sequence_forward": sequence._sequence_forward_kernel,
}


def _pin(monkeypatch, kernel, config) -> None:
    """Make ``kernel`` run exactly ``config`` (a one-config autotuner never benchmarks)."""
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "cache", {})


def _case():
    layout = make_layout([3, 40], rows=[4, 5], poolings=[PoolingMode.SUM, PoolingMode.MEAN], feature_tables=[0, 1, 0])
    return make_case(layout, [5, 0, 2, 9, 1, 3, 4, 6, 1], batch_size=3, weighted=True, seed=2)


@pytest.mark.parametrize("index", range(len(KERNELS["pooled_forward"].configs)))
def test_pooled_forward_configs(monkeypatch, index):
    case = _case()
    _pin(monkeypatch, KERNELS["pooled_forward"], KERNELS["pooled_forward"].configs[index])
    args = (case.indices, case.offsets, case.per_sample_weights)
    torch.testing.assert_close(
        pooled_embedding_lookup(case.weights, case.layout, *args, backend="triton"),
        pooled_reference(case),
        rtol=1e-5,
        atol=1e-5,
    )
    q = QuantizedTables.from_float(case.layout, [case.layout.table_view(case.weights, t) for t in range(2)], 4)
    torch.testing.assert_close(
        quantized_pooled_lookup(q, *args, backend="triton"),
        quantized_pooled_lookup(q, *args, backend="torch"),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("index", range(len(KERNELS["segment_sum"].configs)))
def test_segment_sum_and_fused_update_configs(monkeypatch, index):
    case = _case()
    _pin(monkeypatch, KERNELS["segment_sum"], KERNELS["segment_sum"].configs[index])
    _pin(monkeypatch, KERNELS["fused_update"], KERNELS["fused_update"].configs[index])
    grad = torch.randn(3, case.layout.total_dim)
    results = []
    for backend in ("triton", "torch"):
        weights = case.weights.clone().requires_grad_()
        pooled_embedding_lookup(weights, case.layout, case.indices, case.offsets, backend=backend).backward(grad)
        fused_weights = case.weights.clone()
        state = create_fused_optimizer_state(case.layout, OptimType.ADAM, lr=0.1)
        params = [torch.nn.Parameter(case.layout.table_view(fused_weights, t)) for t in range(2)]
        pooled_embedding_lookup(
            fused_weights, case.layout, case.indices, case.offsets, table_weights=params, fused=state, backend=backend
        ).backward(grad)
        results.append((weights.grad, fused_weights))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index", range(len(KERNELS["sequence_forward"].configs)))
def test_sequence_forward_configs(monkeypatch, index):
    case = _case()
    _pin(monkeypatch, KERNELS["sequence_forward"], KERNELS["sequence_forward"].configs[index])
    starts = case.feature_value_offsets()
    got = sequence_embedding_lookup(case.weights, case.layout, case.indices, starts, backend="triton")
    assert torch.equal(got, sequence_embedding_lookup(case.weights, case.layout, case.indices, starts, backend="torch"))
