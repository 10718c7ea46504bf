"""Cross networks with torchrec's names, arguments, parameter names and shapes (``torchrec.modules.crossnet``), so a
torchrec state dict loads with ``strict=True`` and gives the same outputs.

Every net maps ``[B, N] -> [B, N]`` (``B`` batch, ``N = in_features``) through ``num_layers`` "crossing" layers that
multiply the input ``x_0`` element-wise with a projection of the current ``x_l``:

* :class:`CrossNet` (DCN-v2 full rank, arXiv:2008.13535): ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, ``W_l [N, N]``.
* :class:`LowRankCrossNet`: ``W_l`` factored as ``[N, r] @ [r, N]`` (defined with DLRM's parts, re-exported here).
* :class:`VectorCrossNet` (DCN-v1, arXiv:1708.05123): ``x_{l+1} = x_0 (x_l . w_l) + b_l + x_l``, ``w_l [N]``.
* :class:`LowRankMixtureCrossNet` (DCN-v2's mixture of low-rank experts): ``K`` experts
  ``x_0 * (U_k g(C_k g(V_k x_l)) + b_l)`` combined by a softmax gate on ``x_l``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tritonrec.kernels.checks import check_int
from tritonrec.modules.dlrm_archs import LowRankCrossNet
from tritonrec.modules.input_checks import check_dense_input


def _xavier_normal(*shape: int) -> nn.Parameter:
    return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class CrossNet(nn.Module):
    """Full-rank cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, ``input [B, N] -> [B, N]``.

    Args:
        in_features: ``N``.
        num_layers: number of cross layers (at least 1).

    Parameters (torchrec's): ``kernels.{l}`` ``[N, N]`` (Xavier normal), ``bias.{l}`` ``[N, 1]`` (zeros).
    """

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._in_features = check_int(in_features, "in_features", 1)
        self._num_layers = check_int(num_layers, "num_layers", 1)
        n = self._in_features
        self.kernels = nn.ParameterList([_xavier_normal(n, n) for _ in range(self._num_layers)])
        self.bias = nn.ParameterList([_zeros(n, 1) for _ in range(self._num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [B, N]`` -> ``[B, N]``."""
        check_dense_input(input, "input", f"[B, in_features={self._in_features}]", ndim=2, last_dim=self._in_features)
        x_0 = x_l = input
        for layer in range(self._num_layers):
            # row-wise W_l x_l is x_l @ W_l^T; the [N, 1] bias is kept in torchrec's shape and flattened here
            projected = nn.functional.linear(x_l, self.kernels[layer], self.bias[layer].squeeze(1))
            x_l = x_0 * projected + x_l
        return x_l


class VectorCrossNet(nn.Module):
    """DCN-v1 cross layers with one weight vector each: ``x_{l+1} = x_0 (x_l . w_l) + b_l + x_l`` (the scalar
    ``x_l . w_l`` scales ``x_0``; the bias is added outside the product, as in the paper and torchrec's code),
    ``input [B, N] -> [B, N]``.

    Args:
        in_features: ``N``.
        num_layers: number of cross layers (at least 1).

    Parameters (torchrec's): ``kernels.{l}`` ``[N, 1]`` (Xavier normal), ``bias.{l}`` ``[N, 1]`` (zeros).
    """

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._in_features = check_int(in_features, "in_features", 1)
        self._num_layers = check_int(num_layers, "num_layers", 1)
        n = self._in_features
        self.kernels = nn.ParameterList([_xavier_normal(n, 1) for _ in range(self._num_layers)])
        self.bias = nn.ParameterList([_zeros(n, 1) for _ in range(self._num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [B, N]`` -> ``[B, N]``."""
        check_dense_input(input, "input", f"[B, in_features={self._in_features}]", ndim=2, last_dim=self._in_features)
        x_0 = x_l = input
        for layer in range(self._num_layers):
            scale = torch.matmul(x_l, self.kernels[layer])  # [B, 1]: x_l . w_l per row
            x_l = x_0 * scale + self.bias[layer].squeeze(1) + x_l
        return x_l


class LowRankMixtureCrossNet(nn.Module):
    """DCN-v2's mixture of low-rank experts, ``input [B, N] -> [B, N]``. Layer ``l``, expert ``k`` (rank ``r``)::

        expert_k = x_0 * (U_k g(C_k g(V_k x_l)) + b_l)          U_k [N, r], C_k [r, r], V_k [r, N]
        x_{l+1}  = sum_k softmax_k(G x_l) expert_k + x_l        G [K, N]: one bias-free Linear(N, 1) per expert

    With one expert there is no gate: ``x_{l+1} = expert_0 + x_l``.

    Args:
        in_features: ``N``.
        num_layers: number of cross layers (at least 1).
        num_experts: ``K`` (at least 1).
        low_rank: ``r`` (at least 1).
        activation: ``g``, a module or a function (default ``torch.relu``). It is called, as in torchrec, on one
            expert's ``[rows, r, 1]`` at a time (here all experts' rows at once), so it must treat dim 0 as a batch
            (element-wise functions, ``nn.PReLU(r)``, ``nn.Softmax(dim=1)`` all do). A module is a submodule: its
            parameters are in the state dict under ``_activation``, as in torchrec.

    Parameters (torchrec's): ``U_kernels.{l}`` ``[K, N, r]``, ``V_kernels.{l}`` ``[K, r, N]``, ``C_kernels.{l}``
    ``[K, r, r]`` (Xavier normal), ``bias.{l}`` ``[N, 1]`` (zeros), ``gates.{k}.weight`` ``[1, N]`` when ``K > 1``.
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        num_experts: int = 1,
        low_rank: int = 1,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
    ) -> None:
        super().__init__()
        self._in_features = check_int(in_features, "in_features", 1)
        self._num_layers = check_int(num_layers, "num_layers", 1)
        self._num_experts = check_int(num_experts, "num_experts", 1)
        self._low_rank = check_int(low_rank, "low_rank", 1)
        if not callable(activation):
            raise TypeError(f"activation must be an nn.Module or a callable, got activation={activation!r}")
        n, k, r = self._in_features, self._num_experts, self._low_rank
        self.U_kernels = nn.ParameterList([_xavier_normal(k, n, r) for _ in range(self._num_layers)])
        self.V_kernels = nn.ParameterList([_xavier_normal(k, r, n) for _ in range(self._num_layers)])
        self.bias = nn.ParameterList([_zeros(n, 1) for _ in range(self._num_layers)])
        self.gates = nn.ModuleList([nn.Linear(n, 1, bias=False) for _ in range(k)]) if k > 1 else None
        self._activation = activation
        self.C_kernels = nn.ParameterList([_xavier_normal(k, r, r) for _ in range(self._num_layers)])

    def _activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """``g`` on ``hidden [B, K, r]``, called on ``[B * K, r, 1]`` (torchrec's per-expert ``[B, r, 1]`` shape)."""
        return self._activation(hidden.reshape(-1, self._low_rank, 1)).reshape_as(hidden)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [B, N]`` -> ``[B, N]``."""
        check_dense_input(input, "input", f"[B, in_features={self._in_features}]", ndim=2, last_dim=self._in_features)
        x_0 = x_l = input
        for layer in range(self._num_layers):
            # all K experts at once: [B, N] -> [B, K, r] -> [B, K, r] -> [B, K, N]
            hidden = self._activate(torch.einsum("bn,krn->bkr", x_l, self.V_kernels[layer]))
            hidden = self._activate(torch.einsum("bkr,kqr->bkq", hidden, self.C_kernels[layer]))
            projected = torch.einsum("bkr,knr->bkn", hidden, self.U_kernels[layer])
            experts = x_0.unsqueeze(1) * (projected + self.bias[layer].squeeze(1))  # [B, K, N]
            if self.gates is None:
                x_l = experts.squeeze(1) + x_l
            else:
                gate_weight = torch.cat([gate.weight for gate in self.gates])  # [K, N]
                weights = torch.softmax(nn.functional.linear(x_l, gate_weight), dim=1)  # [B, K]
                x_l = torch.bmm(weights.unsqueeze(1), experts).squeeze(1) + x_l
        return x_l


__all__ = ["CrossNet", "LowRankCrossNet", "LowRankMixtureCrossNet", "VectorCrossNet"]
