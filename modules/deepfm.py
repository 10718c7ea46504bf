"""DeepFM's two interaction parts (arXiv:1703.04247) with torchrec's names and semantics (``torchrec.modules.deepfm``):
:class:`DeepFM`, the deep part (any dense module over the flattened embeddings), and :class:`FactorizationMachine`,
the second-order part.

Both take a list of embedding tensors of one batch size ``B``, each ``[B, ...]`` (typically ``[B, F_i, D_i]``, or a
``[B, D]`` dense embedding), and flatten and concatenate them to ``x [B, M]``, ``M = sum_i F_i * D_i``.

Note that torchrec's FactorizationMachine, and so this one, works on that flat ``x``: it sums the products of all
pairs of its ``M`` scalars, ``sum_{i<j} x_i x_j = 0.5 * ((sum_i x_i)^2 - sum_i x_i^2)``, i.e. each scalar is its own
one-dimensional field. (The paper's FM sums, per embedding dimension, the products of pairs of *fields*; the two
agree only when every embedding is one scalar.)
"""

from __future__ import annotations

import torch
from torch import nn


def flatten_embeddings(embeddings: list[torch.Tensor]) -> torch.Tensor:
    """``embeddings`` (a non-empty list of ``[B, ...]`` floating tensors, one ``B``) -> ``[B, M]``: each flattened
    from dim 1 on, then concatenated in list order. A leaf to ``torch.fx`` (as in torchrec), so a graph traced with
    the list as one input keeps it whole, and these checks run when the graph runs."""
    if not isinstance(embeddings, (list, tuple)) or not embeddings:
        raise ValueError(f"embeddings must be a non-empty list of [B, ...] tensors, got {embeddings!r}")
    batch_size = None
    for i, embedding in enumerate(embeddings):
        if not isinstance(embedding, torch.Tensor) or not embedding.is_floating_point():
            got = embedding.dtype if isinstance(embedding, torch.Tensor) else type(embedding).__name__
            raise TypeError(f"embeddings[{i}] must be a floating-point tensor, got {got}")
        if embedding.dim() < 2:
            raise ValueError(
                f"embeddings[{i}] must have shape [B, ...] with at least 2 dims, got {tuple(embedding.shape)}"
            )
        if batch_size is None:
            batch_size = embedding.shape[0]
        elif embedding.shape[0] != batch_size:
            raise ValueError(
                f"embeddings must share one batch size: embeddings[0] has {batch_size} rows, embeddings[{i}] has "
                f"shape {tuple(embedding.shape)}"
            )
    return torch.cat([embedding.flatten(1) for embedding in embeddings], dim=1)


torch.fx.wrap("flatten_embeddings")


class DeepFM(nn.Module):
    """DeepFM's deep component: ``dense_module`` over the flattened, concatenated embeddings.

    Args:
        dense_module: any module taking ``[B, M]`` (``M`` the flat width of the embeddings it will see, e.g. an MLP
            or ``nn.Linear(M, out)``); registered as ``dense_module`` (torchrec's state-dict prefix).

    ``forward(embeddings)``: list of ``[B, ...]`` tensors -> ``dense_module(x)`` for the flat ``x [B, M]``.
    """

    def __init__(self, dense_module: nn.Module) -> None:
        super().__init__()
        if not isinstance(dense_module, nn.Module):
            raise TypeError(f"dense_module must be an nn.Module, got dense_module={dense_module!r}")
        self.dense_module = dense_module

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        """``embeddings`` (``[B, ...]`` each) -> ``dense_module([B, M])``."""
        return self.dense_module(flatten_embeddings(embeddings))


class FactorizationMachine(nn.Module):
    """DeepFM's second-order component on the flat ``x [B, M]`` of the embeddings (no parameters):
    ``0.5 * ((sum_i x_i)^2 - sum_i x_i^2)``, the sum of ``x_i x_j`` over all pairs ``i < j`` -> ``[B, 1]``. See the
    module docstring for how this differs from the paper's per-field FM."""

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        """``embeddings`` (``[B, ...]`` each) -> ``[B, 1]``."""
        flat = flatten_embeddings(embeddings)
        sum_of_inputs = flat.sum(dim=1, keepdim=True)
        sum_of_squares = (flat * flat).sum(dim=1, keepdim=True)
        return 0.5 * (sum_of_inputs * sum_of_inputs - sum_of_squares)


__all__ = ["DeepFM", "FactorizationMachine", "flatten_embeddings"]
