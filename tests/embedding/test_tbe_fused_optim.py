"""Fused optimizers in the backward: 5 steps of SGD / rowwise Adagrad / Adam / per-element Adagrad match a plain-torch
implementation of the same rules (weights and state), for the Triton kernel and the torch twin (also split into
one-row chunks);
low-precision storage; the multi-block path for very wide rows; order independence of the updated weights."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, PooledCase, make_case, make_layout, pooled_reference

import tritonrec.kernels.embedding.fused_update as fused_update_module
from tritonrec.kernels.embedding import OptimType, PoolingMode, create_fused_optimizer_state, pooled_embedding_lookup
from tritonrec.kernels.embedding.fused_update import fused_update_reference, fused_update_triton
from tritonrec.kernels.embedding.grad_plan import build_row_gradient_plan, pooled_fingerprints, pooled_value_info

RULES = {
    OptimType.EXACT_SGD: {"lr": 0.1},
    OptimType.EXACT_ROWWISE_ADAGRAD: {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01},
    OptimType.ADAM: {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.01},
    OptimType.EXACT_ADAGRAD: {"lr": 0.1, "eps": 1e-3, "weight_decay": 0.01},
}


def _layout(dims=(3, 129)):
    # dims 3 / 129 (two column blocks), few rows: ids repeat within and across bags; features 0 and 2 share table 0.
    # Equal dims take the twins' all-tables-at-once path.
    return make_layout(list(dims), rows=[5, 4], poolings=[PoolingMode.SUM, PoolingMode.MEAN], feature_tables=[0, 1, 0])


def _batches(layout, steps: int = 5) -> list[PooledCase]:
    gen = torch.Generator().manual_seed(0)
    batches = [
        make_case(layout, torch.randint(0, 5, (9,), generator=gen), batch_size=3, weighted=True, seed=s)
        for s in range(steps)
    ]
    # the rules must combine duplicates: ids repeat inside some bag and across bags in every batch
    for case in batches:
        bags = [case.indices[a:b].tolist() for a, b in zip(case.offsets[:-1], case.offsets[1:], strict=True)]
        assert any(len(set(bag)) < len(bag) for bag in bags)
        assert len({i for bag in bags for i in set(bag)}) < sum(len(set(bag)) for bag in bags)
    return batches


class ReferenceOptimizer:
    """Plain torch: per-table weights, dense autograd gradients, the rule applied to the rows in the batch."""

    def __init__(self, layout, weights: torch.Tensor, optim: OptimType, hp: dict) -> None:
        self.layout, self.optim, self.hp = layout, optim, hp
        self.tables = [layout.table_view(weights.clone(), t).clone() for t in range(layout.num_tables)]
        rowwise = optim == OptimType.EXACT_ROWWISE_ADAGRAD
        self.m1 = [torch.zeros(s.num_rows) if rowwise else torch.zeros(s.num_rows, s.dim) for s in layout.tables]
        self.m2 = [torch.zeros(s.num_rows, s.dim) for s in layout.tables]
        self.step_count = 0

    def step(self, case: PooledCase, grad_output: torch.Tensor) -> None:
        self.step_count += 1
        flat = torch.cat([t.reshape(-1) for t in self.tables]).requires_grad_()
        ref = PooledCase(self.layout, flat, case.indices, case.offsets, case.per_sample_weights, case.batch_size)
        pooled_reference(ref).backward(grad_output)
        starts = case.feature_value_offsets()
        hp, lr, wd = self.hp, self.hp["lr"], self.hp.get("weight_decay", 0.0)
        for t, w in enumerate(self.tables):
            looked_up = [
                case.indices[starts[f] : starts[f + 1]] for f, tf in enumerate(self.layout.feature_tables) if tf == t
            ]
            rows = torch.cat(looked_up).unique()
            g = self.layout.table_view(flat.grad, t)[rows] + wd * w[rows]
            if self.optim == OptimType.EXACT_SGD:
                w[rows] -= lr * g
            elif self.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
                self.m1[t][rows] += (g * g).mean(dim=1)
                w[rows] -= lr * g / (self.m1[t][rows].sqrt() + hp["eps"])[:, None]
            elif self.optim == OptimType.EXACT_ADAGRAD:
                self.m1[t][rows] += g * g
                w[rows] -= lr * g / (self.m1[t][rows].sqrt() + hp["eps"])
            else:
                b1, b2 = hp["betas"]
                self.m1[t][rows] = b1 * self.m1[t][rows] + (1 - b1) * g
                self.m2[t][rows] = b2 * self.m2[t][rows] + (1 - b2) * g * g
                m_hat = self.m1[t][rows] / (1 - b1**self.step_count)
                v_hat = self.m2[t][rows] / (1 - b2**self.step_count)
                w[rows] -= lr * m_hat / (v_hat.sqrt() + hp["eps"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optim", list(RULES))
@pytest.mark.parametrize("dims", [(3, 129), (4, 4)], ids=["mixed_dims", "equal_dims"])
def test_five_fused_steps_match_plain_torch(backend, optim, dims, tolerance):
    layout = _layout(dims)
    batches = _batches(layout)
    weights = batches[0].weights.clone()
    reference = ReferenceOptimizer(layout, weights, optim, RULES[optim])
    state = create_fused_optimizer_state(layout, optim, **RULES[optim])
    params = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(layout.num_tables)]
    gen = torch.Generator().manual_seed(1)
    for case in batches:
        grad_output = torch.randn(case.batch_size, layout.total_dim, generator=gen)
        out = pooled_embedding_lookup(
            weights,
            layout,
            case.indices,
            case.offsets,
            case.per_sample_weights,
            table_weights=params,
            fused=state,
            backend=backend,
        )
        out.backward(grad_output)
        reference.step(case, grad_output)
    assert all(p.grad is None for p in params)
    for t in range(layout.num_tables):
        torch.testing.assert_close(layout.table_view(weights, t), reference.tables[t], **tolerance(torch.float32))
        if optim == OptimType.EXACT_ROWWISE_ADAGRAD:
            rows = slice(layout.table_row_offsets[t], layout.table_row_offsets[t + 1])
            torch.testing.assert_close(state.momentum1[rows], reference.m1[t], **tolerance(torch.float32))
        if optim in (OptimType.ADAM, OptimType.EXACT_ADAGRAD):
            torch.testing.assert_close(
                layout.table_view(state.momentum1, t), reference.m1[t], **tolerance(torch.float32)
            )
        if optim == OptimType.ADAM:
            torch.testing.assert_close(
                layout.table_view(state.momentum2, t), reference.m2[t], **tolerance(torch.float32)
            )
    assert state.step.tolist() == [5, 5]


@pytest.mark.parametrize("optim", list(RULES))
@pytest.mark.parametrize("dims", [(3, 129), (4, 4)], ids=["mixed_dims", "equal_dims"])
def test_twin_in_one_row_chunks_matches_plain_torch(optim, dims, monkeypatch, tolerance):
    # the twin updates rows chunk by chunk (rowwise state gathered once, sliced per chunk, written back once): with a
    # few bytes per chunk every row is its own chunk, so every chunk boundary is crossed in every step
    monkeypatch.setattr(fused_update_module, "_CHUNK_BYTES_PER_THREAD", 4)
    monkeypatch.setattr(fused_update_module, "_CHUNK_BYTES_ONE_THREAD", 4)
    for name in ("_MAX_CHUNKS_MULTITHREADED", "_MAX_CHUNKS_ONE_THREAD"):  # whatever the thread count
        monkeypatch.setattr(fused_update_module, name, 1 << 20)
    layout = _layout(dims)
    batches = _batches(layout)
    weights = batches[0].weights.clone()
    reference = ReferenceOptimizer(layout, weights, optim, RULES[optim])
    state = create_fused_optimizer_state(layout, optim, **RULES[optim])
    gen = torch.Generator().manual_seed(2)
    for case in batches:
        grad_output = torch.randn(case.batch_size, layout.total_dim, generator=gen)
        pooled_embedding_lookup(
            weights, layout, case.indices, case.offsets, case.per_sample_weights, fused=state, backend="torch"
        ).backward(grad_output)
        reference.step(case, grad_output)
    for t in range(layout.num_tables):
        torch.testing.assert_close(layout.table_view(weights, t), reference.tables[t], **tolerance(torch.float32))
        if optim == OptimType.EXACT_ROWWISE_ADAGRAD:
            rows = slice(layout.table_row_offsets[t], layout.table_row_offsets[t + 1])
            torch.testing.assert_close(state.momentum1[rows], reference.m1[t], **tolerance(torch.float32))
        if optim in (OptimType.ADAM, OptimType.EXACT_ADAGRAD):
            m1 = layout.table_view(state.momentum1, t)
            torch.testing.assert_close(m1, reference.m1[t], **tolerance(torch.float32))
        if optim == OptimType.ADAM:
            m2 = layout.table_view(state.momentum2, t)
            torch.testing.assert_close(m2, reference.m2[t], **tolerance(torch.float32))


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD])
def test_wide_rows_take_the_multi_block_path(optim, tolerance):
    layout = _layout()
    case = _batches(layout, 1)[0]
    grad = torch.randn(case.batch_size, layout.total_dim)
    info = pooled_value_info(layout, case.indices, case.offsets, case.per_sample_weights, None, 3, grad.stride(0), True)
    plan = build_row_gradient_plan(layout, case.indices, info, pooled_fingerprints(info, grad))
    results = []
    for run in (lambda *a: fused_update_triton(*a, max_one_block_d=32), fused_update_reference):
        weights, state = case.weights.clone(), create_fused_optimizer_state(layout, optim, **RULES[optim])
        run(weights, layout, plan, grad.reshape(-1), state)
        results.append((weights, state.momentum1))
    torch.testing.assert_close(results[0][0], results[1][0], **tolerance(torch.float32))
    torch.testing.assert_close(results[0][1], results[1][1], **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights_round_to_nearest_after_the_fp32_update(backend, dtype):
    layout = _layout()
    case = _batches(layout, 1)[0]
    weights = case.weights.to(dtype)
    reference = ReferenceOptimizer(layout, weights.float(), OptimType.EXACT_SGD, RULES[OptimType.EXACT_SGD])
    grad = torch.randn(case.batch_size, layout.total_dim)
    reference.step(case, grad)
    state = create_fused_optimizer_state(layout, OptimType.EXACT_SGD, stochastic_rounding=False, lr=0.1)
    params = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    pooled_embedding_lookup(
        weights,
        layout,
        case.indices,
        case.offsets,
        case.per_sample_weights,
        table_weights=params,
        fused=state,
        backend=backend,
    ).backward(grad)
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    for t in range(2):
        expected = reference.tables[t].to(dtype)
        got = layout.table_view(weights, t)
        assert got.dtype == dtype
        # equal up to one unit in the last place (the fp32 sums may differ in their last bit from the reference's)
        torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=1e-6)
        assert (got == expected).float().mean() > 0.95


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_weights_do_not_depend_on_batch_order(backend):
    layout = make_layout([16], rows=[2])
    case = make_case(layout, [5, 6, 7, 4], batch_size=4, weighted=True, seed=3)
    grad = torch.randn(4, 16) * torch.logspace(-2, 2, 4)[:, None]
    perm = torch.tensor([3, 1, 0, 2])
    lengths = case.lengths()
    starts = case.offsets[:-1]
    permuted_idx = torch.cat([case.indices[int(starts[b]) : int(starts[b] + lengths[b])].flip(0) for b in perm])
    permuted_psw = torch.cat(
        [case.per_sample_weights[int(starts[b]) : int(starts[b] + lengths[b])].flip(0) for b in perm]
    )
    permuted_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[perm].cumsum(0)])
    results = []
    runs = [
        (case.indices, case.offsets, case.per_sample_weights, grad),
        (permuted_idx, permuted_offsets, permuted_psw, grad[perm]),
    ]
    for idx, offsets, psw, g in runs:
        weights = case.weights.clone()
        state = create_fused_optimizer_state(layout, OptimType.ADAM, lr=0.1)
        params = [torch.nn.Parameter(layout.table_view(weights, 0))]
        pooled_embedding_lookup(
            weights, layout, idx, offsets, psw, table_weights=params, fused=state, backend=backend
        ).backward(g)
        results.append((weights, state.momentum1, state.momentum2))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_state_rejects_unknown_hyperparameters_and_bad_values():
    layout = _layout()
    with pytest.raises(ValueError, match=r"EXACT_SGD does not take \['momentum'\]"):
        create_fused_optimizer_state(layout, OptimType.EXACT_SGD, momentum=0.9)
    with pytest.raises(ValueError, match=r"lr must be a non-negative number, got lr=-1"):
        create_fused_optimizer_state(layout, OptimType.ADAM, lr=-1)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\), got betas=\(0.9, 1.5\)"):
        create_fused_optimizer_state(layout, OptimType.ADAM, betas=(0.9, 1.5))
    with pytest.raises(TypeError, match="optim must be an OptimType, got optim='adam'"):
        create_fused_optimizer_state(layout, "adam")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_update_runs_without_any_input_requiring_grad(backend):
    layout = _layout()
    case = _batches(layout, 1)[0]
    weights = case.weights.clone()
    state = create_fused_optimizer_state(layout, OptimType.EXACT_SGD, lr=1.0)
    out = pooled_embedding_lookup(weights, layout, case.indices, case.offsets, fused=state, backend=backend)
    assert out.requires_grad
    out.sum().backward()
    assert not torch.equal(weights, case.weights) and state.step.tolist() == [1, 1]
    with torch.no_grad():
        assert not pooled_embedding_lookup(weights, layout, case.indices, case.offsets, fused=state).requires_grad


@pytest.mark.parametrize("dims", [(3, 129), (4, 4)], ids=["mixed_dims", "equal_dims"])
@pytest.mark.parametrize("rows_per_chunk", [1, 2, 3])
def test_chunked_row_sums_are_bit_identical_to_one_chunk(dims, rows_per_chunk):
    """Whatever the chunk size the twin sums rows in (chunks bound its temporaries), each row's sum is the same bits
    as in one chunk per span, weighted bags included."""
    from tritonrec.kernels.embedding.row_gradients import iter_row_sums

    layout = _layout(dims)
    for case in _batches(layout, 2):
        grad = torch.randn(case.batch_size, layout.total_dim)
        info = pooled_value_info(
            layout, case.indices, case.offsets, case.per_sample_weights, None, case.batch_size, grad.stride(0), True
        )
        plan = build_row_gradient_plan(layout, case.indices, info, pooled_fingerprints(info, grad))
        whole = {(a, b): sums for _, a, b, sums in iter_row_sums(layout, plan, grad.reshape(-1))}
        pieces = list(iter_row_sums(layout, plan, grad.reshape(-1), chunk_bytes=4 * min(dims) * rows_per_chunk))
        assert len(pieces) > len(whole)
        for (a, b), sums in whole.items():
            parts = [s for _, a2, b2, s in pieces if a <= a2 and b2 <= b]
            assert sum(p.shape[0] for p in parts) == b - a
            assert torch.equal(torch.cat(parts), sums)


def _pin_one_contribution_per_step(monkeypatch) -> list[int]:
    """Run the fused update kernel with ``BLOCK_N = 1`` (its row-block path); returns the row blocks it launched."""
    kernel = fused_update_module._fused_update_kernel
    config = next(c for c in kernel.configs if c.kwargs["BLOCK_N"] == 1)
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "cache", {})
    blocks: list[int] = []
    row_block = fused_update_module._row_block

    def recorded(block_d: int) -> int:
        blocks.append(row_block(block_d))
        return blocks[-1]

    monkeypatch.setattr(fused_update_module, "_row_block", recorded)
    return blocks


@pytest.mark.parametrize("optim", list(RULES))
@pytest.mark.parametrize("dims", [(3, 129), (4, 4)], ids=["mixed_dims", "equal_dims"])
def test_row_block_path_matches_plain_torch(optim, dims, monkeypatch, tolerance):
    # 2 rows a program at dims 3 / 129 (one 256-column block: the 3-wide table's rows are masked past column 3), 8 at
    # dims 4 / 4; 9 table rows in all, so the last block of a step is partly masked off
    blocks = _pin_one_contribution_per_step(monkeypatch)
    test_five_fused_steps_match_plain_torch("triton", optim, dims, tolerance)
    assert blocks == [2 if dims == (3, 129) else 8] * 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_block_path_rounds_low_precision_weights(dtype, monkeypatch):
    blocks = _pin_one_contribution_per_step(monkeypatch)
    test_low_precision_weights_round_to_nearest_after_the_fp32_update("triton", dtype)
    assert blocks == [2]


def test_row_block_path_rounds_stochastically_like_one_row_at_a_time(monkeypatch):
    # the same element numbers feed the same random stream: rows updated in blocks round as rows updated alone
    layout = _layout((4, 4))
    results, blocks = [], []
    for one_row in (False, True):
        with monkeypatch.context() as patch:
            blocks = _pin_one_contribution_per_step(patch)
            if one_row:
                patch.setattr(fused_update_module, "_row_block", lambda block_d: 1)
            weights = _batches(layout, 1)[0].weights.to(torch.float16)
            state = create_fused_optimizer_state(layout, OptimType.EXACT_SGD, stochastic_rounding=True, lr=0.1)
            for case in _batches(layout, 3):
                grad = torch.randn(case.batch_size, layout.total_dim, generator=torch.Generator().manual_seed(3))
                pooled_embedding_lookup(
                    weights, layout, case.indices, case.offsets, case.per_sample_weights, fused=state,
                    backend="triton",
                ).backward(grad)  # fmt: skip
            results.append(weights)
            if not one_row:
                assert blocks == [8] * 3  # the first pass took the row-block path (8 rows of 4 columns)
    assert torch.equal(results[0], results[1])
