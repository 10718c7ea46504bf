"""Plain ``torch.fx.symbolic_trace`` of forwards that build or regroup the sparse types (as torchrec's trace): each
constructor is one ``call_function`` node on the class, ``regroup`` one node, and the ``GraphModule`` computes what
eager does (on inputs other than the traced ones too, gradients included); the eager checks still run, and raise,
when the graph runs."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jt_is_equal, kjt_is_equal
from tritonrec.data import keyed_tensor as keyed_tensor_module
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

KEYS = ["f0", "f1"]
VALUES = torch.tensor([0, 6, 1, 2, 3, 4, 0, 4, 1])
LENGTHS = torch.tensor([2, 0, 3, 1, 2, 1])
WEIGHTS = torch.linspace(0.5, 1.5, 9)
# A second batch that differs from the traced one in every tensor: the graph must not have baked the first in.
VALUES_2 = torch.tensor([3, 1, 4, 1, 0])
LENGTHS_2 = torch.tensor([1, 1, 0, 0, 3, 0])
WEIGHTS_2 = torch.tensor([2.0, 0.5, 1.0, 1.5, 3.0])


class _Forward(nn.Module):
    """``fn(a, b, c)`` as a module (symbolic_trace traces a module's forward)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a, b, c):
        return self.fn(a, b, c)


def _trace(fn: Callable) -> tuple[nn.Module, torch.fx.GraphModule]:
    eager = _Forward(fn)
    return eager, torch.fx.symbolic_trace(eager)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _assert_same_kjt(got: KeyedJaggedTensor, want: KeyedJaggedTensor) -> None:
    assert type(got) is KeyedJaggedTensor
    assert got.keys() == want.keys() and got.stride() == want.stride()
    assert torch.equal(got.values(), want.values()) and torch.equal(got.lengths(), want.lengths())
    assert torch.equal(got.offsets(), want.offsets())
    assert (got.weights_or_none() is None) == (want.weights_or_none() is None)
    if want.weights_or_none() is not None:
        assert torch.equal(got.weights(), want.weights())
    assert got.length_per_key_or_none() == want.length_per_key_or_none()
    assert got.offset_per_key_or_none() == want.offset_per_key_or_none()


KJT_BUILDERS: dict[str, Callable] = {
    "ctor_lengths": lambda v, n, w: KeyedJaggedTensor(keys=KEYS, values=v, lengths=n, weights=w),
    "ctor_offsets": lambda v, n, w: KeyedJaggedTensor(KEYS, v, w, offsets=_offsets(n)),
    "from_lengths_sync": lambda v, n, w: KeyedJaggedTensor.from_lengths_sync(KEYS, v, n, weights=w),
    "from_offsets_sync": lambda v, n, w: KeyedJaggedTensor.from_offsets_sync(KEYS, v, _offsets(n), weights=w),
}


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("build", list(KJT_BUILDERS))
def test_traced_kjt_construction_matches_eager(build: str, weighted: bool) -> None:
    eager, traced = _trace(KJT_BUILDERS[build])
    assert any(n.op == "call_function" and n.target is KeyedJaggedTensor for n in traced.graph.nodes)
    for values, lengths, weights in ((VALUES, LENGTHS, WEIGHTS), (VALUES_2, LENGTHS_2, WEIGHTS_2)):
        weights = weights if weighted else None
        _assert_same_kjt(traced(values, lengths, weights), eager(values, lengths, weights))


def test_traced_jagged_tensor_construction_matches_eager() -> None:
    eager, traced = _trace(lambda v, n, w: JaggedTensor(values=v, lengths=n, weights=w))
    for values, lengths, weights in ((VALUES, LENGTHS, WEIGHTS), (VALUES_2, LENGTHS_2, WEIGHTS_2)):
        got, want = traced(values, lengths, weights), eager(values, lengths, weights)
        assert type(got) is JaggedTensor
        assert torch.equal(got.values(), want.values()) and torch.equal(got.lengths(), want.lengths())
        assert torch.equal(got.offsets(), want.offsets()) and torch.equal(got.weights(), want.weights())


def _assert_same_kt(got: KeyedTensor, want: KeyedTensor) -> None:
    assert type(got) is KeyedTensor
    assert got.keys() == want.keys() and got.key_dim() == want.key_dim()
    assert got.length_per_key() == want.length_per_key() and torch.equal(got.values(), want.values())


KT_BUILDERS: dict[str, Callable] = {
    "ctor": lambda a, b, c: KeyedTensor(["a", "b"], [4, 2], torch.cat([a, b], dim=1)),
    "from_tensor_list": lambda a, b, c: KeyedTensor.from_tensor_list(["a", "b", "c"], [a, b, c]),
    "from_tensor_list_key_dim_0": lambda a, b, c: KeyedTensor.from_tensor_list(
        ["a", "b"], [a.t(), b.t()], key_dim=0, cat_dim=0
    ),
}


@pytest.mark.parametrize("build", list(KT_BUILDERS))
def test_traced_keyed_tensor_construction_matches_eager(build: str) -> None:
    eager, traced = _trace(KT_BUILDERS[build])
    for batch in (3, 1):
        a, b, c = torch.randn(batch, 4), torch.randn(batch, 2), torch.randn(batch, 1)
        _assert_same_kt(traced(a, b, c), eager(a, b, c))


def _kts(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[KeyedTensor]:
    return [KeyedTensor(["a", "b"], [4, 2], torch.cat([a, b], dim=1)), KeyedTensor.from_tensor_list(["c"], [c])]


GROUPS = [["c", "a"], ["b"], ["a", "b", "c"]]  # keys from both inputs, one of them in two groups
REGROUPS: dict[str, Callable] = {
    "regroup": lambda a, b, c: KeyedTensor.regroup(_kts(a, b, c), GROUPS),
    "regroup_as_dict": lambda a, b, c: KeyedTensor.regroup_as_dict(_kts(a, b, c), GROUPS, ["x", "y", "z"]),
}


@pytest.mark.parametrize("op", list(REGROUPS))
def test_traced_regroup_matches_eager_with_gradients(op: str) -> None:
    eager, traced = _trace(REGROUPS[op])
    for batch in (3, 1):
        inputs = [torch.randn(batch, d, dtype=torch.float64) for d in (4, 2, 1)]
        grads = []
        for model in (eager, traced):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = model(*leaves)
            out = list(out.values()) if op == "regroup_as_dict" else out
            torch.manual_seed(0)
            sum((o * torch.randn_like(o)).sum() for o in out).backward()
            grads.append(([o.detach() for o in out], [t.grad for t in leaves]))
        (got_out, got_grads), (want_out, want_grads) = grads
        assert len(got_out) == len(GROUPS)
        for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    if op == "regroup":
        assert isinstance(traced(*inputs), list)
    else:
        assert list(traced(*inputs)) == ["x", "y", "z"]


def test_regroup_gradient_against_gradcheck_through_the_trace() -> None:
    """The traced regroup is differentiable on its own (not only equal to eager): float64 gradcheck."""
    _, traced = _trace(REGROUPS["regroup"])
    inputs = tuple(torch.randn(2, d, dtype=torch.float64, requires_grad=True) for d in (4, 2, 1))
    assert torch.autograd.gradcheck(lambda *x: tuple(traced(*x)), inputs)


class _EbcModel(nn.Module):
    """torchrec-style forward: build the KJT, look it up, regroup the pooled KeyedTensor with a dense one."""

    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t0", feature_names=["f0"]),
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=3, name="t1", feature_names=["f1"]),
        ]
        self.ebc = EmbeddingBagCollection(tables, backend="torch")

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> list[torch.Tensor]:
        pooled = self.ebc(KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths))
        dense_kt = KeyedTensor.from_tensor_list(["dense"], [dense])
        return KeyedTensor.regroup([pooled, dense_kt], [["f1", "dense"], ["f0"]])


def test_traced_embedding_model_matches_eager_with_parameter_gradients() -> None:
    eager = _EbcModel()
    traced = torch.fx.symbolic_trace(copy.deepcopy(eager))
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["ebc"]
    calls = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert calls.count(keyed_tensor_module._regroup) == 1 and KeyedJaggedTensor in calls
    for values, lengths in ((VALUES, LENGTHS), (VALUES_2, LENGTHS_2)):
        dense = torch.randn(3, 2)
        outs, grads = [], []
        for model in (eager, traced):
            model.zero_grad()
            out = model(values, lengths, dense)
            sum(o.square().sum() for o in out).backward()
            outs.append(out)
            grads.append({name: p.grad for name, p in model.named_parameters()})
        for got, want in zip(outs[1], outs[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert grads[1].keys() == grads[0].keys()
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def _jt(v: torch.Tensor, n: torch.Tensor, w: torch.Tensor | None) -> JaggedTensor:
    return JaggedTensor(values=v, lengths=n, weights=w)


def _kjt(v: torch.Tensor, n: torch.Tensor, w: torch.Tensor | None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=KEYS, values=v, lengths=n, weights=w)


# Static constructors and comparisons that inspect their arguments: one wrapped node each (torchrec traces these).
MORE_OPS: dict[str, Callable] = {
    "concat": lambda v, n, w: KeyedJaggedTensor.concat([_kjt(v, n, w), KeyedJaggedTensor(["g", "h"], v, w, lengths=n)]),
    "empty_like": lambda v, n, w: KeyedJaggedTensor.empty_like(_kjt(v, n, w)),
    "from_jt_dict": lambda v, n, w: KeyedJaggedTensor.from_jt_dict({"x": _jt(v, n, w), "y": _jt(v, n[:3], w)}),
    "from_dense_lengths": lambda v, n, w: JaggedTensor.from_dense_lengths(
        v[:4].view(2, 2), n[:2].clamp(max=2), weights=v[:4].view(2, 2) * 0.5
    ),
    "kjt_is_equal": lambda v, n, w: kjt_is_equal(_kjt(v, n, w), KeyedJaggedTensor.from_lengths_sync(KEYS, v, n, w)),
    "jt_is_equal": lambda v, n, w: jt_is_equal(_jt(v, n, w), _jt(v, n.flip(0), w)),
}


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("op", list(MORE_OPS))
def test_traced_static_constructors_match_eager(op: str, weighted: bool) -> None:
    eager, traced = _trace(MORE_OPS[op])
    for values, lengths, weights in ((VALUES, LENGTHS, WEIGHTS), (VALUES_2, LENGTHS_2, WEIGHTS_2)):
        weights = weights if weighted else None
        got, want = traced(values, lengths, weights), eager(values, lengths, weights)
        if isinstance(want, KeyedJaggedTensor):
            _assert_same_kjt(got, want)
        elif isinstance(want, JaggedTensor):
            assert type(got) is JaggedTensor and jt_is_equal(got, want)
            assert (got.weights_or_none() is None) == (want.weights_or_none() is None)
        else:
            assert got is want


def test_traced_graph_module_pickles() -> None:
    eager, traced = _trace(KJT_BUILDERS["from_lengths_sync"])
    restored = pickle.loads(pickle.dumps(traced))
    _assert_same_kjt(restored(VALUES_2, LENGTHS_2, WEIGHTS_2), eager(VALUES_2, LENGTHS_2, WEIGHTS_2))


BAD_INPUTS = [
    # (forward, inputs, exception type, message fragment naming the argument)
    (KJT_BUILDERS["ctor_lengths"], (VALUES, LENGTHS.float(), None), TypeError, "lengths"),
    (KJT_BUILDERS["ctor_lengths"], (VALUES, LENGTHS[:5], None), ValueError, "lengths"),
    (KJT_BUILDERS["from_lengths_sync"], (VALUES[:4], LENGTHS, None), ValueError, "lengths"),
    (KJT_BUILDERS["ctor_lengths"], (VALUES, LENGTHS, WEIGHTS[:4]), ValueError, "weights"),
    (lambda v, n, w: JaggedTensor(values=v, lengths=n), (VALUES, LENGTHS.float(), None), TypeError, "lengths"),
    (KT_BUILDERS["ctor"], (torch.randn(3, 4), torch.randn(3, 3), None), ValueError, "length_per_key"),
    (REGROUPS["regroup"], (torch.randn(3, 4), torch.randn(3, 2), torch.randn(2, 1)), ValueError, "groups[0]"),
    (KT_BUILDERS["from_tensor_list"], (torch.randn(3, 4), torch.randn(2, 2), torch.randn(3, 1)), RuntimeError, "size"),
    (MORE_OPS["concat"], (VALUES, LENGTHS, WEIGHTS[:3]), ValueError, "weights"),
    (MORE_OPS["from_dense_lengths"], (VALUES, LENGTHS.float(), None), TypeError, "lengths"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_traced_graph_raises_the_eager_error_on_bad_input(case: int) -> None:
    fn, inputs, error, fragment = BAD_INPUTS[case]
    eager, traced = _trace(fn)
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")) as eager_error:
        eager(*inputs)
    with pytest.raises(error) as traced_error:
        traced(*inputs)
    assert str(traced_error.value) == str(eager_error.value)
