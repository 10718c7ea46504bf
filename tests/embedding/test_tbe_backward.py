"""Pooled backward without an optimizer: dense / sparse row gradients and per-sample-weight gradients against
autograd through per-table torch.nn.EmbeddingBag, order independence of the row sums, and how the torch twin finds
the gradient rows."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, PooledCase, make_case, make_layout, pooled_cases, pooled_reference
from hypothesis import given, settings

from tritonrec.kernels.embedding import PoolingMode, pooled_embedding_lookup
from tritonrec.kernels.embedding.grad_plan import build_row_gradient_plan, pooled_fingerprints, pooled_value_info
from tritonrec.kernels.embedding.row_gradients import gradient_row_source, pooled_gradient_grid

SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN


def _case(weighted: bool = True, dims: tuple[int, int] = (3, 129)) -> PooledCase:
    # tables of dims 3 and 129 (two column blocks), features 0 and 2 share table 0, few rows -> many duplicates;
    # equal dims take the twin's all-tables-at-once path
    layout = make_layout(list(dims), rows=[4, 3], poolings=[SUM, MEAN], feature_tables=[0, 1, 0])
    return make_case(layout, [3, 0, 4, 2, 5, 1, 1, 3, 2], batch_size=3, weighted=weighted, seed=11)


def _reference_grads(case: PooledCase, grad_output: torch.Tensor):
    weights = case.weights.clone().requires_grad_()
    psw = None if case.per_sample_weights is None else case.per_sample_weights.clone().requires_grad_()
    ref_case = PooledCase(case.layout, weights, case.indices, case.offsets, psw, case.batch_size)
    pooled_reference(ref_case).backward(grad_output)
    return weights.grad, None if psw is None else psw.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(3, 129), (5, 5)], ids=["mixed_dims", "equal_dims"])
def test_flat_dense_and_per_sample_weight_gradients(backend, dims, tolerance):
    case = _case(dims=dims)
    grad_output = torch.randn(case.batch_size, case.layout.total_dim)
    weights = case.weights.clone().requires_grad_()
    psw = case.per_sample_weights.clone().requires_grad_()
    out = pooled_embedding_lookup(weights, case.layout, case.indices, case.offsets, psw, backend=backend)
    out.backward(grad_output)
    ref_weights, ref_psw = _reference_grads(case, grad_output)
    torch.testing.assert_close(weights.grad, ref_weights, **tolerance(torch.float32))
    torch.testing.assert_close(psw.grad, ref_psw, **tolerance(torch.float32))


@settings(max_examples=15)
@given(case=pooled_cases())
def test_random_jagged_inputs_gradients_match_autograd(case):
    grad_output = torch.randn(case.batch_size, case.layout.total_dim, generator=torch.Generator().manual_seed(0))
    ref_weights, ref_psw = _reference_grads(case, grad_output)
    for backend in BACKENDS:
        weights = case.weights.clone().requires_grad_()
        psw = None if case.per_sample_weights is None else case.per_sample_weights.clone().requires_grad_()
        pooled_embedding_lookup(weights, case.layout, case.indices, case.offsets, psw, backend=backend).backward(
            grad_output
        )
        torch.testing.assert_close(weights.grad, ref_weights, rtol=1e-5, atol=1e-5)
        if psw is not None:
            torch.testing.assert_close(psw.grad, ref_psw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_per_table_gradients_dense_or_sparse(backend, sparse, tolerance):
    case = _case(weighted=False)
    layout = case.layout
    params = [torch.nn.Parameter(layout.table_view(case.weights, t)) for t in range(layout.num_tables)]
    out = pooled_embedding_lookup(
        case.weights, layout, case.indices, case.offsets, table_weights=params, sparse_grad=sparse, backend=backend
    )
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    ref, _ = _reference_grads(case, grad_output)
    for t, p in enumerate(params):
        assert p.grad.is_sparse == sparse
        grad = p.grad.to_dense() if sparse else p.grad
        if sparse:  # only rows that were looked up are stored
            starts = case.feature_value_offsets()
            looked_up = [
                case.indices[starts[f] : starts[f + 1]] for f, tf in enumerate(layout.feature_tables) if tf == t
            ]
            assert torch.equal(p.grad.coalesce().indices()[0], torch.cat(looked_up).unique())
        torch.testing.assert_close(grad, layout.table_view(ref, t), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bag_divisors_scale_the_gradient(backend, tolerance):
    layout = make_layout([5], rows=[3], poolings=[MEAN])
    case = make_case(layout, [2, 4], batch_size=2, seed=2)
    divisors = torch.tensor([4.0, 9.0])
    weights = case.weights.clone().requires_grad_()
    out = pooled_embedding_lookup(weights, layout, case.indices, case.offsets, bag_divisors=divisors, backend=backend)
    out.backward(torch.ones_like(out))
    expected = torch.zeros(3, 5)
    expected.index_add_(0, case.indices[:2], torch.full((2, 5), 1 / 4))
    expected.index_add_(0, case.indices[2:], torch.full((4, 5), 1 / 9))
    torch.testing.assert_close(weights.grad.view(3, 5), expected, **tolerance(torch.float32))


def _permute_samples(case: PooledCase, perm: torch.Tensor, reverse_bags: bool) -> PooledCase:
    """New sample b is old sample perm[b]; optionally each bag's values in reverse order."""
    batch, lengths, starts = case.batch_size, case.lengths(), case.offsets[:-1]
    new_idx, new_psw, new_lengths = [], [], []
    for f in range(case.layout.num_features):
        for b in perm.tolist():
            bag = f * batch + b
            span = torch.arange(int(starts[bag]), int(starts[bag]) + int(lengths[bag]))
            span = span.flip(0) if reverse_bags else span
            new_idx.append(case.indices[span])
            new_psw.append(case.per_sample_weights[span])
            new_lengths.append(int(lengths[bag]))
    offsets = torch.zeros(len(new_lengths) + 1, dtype=case.offsets.dtype)
    offsets[1:] = torch.tensor(new_lengths).cumsum(0)
    return PooledCase(case.layout, case.weights, torch.cat(new_idx), offsets, torch.cat(new_psw), batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_gradients_do_not_depend_on_sample_or_value_order(backend):
    layout = make_layout([64], rows=[2])  # 2 rows: every row sums dozens of contributions
    case = make_case(layout, [9, 7, 8, 9, 6, 8], batch_size=6, weighted=True, seed=5)
    grad_output = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]  # wide magnitude range: order matters
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    permuted = _permute_samples(case, perm, reverse_bags=True)

    def grads(c: PooledCase, g: torch.Tensor) -> torch.Tensor:
        weights = c.weights.clone().requires_grad_()
        out = pooled_embedding_lookup(weights, layout, c.indices, c.offsets, c.per_sample_weights, backend=backend)
        out.backward(g)
        return weights.grad

    assert torch.equal(grads(case, grad_output), grads(permuted, grad_output[perm]))

    # the same sums in input order differ: the test data is sensitive to summation order
    def naive(c: PooledCase, g: torch.Tensor) -> torch.Tensor:
        bags = torch.repeat_interleave(torch.arange(6), c.lengths())
        return torch.zeros(2, 64).index_add_(0, c.indices, g[bags] * c.per_sample_weights[:, None])

    assert not torch.equal(naive(case, grad_output), naive(permuted, grad_output[perm]))


def test_plan_sorts_by_row_then_fingerprint_and_drops_invalid_rows():
    layout = make_layout([3, 2], rows=[4, 5], feature_tables=[0, 1, 0])
    case = make_case(layout, [2, 1, 0, 3, 2, 2], batch_size=2, seed=9)
    case.indices[0] = 4  # out of range for table 0: no contribution
    grad = torch.randn(2, layout.total_dim)
    info = pooled_value_info(layout, case.indices, case.offsets, None, None, 2, layout.total_dim, False)
    plan = build_row_gradient_plan(layout, case.indices, info, pooled_fingerprints(info, grad))
    assert plan.segment_offsets[-1] == case.indices.numel() - 1
    global_rows = case.indices + torch.tensor([0] * 3 + [4] * 3 + [0] * 4)
    valid_rows = torch.cat([global_rows[1:]])
    assert torch.equal(
        torch.repeat_interleave(
            plan.unique_local_rows + torch.tensor([0, 4])[plan.unique_tables],
            plan.segment_offsets[1:] - plan.segment_offsets[:-1],
        ),
        valid_rows.sort().values,
    )
    assert plan.table_unique_offsets[-1] == valid_rows.unique().numel()


@pytest.mark.parametrize(
    ("grad_offsets", "dim", "row_stride", "in_place"),
    [
        ([0, 8, 4, 16], 4, None, True),  # every row on the grid of its dim (a power of two)
        ([3, 9, 6, 15], 3, None, True),  # the same with a dim that is not a power of two
        ([5, 18, 31], 4, 13, True),  # only on the grid of the caller's row stride (a pooled gradient's sum(D))
        ([1, 2, 7], 3, 5, False),  # on no grid: gathered
        ([0, 2, 4], 4, 2, False),  # a stride below the dim would overlap rows: gathered
    ],
)
def test_gradient_row_source_reads_rows_in_place_when_they_lie_on_a_grid(grad_offsets, dim, row_stride, in_place):
    grad_flat = torch.arange(40, dtype=torch.float32)
    offsets = torch.tensor(grad_offsets)
    matrix, ids = gradient_row_source(grad_flat, offsets, dim, row_stride)
    expected = torch.stack([grad_flat[o : o + dim] for o in grad_offsets])
    assert torch.equal(matrix.index_select(0, ids), expected)
    shares_storage = matrix.untyped_storage().data_ptr() == grad_flat.untyped_storage().data_ptr()
    assert shares_storage == in_place


@pytest.mark.parametrize(
    ("dims", "feature_tables", "grids"),
    [
        ((4, 4), [0, 1, 0], {None: (4, 0), 0: (4, 0), 1: (4, 0)}),  # equal dims: every row on the dim grid
        ((3, 129), [0, 1, 0], {0: (3, 0), 1: (135, 3)}),  # table 1 has one feature: the sum(D) grid
        ((2, 3), [0, 1, 0], {0: None, 1: (7, 2)}),  # table 0's features start at columns 0 and 5 of 7: no grid
    ],
)
def test_pooled_gradient_grid_holds_every_gradient_row(dims, feature_tables, grids):
    layout = make_layout(list(dims), feature_tables=feature_tables)
    for table, expected in grids.items():
        grid = pooled_gradient_grid(layout, table, layout.total_dim)
        assert grid == expected
        if grid is None:
            continue
        stride, first = grid
        for f, t in enumerate(layout.feature_tables):
            if table is None or t == table:
                offsets = torch.arange(5) * layout.total_dim + layout.feature_out_offsets[f]
                assert bool(((offsets - first) % stride == 0).all())
