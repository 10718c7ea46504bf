"""Bounds-check modes for every lookup (pooled, sequence, quantized) and both backends: FATAL raises naming the
feature, table, index and bound; WARNING warns once and treats the row as zero; IGNORE is silent and also zero."""

from __future__ import annotations

import warnings

import pytest
import torch
from embedding.tbe_testing import BACKENDS, PooledCase, make_case, make_layout, pooled_reference

from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    OptimType,
    PoolingMode,
    QuantizedTables,
    create_fused_optimizer_state,
    pooled_embedding_lookup,
    quantized_pooled_lookup,
    sequence_embedding_lookup,
)

BAD_INDICES = pytest.mark.parametrize("bad", [7, -1], ids=["index_equal_to_num_rows", "negative_index"])


def _case() -> tuple[PooledCase, int]:
    """Two features over tables of 5 and 7 rows (t1 is MEAN); returns the case and a position in feature f1."""
    layout = make_layout([3, 4], rows=[5, 7], poolings=[PoolingMode.SUM, PoolingMode.MEAN])
    case = make_case(layout, [2, 1, 3, 2], batch_size=2, weighted=True, seed=1)
    return case, 3 + 1  # feature f1 starts at value 3; its value 1 sits in bag (f1, sample 0)


def _zeroed_reference(case: PooledCase, position: int) -> torch.Tensor:
    """The lookup with that value's row treated as zero (still counted in the MEAN bag length)."""
    indices = case.indices.clone()
    indices[position] = 0
    psw = case.per_sample_weights.clone()
    psw[position] = 0.0
    return pooled_reference(PooledCase(case.layout, case.weights, indices, case.offsets, psw, case.batch_size))


@pytest.mark.parametrize("backend", BACKENDS)
@BAD_INDICES
def test_fatal_names_feature_table_index_and_bound(backend, bad):
    case, position = _case()
    case.indices[position] = bad
    expected = rf"feature 'f1' \(reading table 1 \('t1'\)\) has index {bad} at value 1 of the feature, outside \[0, 7\)"
    with pytest.raises(ValueError, match=expected):
        pooled_embedding_lookup(case.weights, case.layout, case.indices, case.offsets, backend=backend)
    with pytest.raises(ValueError, match=expected):
        sequence_embedding_lookup(
            case.weights, case.layout, case.indices, case.feature_value_offsets(), backend=backend
        )
    q = QuantizedTables.from_float(case.layout, [case.layout.table_view(case.weights, t) for t in range(2)], 8)
    with pytest.raises(ValueError, match=expected):
        quantized_pooled_lookup(q, case.indices, case.offsets, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@BAD_INDICES
def test_warning_warns_once_and_treats_the_row_as_zero(backend, bad):
    case, position = _case()
    case.indices[position] = bad
    run = lambda: pooled_embedding_lookup(
        case.weights,
        case.layout,
        case.indices,
        case.offsets,
        case.per_sample_weights,
        bounds_check=BoundsCheckMode.WARNING,
        backend=backend,
    )
    with pytest.warns(RuntimeWarning, match=rf"feature 'f1' .* has index {bad} .*1 out-of-range index"):
        out = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second batch on the same layout stays quiet
        again = run()
    torch.testing.assert_close(out, _zeroed_reference(case, position), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, again)


@pytest.mark.parametrize("backend", BACKENDS)
@BAD_INDICES
def test_ignore_is_silent_zero_rows_and_no_update(backend, bad):
    case, position = _case()
    case.indices[position] = bad
    weights = case.weights.clone()
    state = create_fused_optimizer_state(case.layout, OptimType.EXACT_SGD, lr=1.0)
    params = [torch.nn.Parameter(case.layout.table_view(weights, t)) for t in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pooled_embedding_lookup(
            weights,
            case.layout,
            case.indices,
            case.offsets,
            case.per_sample_weights,
            table_weights=params,
            fused=state,
            bounds_check=BoundsCheckMode.IGNORE,
            backend=backend,
        )
        torch.testing.assert_close(out, _zeroed_reference(case, position), rtol=1e-5, atol=1e-5)
        out.backward(torch.ones_like(out))
    # the update equals the one of the zeroed batch: the bad value neither reads nor writes a row
    zeroed = case.indices.clone()
    zeroed[position] = 0
    psw = case.per_sample_weights.clone()
    psw[position] = 0.0
    expected = case.weights.clone().requires_grad_()
    pooled_reference(PooledCase(case.layout, expected, zeroed, case.offsets, psw, 2)).sum().backward()
    torch.testing.assert_close(weights, case.weights - expected.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
def test_sequence_and_quantized_lookups_zero_out_of_range_rows(backend, mode):
    case, position = _case()
    case.indices[position] = 7
    starts = case.feature_value_offsets()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = sequence_embedding_lookup(
            case.weights, case.layout, case.indices, starts, bounds_check=mode, backend=backend
        )
    f1 = rows[3 * 3 :].view(-1, 4)
    assert torch.equal(f1[1], torch.zeros(4))
    assert torch.equal(f1[0], case.layout.table_view(case.weights, 1)[case.indices[3]])
    q = QuantizedTables.from_float(case.layout, [case.layout.table_view(case.weights, t) for t in range(2)], 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = quantized_pooled_lookup(
            q, case.indices, case.offsets, case.per_sample_weights, bounds_check=mode, backend=backend
        )
    clean = case.indices.clone()
    clean[position] = 0
    psw = case.per_sample_weights.clone()
    psw[position] = 0.0
    assert torch.equal(got, quantized_pooled_lookup(q, clean, case.offsets, psw, backend=backend))


def test_bounds_check_must_be_a_mode():
    case, _ = _case()
    with pytest.raises(TypeError, match="bounds_check must be a BoundsCheckMode, got bounds_check='FATAL'"):
        pooled_embedding_lookup(case.weights, case.layout, case.indices, case.offsets, bounds_check="FATAL")
