"""Fused per-element Adagrad (FBGEMM's ``EXACT_ADAGRAD``): the Triton kernel and the torch twin against two
independent references on odd shapes (D = 1, 3, 129, B = 1, empty bags, duplicate ids within and across bags):

* ``torch.optim.Adagrad`` (``lr_decay=0``) on a dense copy of each table, stepped with the autograd gradient (which
  aggregates a row's duplicates before the update, as the fused rule must); untouched rows see a zero gradient
  and stay put, as in the row-sparse fused update;
* with weight decay (L2, where torch's dense Adagrad would also decay untouched rows), a plain loop over the unique
  rows of each table.
"""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS, PooledCase, make_case, make_layout, pooled_reference

from tritonrec.kernels.embedding import OptimType, PoolingMode, create_fused_optimizer_state, pooled_embedding_lookup

LR, EPS = 0.1, 0.01  # an eps this large tells sqrt(m) + eps from sqrt(m + eps)
SUM, MEAN = PoolingMode.SUM, PoolingMode.MEAN

# (dims, rows, poolings, feature -> table, batch size, bag lengths per step)
SHAPES = {
    "d1_b1": ([1], [3], [SUM], [0], 1, [[3], [0], [2]]),  # B = 1, ids repeat in the bag, an empty step
    "d3_mean_shared": ([3], [4], [MEAN], [0, 0], 2, [[2, 0, 3, 1], [0, 0, 0, 4], [1, 2, 2, 0]]),
    "d129": ([129], [5], [SUM], [0], 3, [[2, 0, 3], [4, 1, 0], [0, 0, 2]]),  # two column blocks of 128 in Triton
    "mixed": ([1, 3, 129], [2, 6, 3], [SUM, MEAN, SUM], [0, 1, 2, 1], 2, [[1, 2, 0, 3, 2, 1, 2, 0]] * 3),
}


def _steps(layout, batch_size: int, lengths: list[list[int]], weighted: bool) -> list[PooledCase]:
    return [make_case(layout, ls, batch_size, weighted=weighted, seed=s) for s, ls in enumerate(lengths)]


def _fused_run(backend: str, layout, cases: list[PooledCase], grads: list[torch.Tensor], **hp):
    """Weights and per-element momentum after the fused steps."""
    weights = cases[0].weights.clone()
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD, **hp)
    for case, grad in zip(cases, grads, strict=True):
        pooled_embedding_lookup(
            weights, layout, case.indices, case.offsets, case.per_sample_weights, fused=state, backend=backend
        ).backward(grad)
    assert state.step.tolist() == [len(cases)] * layout.num_tables
    return weights, state.momentum1


def _dense_gradients(layout, weights: torch.Tensor, case: PooledCase, grad: torch.Tensor) -> list[torch.Tensor]:
    """Each table's aggregated gradient ``[rows, dim]`` (duplicates summed by autograd)."""
    flat = weights.detach().clone().requires_grad_()
    pooled_reference(case, flat).backward(grad)
    return [layout.table_view(flat.grad, t) for t in range(layout.num_tables)]


def _torch_adagrad(layout, cases, grads):
    tables = [torch.nn.Parameter(layout.table_view(cases[0].weights, t).clone()) for t in range(layout.num_tables)]
    opt = torch.optim.Adagrad(tables, lr=LR, eps=EPS, lr_decay=0.0, initial_accumulator_value=0.0)
    for case, grad in zip(cases, grads, strict=True):
        flat = torch.cat([t.detach().reshape(-1) for t in tables])
        for table, g in zip(tables, _dense_gradients(layout, flat, case, grad), strict=True):
            table.grad = g.clone()
        opt.step()
    return [t.detach() for t in tables], [opt.state[t]["sum"] for t in tables]


def _row_loop(layout, cases, grads, weight_decay: float):
    """Plainly, per table and unique touched row: ``g += wd * w; m += g*g; w -= lr * g / (sqrt(m) + eps)``."""
    tables = [layout.table_view(cases[0].weights, t).clone() for t in range(layout.num_tables)]
    momenta = [torch.zeros_like(t) for t in tables]
    for case, grad in zip(cases, grads, strict=True):
        flat = torch.cat([t.reshape(-1) for t in tables])
        dense = _dense_gradients(layout, flat, case, grad)
        starts = case.feature_value_offsets()
        for t, (w, m) in enumerate(zip(tables, momenta, strict=True)):
            ids = [case.indices[starts[f] : starts[f + 1]] for f, ft in enumerate(layout.feature_tables) if ft == t]
            for row in sorted(set(torch.cat(ids).tolist())):
                g = dense[t][row] + weight_decay * w[row]
                m[row] += g * g
                w[row] -= LR * g / (m[row].sqrt() + EPS)
    return tables, momenta


def _check(layout, weights, momentum, ref_tables, ref_momenta, tolerance) -> None:
    for t in range(layout.num_tables):
        torch.testing.assert_close(layout.table_view(weights, t), ref_tables[t], **tolerance(torch.float32))
        torch.testing.assert_close(layout.table_view(momentum, t), ref_momenta[t], **tolerance(torch.float32))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_and_twin_match_torch_adagrad(shape, weighted, tolerance):
    dims, rows, poolings, feature_tables, batch_size, lengths = SHAPES[shape]
    layout = make_layout(dims, rows, poolings, feature_tables)
    cases = _steps(layout, batch_size, lengths, weighted)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(batch_size, layout.total_dim, generator=gen) for _ in cases]
    ref_tables, ref_momenta = _torch_adagrad(layout, cases, grads)
    results = {b: _fused_run(b, layout, cases, grads, lr=LR, eps=EPS) for b in BACKENDS}
    for weights, momentum in results.values():
        _check(layout, weights, momentum, ref_tables, ref_momenta, tolerance)
    torch.testing.assert_close(*(r[0] for r in results.values()), **tolerance(torch.float32))
    # rows no batch touched keep their weights and a zero momentum
    touched = torch.zeros(layout.num_weights, dtype=torch.bool)
    for t in range(layout.num_tables):
        touched_t = layout.table_view(touched, t)
        touched_t[(ref_momenta[t] != 0).any(dim=1)] = True
    for weights, momentum in results.values():
        assert torch.equal(weights[~touched], cases[0].weights[~touched])
        assert not momentum[~touched].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_decay_is_l2_on_the_touched_rows_only(backend, tolerance):
    dims, rows, poolings, feature_tables, batch_size, lengths = SHAPES["mixed"]
    layout = make_layout(dims, rows, poolings, feature_tables)
    cases = _steps(layout, batch_size, lengths, weighted=True)
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(batch_size, layout.total_dim, generator=gen) for _ in cases]
    weights, momentum = _fused_run(backend, layout, cases, grads, lr=LR, eps=EPS, weight_decay=0.05)
    _check(layout, weights, momentum, *_row_loop(layout, cases, grads, 0.05), tolerance)


def test_state_is_per_element_and_takes_adagrads_hyperparameters():
    layout = make_layout([3, 5], rows=[4, 2])
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD)
    assert state.momentum1.shape == (layout.num_weights,) and state.momentum2 is None
    assert state.hyperparams == {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0, "initial_accumulator_value": 0.0}
    assert not state.momentum1.any()
    started = create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD, initial_accumulator_value=0.25)
    assert torch.equal(started.momentum1, torch.full((layout.num_weights,), 0.25))  # torch.optim.Adagrad's state_sum
    with pytest.raises(ValueError, match=r"EXACT_ADAGRAD does not take \['betas'\]"):
        create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match=r"eps must be a non-negative number, got eps=-1"):
        create_fused_optimizer_state(layout, OptimType.EXACT_ADAGRAD, eps=-1)
