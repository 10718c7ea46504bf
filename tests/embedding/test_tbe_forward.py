"""Pooled table-batched forward: Triton kernel (interpreter) and torch twin against per-table torch.nn.EmbeddingBag."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, make_case, make_layout, pooled_cases, pooled_reference
from hypothesis import given

from tritonrec.kernels.embedding import PoolingMode, pooled_embedding_lookup

SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN


def _lookup(case, backend, **kwargs):
    return pooled_embedding_lookup(
        case.weights, case.layout, case.indices, case.offsets, case.per_sample_weights, backend=backend, **kwargs
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [1, 3, 4, 64, 129])
@pytest.mark.parametrize("pooling", [SUM, MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_embedding_bag_per_dim(backend, dim, pooling, weighted, tolerance):
    layout = make_layout([dim], rows=[5], poolings=[pooling])
    # bag 0 repeats id-rich draws from 5 rows (duplicates within the bag), bag 1 is empty
    case = make_case(layout, [6, 0, 2], batch_size=3, weighted=weighted, seed=dim)
    torch.testing.assert_close(_lookup(case, backend), pooled_reference(case), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dims_shared_tables_and_poolings(backend, tolerance):
    # four features over three tables of dims 3, 129, 1; features 0 and 3 share table 0
    layout = make_layout([3, 129, 1], rows=[6, 4, 3], poolings=[SUM, MEAN, MEAN], feature_tables=[0, 1, 2, 0])
    case = make_case(layout, [2, 0, 3, 1, 4, 0, 2, 2, 1, 0, 5, 1], batch_size=3, weighted=True, seed=3)
    out = _lookup(case, backend)
    assert out.shape == (3, 3 + 129 + 1 + 3)
    torch.testing.assert_close(out, pooled_reference(case), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_sample_and_all_empty_bags(backend):
    layout = make_layout([4, 2], poolings=[SUM, MEAN])
    one = make_case(layout, [3, 2], batch_size=1, seed=1)
    torch.testing.assert_close(_lookup(one, backend), pooled_reference(one), rtol=1e-5, atol=1e-5)
    empty = make_case(layout, [0, 0, 0, 0], batch_size=2, seed=2)
    assert torch.equal(_lookup(empty, backend), torch.zeros(2, 6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_indices_and_offsets(backend, tolerance):
    layout = make_layout([5])
    case = make_case(layout, [1, 3, 2], batch_size=3, index_dtype=torch.int32, seed=4)
    torch.testing.assert_close(_lookup(case, backend), pooled_reference(case), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bag_divisors_replace_local_lengths_for_mean_tables_only(backend, tolerance):
    layout = make_layout([3, 3], poolings=[MEAN, SUM])
    case = make_case(layout, [2, 3, 1, 2], batch_size=2, seed=5)
    divisors = torch.tensor([5.0, 6.0, 7.0, 8.0])  # global bag lengths a row-wise shard would pass
    out = _lookup(case, backend, bag_divisors=divisors)
    sums = pooled_reference(make_case(make_layout([3, 3]), [2, 3, 1, 2], batch_size=2, seed=5))
    expected = torch.cat([sums[:, :3] / divisors[:2, None], sums[:, 3:]], dim=1)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage_accumulates_in_fp32(dtype):
    layout = make_layout([64, 3], poolings=[SUM, MEAN])
    case = make_case(layout, [8, 0, 5, 7, 1, 3], batch_size=3, weighted=True, seed=6, weight_dtype=dtype)
    exact = pooled_reference(case, case.weights.double()).double()
    out = _lookup(case, "triton").double()
    # the rows themselves are exact in fp32, so the kernel's only error is fp32 summation: far below the dtype's
    # rounding, and at most twice the error of summing the same rows in the storage dtype (flash-attention rule)
    low_precision = pooled_reference(case, case.weights).to(dtype).double()
    assert (out - exact).abs().max() <= 2 * (low_precision - exact).abs().max() + 1e-6
    assert _lookup(case, "triton").dtype == torch.float32


@given(case=pooled_cases())
def test_random_jagged_inputs_kernel_twin_and_embedding_bag_agree(case):
    reference = pooled_reference(case)
    for backend in BACKENDS:
        torch.testing.assert_close(_lookup(case, backend), reference, rtol=1e-5, atol=1e-5)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a twice-as-long buffer)."""
    return torch.stack([t, torch.full_like(t, 7)], dim=1).reshape(-1)[::2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_indices_offsets_and_weights(backend, tolerance):
    # The kernels read indices / offsets / per-sample weights / divisors as flat arrays: strided views used to be read
    # as if dense (garbage rows, wrong bags) on the Triton path, in the forward and the per-sample-weight gradient.
    layout = make_layout([3, 2], rows=[5, 4], poolings=[SUM, MEAN])
    case = make_case(layout, [2, 0, 3, 1], batch_size=2, weighted=True, seed=7)
    divisors = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = _lookup(case, "torch", bag_divisors=divisors)
    psw = _strided(case.per_sample_weights).requires_grad_()
    strided = (_strided(case.indices), _strided(case.offsets), psw, _strided(divisors))
    assert not any(t.is_contiguous() for t in strided)
    out = pooled_embedding_lookup(case.weights, layout, *strided, backend=backend)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    out.sum().backward()
    dense_psw = case.per_sample_weights.clone().requires_grad_()
    pooled_embedding_lookup(
        case.weights, layout, case.indices, case.offsets, dense_psw, divisors, backend="torch"
    ).sum().backward()
    torch.testing.assert_close(psw.grad, dense_psw.grad, **tolerance(torch.float32))
