"""The cross nets against their papers' layer formulas written per sample, torchrec's state-dict keys and shapes,
gradients (gradcheck in float64), odd shapes, bad arguments and inputs, and plain fx tracing inside a model."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from tritonrec.modules import CrossNet, LowRankCrossNet, LowRankMixtureCrossNet, VectorCrossNet


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-zero biases and a float64 copy, so every term of the formulas is exercised at a tight tolerance."""
    generator = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.5)
    return module


def _cross_reference(net: CrossNet, x: torch.Tensor) -> torch.Tensor:
    """DCN-v2: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` with column vectors, one sample at a time."""
    rows = []
    for x_0 in x:
        x_l = x_0
        for w, b in zip(net.kernels, net.bias, strict=True):
            x_l = x_0 * (w @ x_l + b[:, 0]) + x_l
        rows.append(x_l)
    return torch.stack(rows)


def _vector_reference(net: VectorCrossNet, x: torch.Tensor) -> torch.Tensor:
    """DCN-v1: ``x_{l+1} = x_0 x_l^T w_l + b_l + x_l`` (the bias outside the product), one sample at a time."""
    rows = []
    for x_0 in x:
        x_l = x_0
        for w, b in zip(net.kernels, net.bias, strict=True):
            x_l = x_0 * torch.dot(x_l, w[:, 0]) + b[:, 0] + x_l
        rows.append(x_l)
    return torch.stack(rows)


def _low_rank_reference(net: LowRankCrossNet, x: torch.Tensor) -> torch.Tensor:
    """``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``."""
    rows = []
    for x_0 in x:
        x_l = x_0
        for w, v, b in zip(net.W_kernels, net.V_kernels, net.bias, strict=True):
            x_l = x_0 * (w @ (v @ x_l) + b) + x_l
        rows.append(x_l)
    return torch.stack(rows)


def _mixture_reference(net: LowRankMixtureCrossNet, x: torch.Tensor, g=torch.relu) -> torch.Tensor:
    """DCN-v2 mixture: ``expert_k = x_0 * (U_k g(C_k g(V_k x_l)) + b_l)``, mixed by ``softmax_k(gate_k . x_l)``
    (no gate for one expert), plus ``x_l``; one sample and one expert at a time."""
    num_experts = net.U_kernels[0].shape[0]
    rows = []
    for x_0 in x:
        x_l = x_0
        for u, c, v, b in zip(net.U_kernels, net.C_kernels, net.V_kernels, net.bias, strict=True):
            experts = [x_0 * (u[k] @ g(c[k] @ g(v[k] @ x_l)) + b[:, 0]) for k in range(num_experts)]
            if num_experts == 1:
                x_l = experts[0] + x_l
            else:
                scores = torch.stack([torch.dot(gate.weight[0], x_l) for gate in net.gates])
                weights = torch.exp(scores) / torch.exp(scores).sum()
                x_l = sum(w * e for w, e in zip(weights, experts, strict=True)) + x_l
        rows.append(x_l)
    return torch.stack(rows)


# (constructor, reference) for each net; sizes (in_features, num_layers) vary per case below
NETS = {
    "cross": (lambda n, layers: CrossNet(n, layers), _cross_reference),
    "vector": (lambda n, layers: VectorCrossNet(n, layers), _vector_reference),
    "low_rank": (lambda n, layers: LowRankCrossNet(n, layers, low_rank=2), _low_rank_reference),
    "mixture_1": (lambda n, layers: LowRankMixtureCrossNet(n, layers, num_experts=1, low_rank=2), _mixture_reference),
    "mixture_3": (lambda n, layers: LowRankMixtureCrossNet(n, layers, num_experts=3, low_rank=2), _mixture_reference),
}


@pytest.mark.parametrize("kind", sorted(NETS))
@pytest.mark.parametrize(("batch", "in_features", "num_layers"), [(5, 8, 3), (1, 1, 1), (3, 129, 2)])
def test_net_is_its_layer_formula(kind: str, batch: int, in_features: int, num_layers: int) -> None:
    build, reference = NETS[kind]
    torch.manual_seed(0)
    net = _randomize(build(in_features, num_layers))
    x = torch.randn(batch, in_features, dtype=torch.float64)
    out = net(x)
    assert out.shape == (batch, in_features)
    torch.testing.assert_close(out, reference(net, x), rtol=1e-10, atol=1e-10)


def test_mixture_activation_is_called_per_expert_on_rank_columns() -> None:
    """A module activation acting along dim 1 (torchrec calls it on one expert's [B, r, 1]) sees the rank dim."""
    net = _randomize(LowRankMixtureCrossNet(6, 2, num_experts=3, low_rank=4, activation=nn.Softmax(dim=1)))
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = _mixture_reference(net, x, g=lambda h: torch.softmax(h, dim=0))
    torch.testing.assert_close(net(x), expected, rtol=1e-10, atol=1e-10)
    prelu = LowRankMixtureCrossNet(6, 1, num_experts=2, low_rank=4, activation=nn.PReLU(4))
    assert prelu.state_dict()["_activation.weight"].shape == (4,)  # torchrec keeps the module's parameters too


@pytest.mark.parametrize("kind", sorted(NETS))
def test_gradients_match_finite_differences(kind: str) -> None:
    torch.manual_seed(1)
    net = _randomize(NETS[kind][0](4, 2))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    params = tuple(net.parameters())

    names = [name for name, _ in net.named_parameters()]

    def run(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, dict(zip(names, values, strict=True)), (x,))

    # relu's kink: the mixture's default activation is piecewise linear, random points avoid it almost surely
    assert torch.autograd.gradcheck(run, (x, *params), fast_mode=True)
    net(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_state_dict_keys_and_shapes_are_torchrecs() -> None:
    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in module.state_dict().items()}

    assert shapes(CrossNet(5, 2)) == {"kernels.0": (5, 5), "kernels.1": (5, 5), "bias.0": (5, 1), "bias.1": (5, 1)}
    assert shapes(VectorCrossNet(5, 1)) == {"kernels.0": (5, 1), "bias.0": (5, 1)}
    assert shapes(LowRankCrossNet(5, 1, low_rank=2)) == {"W_kernels.0": (5, 2), "V_kernels.0": (2, 5), "bias.0": (5,)}
    assert shapes(LowRankMixtureCrossNet(5, 1, num_experts=3, low_rank=2)) == {
        "U_kernels.0": (3, 5, 2),
        "V_kernels.0": (3, 2, 5),
        "bias.0": (5, 1),
        "gates.0.weight": (1, 5),
        "gates.1.weight": (1, 5),
        "gates.2.weight": (1, 5),
        "C_kernels.0": (3, 2, 2),
    }
    assert "gates.0.weight" not in LowRankMixtureCrossNet(5, 1, num_experts=1).state_dict()
    for net in (CrossNet(5, 2), VectorCrossNet(5, 2), LowRankMixtureCrossNet(5, 2)):
        assert all(torch.equal(b, torch.zeros_like(b)) for b in net.bias)  # torchrec's zero-initialised biases


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: CrossNet(0, 2), "in_features"),
        (lambda: CrossNet(4, 0), "num_layers"),
        (lambda: VectorCrossNet(4.0, 2), "in_features"),
        (lambda: VectorCrossNet(4, -1), "num_layers"),
        (lambda: LowRankMixtureCrossNet(4, 2, num_experts=0), "num_experts"),
        (lambda: LowRankMixtureCrossNet(4, 2, low_rank=0), "low_rank"),
        (lambda: LowRankMixtureCrossNet(4, True), "num_layers"),
        (lambda: LowRankMixtureCrossNet(4, 2, activation="relu"), "activation"),
    ],
)
def test_bad_arguments_are_named(build, argument: str) -> None:
    with pytest.raises((TypeError, ValueError), match=argument):
        build()


@pytest.mark.parametrize("kind", sorted(NETS))
@pytest.mark.parametrize("shape", [(3, 5), (4,), (2, 3, 4), (3, 4, 1)])
def test_wrong_input_shape_is_named(kind: str, shape: tuple[int, ...]) -> None:
    net = NETS[kind][0](4, 2)
    with pytest.raises(ValueError, match=re.escape(f"input must have shape [B, in_features=4], got {shape}")):
        net(torch.randn(shape))
    with pytest.raises(TypeError, match="input must be a floating-point tensor"):
        net(torch.ones(3, 4, dtype=torch.int64))


class _Tower(nn.Module):
    """A cross net between two dense layers, as a model would place it."""

    def __init__(self, net: nn.Module, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(3, in_features)
        self.net = net
        self.head = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(self.proj(x)))


@pytest.mark.parametrize("kind", sorted(NETS))
def test_fx_traced_model_matches_eager(kind: str) -> None:
    torch.manual_seed(2)
    model = _Tower(NETS[kind][0](6, 2), 6)
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    x = torch.randn(4, 3)
    eager_out, traced_out = model(x), traced(x)
    assert torch.equal(eager_out, traced_out)
    eager_out.sum().backward()
    traced_out.sum().backward()
    traced_grads = dict(traced.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, traced_grads[name].grad), name
