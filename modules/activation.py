"""``SwishLayerNorm`` (``torchrec.modules.activation``): ``Y = X * sigmoid(LayerNorm(X))``, with torchrec's argument
and parameter names (``norm.0.weight``, ``norm.0.bias``), so a torchrec state dict loads with ``strict=True``."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.kernels.checks import check_int


def _normalized_shape(input_dims: int | list[int] | torch.Size) -> tuple[int, ...]:
    if isinstance(input_dims, (list, tuple)):  # torch.Size is a tuple
        if not input_dims:
            raise ValueError(f"input_dims must name at least one dim, got input_dims={input_dims!r}")
        return tuple(check_int(d, f"input_dims[{i}]", 1) for i, d in enumerate(input_dims))
    return (check_int(input_dims, "input_dims", 1),)


class SwishLayerNorm(nn.Module):
    """Swish gated by a layer norm: ``input [*, *input_dims]`` -> ``input * sigmoid(LayerNorm(input))``, same shape.

    Args:
        input_dims: the trailing dims to normalise over (an int for the last dim; ``[d2, d3]`` normalises an input
            ``[B, d1, d2, d3]`` over its last two dims).
        device: where the layer norm's parameters live.

    Parameters (torchrec's): ``norm.0.weight`` and ``norm.0.bias``, each of shape ``input_dims`` (ones and zeros):
    ``norm`` is ``nn.Sequential(nn.LayerNorm(input_dims), nn.Sigmoid())`` as in torchrec (eps ``1e-5``).
    """

    def __init__(self, input_dims: int | list[int] | torch.Size, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._input_dims = _normalized_shape(input_dims)
        self.norm = nn.Sequential(nn.LayerNorm(self._input_dims, device=device), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [*, *input_dims]`` -> ``[*, *input_dims]``."""
        if not is_fx_symbolic_tracing():
            if not isinstance(input, torch.Tensor) or not input.is_floating_point():
                what = f"dtype {input.dtype}" if isinstance(input, torch.Tensor) else type(input).__name__
                raise TypeError(f"input must be a floating-point tensor, got {what}")
            n = len(self._input_dims)
            if input.dim() < n or tuple(input.shape[input.dim() - n :]) != self._input_dims:
                expected = ", ".join(str(d) for d in self._input_dims)
                raise ValueError(f"input must have shape [*, {expected}] (input_dims), got {tuple(input.shape)}")
        return input * self.norm(input)


__all__ = ["SwishLayerNorm"]
