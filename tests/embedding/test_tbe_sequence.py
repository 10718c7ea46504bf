"""Sequence (unpooled) table-batched lookups: exact row gathers against F.embedding for mixed dims, gradients,
fused updates and order independence."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, make_layout, sequence_reference
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.kernels.embedding import (
    OptimType,
    create_fused_optimizer_state,
    sequence_embedding_lookup,
    split_sequence_output,
)


def _inputs(layout, counts, seed=0, index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    parts = [
        torch.randint(0, layout.tables[t].num_rows, (n,), generator=gen)
        for n, t in zip(counts, layout.feature_tables, strict=True)
    ]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return torch.randn(layout.num_weights, generator=gen), torch.cat(parts).to(index_dtype), starts


@pytest.mark.parametrize("backend", BACKENDS)
def test_gathers_rows_exactly_for_mixed_dims(backend):
    # dims 1, 3, 129 in one launch (torchrec's EmbeddingCollection needs one dim), a shared table, an empty feature
    layout = make_layout([1, 3, 129], rows=[4, 6, 5], feature_tables=[0, 1, 2, 1])
    weights, indices, starts = _inputs(layout, [5, 0, 7, 3], index_dtype=torch.int32)
    out = sequence_embedding_lookup(weights, layout, indices, starts, backend=backend)
    assert torch.equal(out, sequence_reference(layout, weights, indices, starts))
    parts = split_sequence_output(out, layout, starts)
    assert [tuple(p.shape) for p in parts] == [(5, 1), (0, 3), (7, 129), (3, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_indices(backend):
    # a strided view of the indices (every other element) used to be read as if dense by the Triton kernel
    layout = make_layout([3, 2], rows=[4, 6])
    weights, indices, starts = _inputs(layout, [3, 4], seed=1)
    strided = torch.stack([indices, torch.full_like(indices, 99)], dim=1).reshape(-1)[::2]
    assert not strided.is_contiguous()
    out = sequence_embedding_lookup(weights, layout, strided, starts, backend=backend)
    assert torch.equal(out, sequence_reference(layout, weights, indices, starts))


@given(
    dims=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_random_inputs_kernel_twin_and_embedding_agree(dims, counts, seed):
    feature_tables = [i % len(dims) for i in range(len(counts))]
    layout = make_layout(dims, rows=[3] * len(dims), feature_tables=feature_tables)
    weights, indices, starts = _inputs(layout, counts, seed)
    expected = sequence_reference(layout, weights, indices, starts)
    for backend in BACKENDS:
        assert torch.equal(sequence_embedding_lookup(weights, layout, indices, starts, backend=backend), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_per_table_gradients(backend, sparse, tolerance):
    layout = make_layout([3, 129], rows=[4, 3], feature_tables=[0, 1, 0])
    weights, indices, starts = _inputs(layout, [6, 5, 4], seed=1)
    params = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    out = sequence_embedding_lookup(
        weights, layout, indices, starts, table_weights=params, sparse_grad=sparse, backend=backend
    )
    grad = torch.randn_like(out)
    out.backward(grad)
    flat = weights.clone().requires_grad_()
    sequence_reference(layout, flat, indices, starts).backward(grad)
    for t, p in enumerate(params):
        got = p.grad.to_dense() if sparse else p.grad
        torch.testing.assert_close(got, layout.table_view(flat.grad, t), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_rowwise_adagrad_step(backend, tolerance):
    layout = make_layout([5, 2], rows=[3, 4])
    weights, indices, starts = _inputs(layout, [7, 6], seed=2)
    original = weights.clone()
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ROWWISE_ADAGRAD, lr=0.5, eps=1e-8)
    params = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    out = sequence_embedding_lookup(
        weights, layout, indices, starts, table_weights=params, fused=state, backend=backend
    )
    grad = torch.randn_like(out)
    out.backward(grad)
    flat = original.clone().requires_grad_()
    sequence_reference(layout, flat, indices, starts).backward(grad)
    for t, spec in enumerate(layout.tables):
        g = layout.table_view(flat.grad, t)
        touched = indices[starts[t] : starts[t + 1]].unique()
        momentum = torch.zeros(spec.num_rows)
        momentum[touched] = (g[touched] ** 2).mean(dim=1)
        expected = layout.table_view(original, t).clone()
        expected[touched] -= 0.5 * g[touched] / (momentum[touched].sqrt() + 1e-8)[:, None]
        torch.testing.assert_close(layout.table_view(weights, t), expected, **tolerance(torch.float32))
        rows = slice(layout.table_row_offsets[t], layout.table_row_offsets[t + 1])
        torch.testing.assert_close(state.momentum1[rows], momentum, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_do_not_depend_on_value_order(backend):
    layout = make_layout([32], rows=[2])
    weights, indices, starts = _inputs(layout, [24], seed=3)
    grad = torch.randn(24, 32) * torch.logspace(-3, 3, 24)[:, None]
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(4))
    grads = []
    for idx, g in ((indices, grad), (indices[perm], grad[perm])):
        w = weights.clone().requires_grad_()
        sequence_embedding_lookup(w, layout, idx, starts, backend=backend).backward(g.reshape(-1))
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])
