"""The span form of the sharded fused updates (dist/fused_spans.py), in one process: tables of one width are grouped
into spans (split at a row limit), per-table gradients are gathered without a copy when they lie back to back, and a
span update stores exactly what an independent per-table, per-row application of the textbook rules stores (per-table
Adam bias corrections and stochastic-rounding element offsets included). The data-parallel row sum adds each row's
parts in part order (dist/dp_fused_update.py)."""

from __future__ import annotations

import pytest
import torch

from tritonrec.dist.dp_fused_update import sum_rows_in_order
from tritonrec.dist.fused_spans import (
    FusedTables,
    SpanRows,
    apply_span_rule,
    decayed_gradient,
    span_rows,
    spans_rows,
    width_spans,
)
from tritonrec.kernels.embedding import OptimType, PoolingMode, TableBatchedLayout, TableSpec
from tritonrec.kernels.embedding.optim_state import begin_step, create_fused_optimizer_state
from tritonrec.kernels.embedding.rounding import round_fp32_to_storage_reference

WIDTHS = [4, 4, 3, 4, 4]
ROWS = [6, 5, 7, 4, 9]


def make_group(optim: OptimType, dtype: torch.dtype = torch.float32, **hyper: float) -> FusedTables:
    specs = [TableSpec(n, d, PoolingMode.SUM, f"t{i}") for i, (n, d) in enumerate(zip(ROWS, WIDTHS, strict=True))]
    layout = TableBatchedLayout(specs, list(range(len(specs))))
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(layout.num_weights, generator=g).to(dtype)
    state = create_fused_optimizer_state(layout, optim, stochastic_rounding=dtype != torch.float32, seed=5, **hyper)
    if state.momentum1 is not None:
        state.momentum1.uniform_(0.0, 1.0, generator=g)
    if state.momentum2 is not None:
        state.momentum2.uniform_(0.0, 1.0, generator=g)
    state.step.copy_(torch.tensor([0, 4, 1, 2, 7]))  # tables at different update counts: Adam's bias is per table
    return FusedTables(layout, weights, state)


def sparse_grads(group: FusedTables, seed: int) -> list[torch.Tensor]:
    """Per table, a coalesced sparse gradient whose values are slices of one buffer (as the lookup returns them)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n, generator=g)[: max(1, n // 2)].sort().values for n in ROWS]
    buffer = torch.randn(sum(r.numel() * d for r, d in zip(rows, WIDTHS, strict=True)), generator=g)
    out, at = [], 0
    for r, d, n in zip(rows, WIDTHS, ROWS, strict=True):
        block = buffer[at : at + r.numel() * d].view(-1, d)
        at += block.numel()
        out.append(torch.sparse_coo_tensor(r[None], block, (n, d), is_coalesced=True, check_invariants=False))
    return out


def test_width_spans_group_equal_widths_and_split_at_the_row_limit() -> None:
    group = make_group(OptimType.EXACT_SGD)
    assert [(s.first, s.end, s.dim) for s in width_spans([group])] == [(0, 2, 4), (2, 3, 3), (3, 5, 4)]
    assert [(s.first, s.end) for s in width_spans([group], max_rows=10)] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    span = width_spans([group])[2]
    assert (span.first_row, span.num_rows) == (18, 13)
    assert span.weights().data_ptr() == group.weights[group.layout.table_weight_offsets[3] :].data_ptr()


def test_span_rows_reads_back_to_back_gradients_in_place_and_copies_otherwise() -> None:
    group = make_group(OptimType.EXACT_SGD)
    grads = sparse_grads(group, 1)
    spans = width_spans([group])
    touched = spans_rows(spans, grads)
    first = touched[0]
    assert first.values.data_ptr() == grads[0].values().data_ptr()  # no copy
    expected_rows = torch.cat([grads[0].indices()[0], grads[1].indices()[0] + ROWS[0]])
    assert torch.equal(first.rows, expected_rows) and first.counts == [grads[0]._nnz(), grads[1]._nnz()]
    assert torch.equal(first.values, torch.cat([grads[0].values(), grads[1].values()]))
    apart = [
        torch.sparse_coo_tensor(g.indices(), g.values().clone(), g.shape, is_coalesced=True, check_invariants=False)
        for g in grads[:2]
    ]
    copied = span_rows(spans[0], apart)
    assert torch.equal(copied.values, first.values) and copied.values.data_ptr() != first.values.data_ptr()
    with pytest.raises(RuntimeError, match="5 tables but the backward delivered 4 gradients"):
        spans_rows(spans, grads[:4])


def test_span_rows_keeps_rows_read_with_a_zero_gradient_and_refuses_dense_gradients() -> None:
    # the touched rows are the ids the lookup read: a zero gradient (its bag's upstream gradient was zero) still
    # gets the rule (weight decay, Adam's moments); a dense gradient cannot tell it from an untouched row
    group = make_group(OptimType.ADAM, weight_decay=0.1)
    spans = width_spans([group])
    grads = sparse_grads(group, 5)
    zeroed = torch.sparse_coo_tensor(
        grads[1].indices(),
        torch.zeros_like(grads[1].values()),
        grads[1].shape,
        is_coalesced=True,
        check_invariants=False,
    )
    touched = span_rows(spans[0], [grads[0], zeroed])
    assert touched.counts == [grads[0]._nnz(), grads[1]._nnz()]
    assert torch.equal(touched.rows[grads[0]._nnz() :], grads[1].indices()[0] + ROWS[0])
    before = group.weights.clone()
    scalars = begin_step(group.state)
    decayed = decayed_gradient(spans[0], touched, scalars)
    apply_span_rule(spans[0], type(scalars)(**{**scalars.__dict__, "weight_decay": 0.0}), touched, decayed)
    table1 = group.layout.table_view(group.weights, 1)
    moved = (table1 != group.layout.table_view(before, 1)).any(dim=1)
    assert torch.equal(moved.nonzero().squeeze(1), grads[1].indices()[0])  # exactly the rows read
    assert span_rows(spans[0], [grads[0], None]).counts == [grads[0]._nnz(), 0]  # no lookup read table 1
    with pytest.raises(TypeError, match="table 1 't1': .* got a dense gradient of shape \\[5, 4\\]"):
        span_rows(spans[0], [grads[0], zeroed.to_dense()])


def _reference_update(group: FusedTables, grads: list[torch.Tensor], scalars, full: dict[int, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    """The textbook rules, one row at a time, each table on its own (independent of the span code)."""
    layout, state = group.layout, group.state
    for t, grad in enumerate(grads):
        spec = layout.tables[t]
        for k, row in enumerate(grad.indices()[0].tolist()):
            start = layout.table_weight_offsets[t] + row * spec.dim
            w = group.weights[start : start + spec.dim].float()
            g = grad.values()[k].float() + scalars.weight_decay * w
            state_row = layout.table_row_offsets[t] + row
            if state.optim == OptimType.EXACT_SGD:
                new = w - scalars.lr * g
            elif state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
                squares = full[t][k] if t in full else (g * g).sum()
                state.momentum1[state_row] += squares / (2 * spec.dim if t in full else spec.dim)
                new = w - scalars.lr * g / (state.momentum1[state_row].sqrt() + scalars.eps)
            elif state.optim == OptimType.EXACT_ADAGRAD:
                m1 = state.momentum1[start : start + spec.dim]
                m1.add_(g * g)
                new = w - scalars.lr * g / (m1.sqrt() + scalars.eps)
            else:
                m1 = state.momentum1[start : start + spec.dim]
                m2 = state.momentum2[start : start + spec.dim]
                m1.mul_(scalars.beta1).add_(scalars.one_minus_beta1 * g)
                m2.mul_(scalars.beta2).add_(scalars.one_minus_beta2 * g * g)
                update = (m1 / scalars.bias1[t]) / ((m2 / scalars.bias2[t]).sqrt() + scalars.eps)
                new = w - scalars.lr * update
            element = start + torch.arange(spec.dim) if state.stochastic_rounding else None
            stored = round_fp32_to_storage_reference(
                new[None], group.weights.dtype, state.stochastic_rounding, element, scalars.seed
            )
            group.weights[start : start + spec.dim] = stored[0]


@pytest.mark.parametrize(
    ("optim", "dtype", "hyper"),
    [
        (OptimType.EXACT_SGD, torch.float32, {"lr": 0.1, "weight_decay": 0.01}),
        (OptimType.EXACT_ROWWISE_ADAGRAD, torch.float32, {"lr": 0.1}),
        (OptimType.EXACT_ROWWISE_ADAGRAD, torch.float16, {"lr": 0.1, "weight_decay": 0.02}),
        (OptimType.ADAM, torch.float32, {"lr": 0.01}),
        (OptimType.ADAM, torch.bfloat16, {"lr": 0.01, "weight_decay": 0.01}),
        (OptimType.EXACT_ADAGRAD, torch.float32, {"lr": 0.1, "eps": 1e-3}),
        (OptimType.EXACT_ADAGRAD, torch.float16, {"lr": 0.1, "weight_decay": 0.02}),
    ],
)
def test_span_update_matches_per_table_textbook_rules(optim: OptimType, dtype: torch.dtype, hyper: dict) -> None:
    mine, theirs = make_group(optim, dtype, **hyper), make_group(optim, dtype, **hyper)
    grads = sparse_grads(mine, 2)
    pristine = [g.clone() for g in grads]  # the span update consumes the gradients it is given
    # table 4 as a column block of a twice-wider table: its whole rows' squares and width replace its own
    other_half = torch.rand(grads[4]._nnz(), generator=torch.Generator().manual_seed(9))
    scalars = begin_step(mine.state)
    begin_step(theirs.state)
    full: dict[int, torch.Tensor] = {}
    for span, touched in zip(width_spans([mine]), spans_rows(width_spans([mine]), grads), strict=True):
        g = decayed_gradient(span, touched, scalars)
        row_squares, full_dims = None, None
        if optim == OptimType.EXACT_ROWWISE_ADAGRAD and span.end == 5:
            row_squares = torch.linalg.vector_norm(g, dim=1).square()
            last = touched.table_bounds()[-2]
            full[4] = (g[last:] * g[last:]).sum(dim=1) + other_half
            row_squares[last:] = full[4]
            full_dims = torch.tensor([4.0] * last + [8.0] * (g.shape[0] - last))
        step = type(scalars)(**{**scalars.__dict__, "weight_decay": 0.0})
        apply_span_rule(span, step, touched, g, row_squares, full_dims)
    _reference_update(theirs, pristine, scalars, full)
    # fp32: the rules' arithmetic differs in order only. fp16/bf16 (stochastic rounding, seeded by each element's
    # offset): equal bits, so a row rounded with another row's offsets shows
    close = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(mine.weights.float(), theirs.weights.float(), **close)
    for name in ("momentum1", "momentum2"):
        if getattr(mine.state, name) is not None:
            torch.testing.assert_close(getattr(mine.state, name), getattr(theirs.state, name), rtol=1e-6, atol=1e-6)


def test_span_update_of_no_rows_changes_nothing() -> None:
    group = make_group(OptimType.ADAM)
    before = group.weights.clone()
    span = width_spans([group])[0]
    empty = SpanRows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), [0, 0])
    apply_span_rule(span, begin_step(group.state), empty, empty.values)
    assert torch.equal(group.weights, before)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_sum_rows_in_order_adds_each_row_in_part_order(scale: float) -> None:
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 6, (n,), generator=g, dtype=torch.int32) for n in (9, 7, 8)]
    matrix = torch.randn(30, 3, generator=g) * torch.logspace(-3, 3, 30)[:, None]  # magnitudes where order shows
    positions = torch.randperm(30, generator=g)[:24]
    union, sums = sum_rows_in_order(rows, matrix, positions, scale)
    every = torch.cat(rows).tolist()
    assert union.tolist() == sorted(set(every)) and union.dtype == torch.int64
    for k, row in enumerate(union.tolist()):
        expected = torch.zeros(3)
        for j in [j for j, r in enumerate(every) if r == row]:  # parts in order, each part's entries in order
            expected = expected + matrix[positions[j]] * scale  # fp32, one addition at a time
        assert torch.equal(sums[k], expected), (row, sums[k], expected)
    empty_union, empty_sums = sum_rows_in_order([torch.zeros(0, dtype=torch.int32)], torch.zeros(4, 3), torch.arange(0))
    assert empty_union.numel() == 0 and empty_sums.shape == (0, 3)
