"""Parity with FBGEMM's CPU table-batched embedding (the optional ``anchors`` extra; skipped when absent): same
pooled outputs, and fused EXACT_ROWWISE_ADAGRAD leaves the same weights and momentum."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import make_case, make_layout

from tritonrec.kernels.embedding import OptimType, PoolingMode, create_fused_optimizer_state, pooled_embedding_lookup

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")
tbe = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")


def _fbgemm(layout, weights: torch.Tensor, pooling: PoolingMode, lr: float, eps: float):
    specs = [(s.num_rows, s.dim, common.EmbeddingLocation.HOST, common.ComputeDevice.CPU) for s in layout.tables]
    module = tbe.SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=list(layout.feature_tables),
        optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
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
    fbgemm = _fbgemm(layout, weights, pooling, lr, eps)
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
