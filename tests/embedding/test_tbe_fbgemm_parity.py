"""Parity with FBGEMM's CPU table-batched embedding (the optional ``anchors`` extra; skipped when absent): same
pooled outputs, and fused EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD leave the same weights and momentum.

FBGEMM's CPU EXACT_ADAGRAD updates ``m`` with a fused multiply-add and computes ``w - (lr * g) / (sqrt(m) + eps)``
in fp64 (its C++ promotes to ``sqrt(double)``), rounding once; ours (and FBGEMM's GPU kernel) stay in fp32, so the
two agree to a few units in the last place, not bit for bit."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, make_case, make_layout

from tritonrec.kernels.embedding import OptimType, PoolingMode, create_fused_optimizer_state, pooled_embedding_lookup

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")
tbe = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")


def _fbgemm(layout, weights: torch.Tensor, pooling: PoolingMode, lr: float, eps: float, optim: str):
    specs = [(s.num_rows, s.dim, common.EmbeddingLocation.HOST, common.ComputeDevice.CPU) for s in layout.tables]
    module = tbe.SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=list(layout.feature_tables),
        optimizer=configs.EmbOptimType[optim],
        learning_rate=lr,
        eps=eps,
        pooling_mode=common.PoolingMode.MEAN if pooling == PoolingMode.MEAN else common.PoolingMode.SUM,
    )
    with torch.no_grad():
        for t, table in enumerate(module.split_embedding_weights()):
            table.copy_(layout.table_view(weights, t))
    return module


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_forward_and_three_fused_rowwise_adagrad_steps_match_fbgemm(pooling, tolerance):
    # no shared tables: FBGEMM 1.8.0's CPU rowwise-Adagrad backward fails whenever feature_table_map repeats a table
    layout = make_layout([8, 4], rows=[6, 5], poolings=[pooling, pooling])
    lr, eps = 0.05, 1e-8
    weights = make_case(layout, [0] * 8, batch_size=4).weights
    fbgemm = _fbgemm(layout, weights, pooling, lr, eps, "EXACT_ROWWISE_ADAGRAD")
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ROWWISE_ADAGRAD, lr=lr, eps=eps)
    params = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        case = make_case(layout, torch.randint(0, 6, (8,), generator=gen), batch_size=4, seed=step)
        grad = torch.randn(4, layout.total_dim, generator=gen)
        ours = pooled_embedding_lookup(
            weights, layout, case.indices, case.offsets, table_weights=params, fused=state, backend="torch"
        )
        theirs = fbgemm(case.indices, case.offsets)
        torch.testing.assert_close(ours, theirs, **tolerance(torch.float32))
        ours.backward(grad)
        theirs.backward(grad)
    for t, (table, states) in enumerate(
        zip(fbgemm.split_embedding_weights(), fbgemm.split_optimizer_states(), strict=True)
    ):
        torch.testing.assert_close(layout.table_view(weights, t), table, **tolerance(torch.float32))
        rows = slice(layout.table_row_offsets[t], layout.table_row_offsets[t + 1])
        torch.testing.assert_close(state.momentum1[rows], states[0].reshape(-1), **tolerance(torch.float32))


# weighted MEAN left out: FBGEMM's CPU lookup pools it otherwise (the forward differs, not the rule)
@pytest.mark.parametrize(
    ("pooling", "weighted"), [(PoolingMode.SUM, False), (PoolingMode.MEAN, False), (PoolingMode.SUM, True)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_five_fused_exact_adagrad_steps_match_fbgemm(backend, pooling, weighted, tolerance):
    # FBGEMM's CPU kernels take dims that are multiples of 4; few rows, so ids repeat within and across bags, and
    # bags of length 0 to 5
    layout = make_layout([4, 12], rows=[5, 3], poolings=[pooling, pooling])
    lr, eps = 0.05, 1e-3
    weights = make_case(layout, [0] * 8, batch_size=4).weights
    fbgemm = _fbgemm(layout, weights, pooling, lr, eps, "EXACT_ADAGRAD")
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD, lr=lr, eps=eps)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        lengths = torch.randint(0, 6, (8,), generator=gen)
        case = make_case(layout, lengths, batch_size=4, weighted=weighted, seed=step)
        grad = torch.randn(4, layout.total_dim, generator=gen)
        psw = case.per_sample_weights
        ours = pooled_embedding_lookup(weights, layout, case.indices, case.offsets, psw, fused=state, backend=backend)
        theirs = fbgemm(case.indices, case.offsets, per_sample_weights=psw)
        torch.testing.assert_close(ours, theirs, **tolerance(torch.float32))
        ours.backward(grad)
        theirs.backward(grad)
    for t, (table, states) in enumerate(
        zip(fbgemm.split_embedding_weights(), fbgemm.split_optimizer_states(), strict=True)
    ):
        torch.testing.assert_close(layout.table_view(weights, t), table, **tolerance(torch.float32))
        torch.testing.assert_close(layout.table_view(state.momentum1, t), states[0], **tolerance(torch.float32))
