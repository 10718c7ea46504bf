"""SwishLayerNorm against ``x * sigmoid((x - mean) / sqrt(var + 1e-5) * w + b)`` written out over the trailing dims,
torchrec's state-dict keys and shapes, gradcheck, odd shapes (dim 1, batch 1), bad input naming the argument, and
plain fx tracing equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.modules import SwishLayerNorm


def _swish_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The formula, normalising over ``weight``'s number of trailing dims (biased variance, eps 1e-5)."""
    dims = tuple(range(x.dim() - weight.dim(), x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    normed = (x - mean) / torch.sqrt(var + 1e-5) * weight + bias
    return x * (1 / (1 + torch.exp(-normed)))


@pytest.mark.parametrize(
    ("input_dims", "shape"),
    [(5, (3, 5)), ([2, 3], (4, 7, 2, 3)), (torch.Size([4]), (2, 6, 4)), (1, (1, 1)), ([3], (1, 3)), (5, (5,))],
)
def test_swish_layer_norm_is_the_formula(input_dims: int | list[int] | torch.Size, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    module = SwishLayerNorm(input_dims).double()
    with torch.no_grad():
        module.norm[0].weight.normal_()
        module.norm[0].bias.normal_()
    x = torch.randn(shape, dtype=torch.float64)
    out = module(x)
    assert out.shape == x.shape
    expected = _swish_layer_norm(x, module.norm[0].weight, module.norm[0].bias)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_one_wide_norm_leaves_only_the_bias() -> None:
    # over a single element x - mean = 0, so the gate is sigmoid(bias)
    module = SwishLayerNorm(1)
    with torch.no_grad():
        module.norm[0].bias.fill_(0.7)
    x = torch.randn(4, 1)
    torch.testing.assert_close(module(x), x * torch.sigmoid(torch.tensor(0.7)))


def test_gradients_match_the_formula() -> None:
    module = SwishLayerNorm([2, 3]).double()
    with torch.no_grad():
        module.norm[0].weight.normal_()
    x = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(module, (x,))
    module(x).square().sum().backward()
    weight = module.norm[0].weight.detach().requires_grad_()
    bias = module.norm[0].bias.detach().requires_grad_()
    x_ref = x.detach().requires_grad_()
    _swish_layer_norm(x_ref, weight, bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(module.norm[0].weight.grad, weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(module.norm[0].bias.grad, bias.grad, rtol=1e-12, atol=1e-12)


def test_torchrec_state_dict_loads_strictly() -> None:
    module = SwishLayerNorm([2, 3])
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
        "norm.0.weight": (2, 3),
        "norm.0.bias": (2, 3),
    }
    assert torch.equal(module.norm[0].weight, torch.ones(2, 3)) and torch.equal(module.norm[0].bias, torch.zeros(2, 3))
    weight, bias = torch.randn(2, 3), torch.randn(2, 3)
    module.load_state_dict({"norm.0.weight": weight, "norm.0.bias": bias}, strict=True)
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(module(x), _swish_layer_norm(x, weight, bias))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="input_dims"):
        SwishLayerNorm(0)
    with pytest.raises(ValueError, match=r"input_dims\[1\]"):
        SwishLayerNorm([2, 0])
    with pytest.raises(ValueError, match=r"input_dims must name at least one dim, got input_dims=\[\]"):
        SwishLayerNorm([])
    with pytest.raises(TypeError, match="input_dims"):
        SwishLayerNorm(True)  # type: ignore[arg-type]
    module = SwishLayerNorm([2, 3])
    with pytest.raises(ValueError, match=r"input must have shape \[\*, 2, 3\] \(input_dims\), got \(4, 3, 2\)"):
        module(torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        module(torch.randn(3))
    with pytest.raises(TypeError, match="input must be a floating-point tensor, got dtype torch.int64"):
        module(torch.ones(4, 2, 3, dtype=torch.int64))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.act = SwishLayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def test_traced_module_matches_eager() -> None:
    torch.manual_seed(1)
    model = _Head()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert any(n.op == "call_module" and n.target == "act.norm.0" for n in traced.graph.nodes)
    x = torch.randn(2, 3)
    assert torch.equal(traced(x), model(x))
