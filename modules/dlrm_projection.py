"""``DLRM_Projection`` and its ``InteractionProjectionArch`` (torchrec.models.dlrm) with torchrec's arguments and
state-dict keys: DLRM whose interaction is a product of two learned projections instead of all pairwise dot products.

Notation: ``B`` batch, ``F`` sparse embeddings, ``D`` embedding dim. The ``F + 1`` vectors (dense first) are flattened
to ``c [B, (F + 1) * D]``; two MLP branches map it to ``[B, F1 * D]`` and ``[B, D * F2]``, which are read (plain
reshapes, as in torchrec) as ``Y [B, F1, D]`` and ``Z [B, D, F2]``; the interaction is ``Y @ Z [B, F1, F2]``::

    dense [B, D] --+-> c --> branch1 -> Y [B, F1, D] --+
    sparse [B, F, D]   +--> branch2 -> Z [B, D, F2] --+-> bmm -> [B, F1 * F2] -> cat(dense, .) -> [B, D + F1 * F2]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.kernels.checks import check_int
from tritonrec.modules.dlrm import DLRM
from tritonrec.modules.dlrm_archs import DenseArch, OverArch
from tritonrec.modules.input_checks import check_dense_input


class InteractionProjectionArch(nn.Module):
    """``dense_features [B, D]``, ``sparse_features [B, F, D]`` -> ``[B, D + F1 * F2]``: the dense vector followed
    by the flattened ``Y @ Z`` of the two branches (see the module docstring).

    Args:
        num_sparse_features: ``F``; ``F <= 0`` makes the output ``dense_features``.
        interaction_branch1: module ``[B, (F + 1) * D] -> [B, F1 * D]``.
        interaction_branch2: module ``[B, (F + 1) * D] -> [B, F2 * D]``.
    """

    def __init__(
        self, num_sparse_features: int, interaction_branch1: nn.Module, interaction_branch2: nn.Module
    ) -> None:
        super().__init__()
        self.F: int = check_int(num_sparse_features, "num_sparse_features")
        for name, branch in (
            ("interaction_branch1", interaction_branch1),
            ("interaction_branch2", interaction_branch2),
        ):
            if not isinstance(branch, nn.Module):
                raise TypeError(f"{name} must be an nn.Module, got {name}={branch!r}")
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """``dense_features [B, D]``, ``sparse_features [B, F, D]`` -> ``[B, D + F1 * F2]``."""
        if self.F <= 0:
            return dense_features
        check_dense_input(dense_features, "dense_features", "[B, D]", ndim=2)
        if not is_fx_symbolic_tracing():
            batch_size, dim = dense_features.shape
            check_dense_input(sparse_features, "sparse_features", f"[B={batch_size}, F={self.F}, D={dim}]", ndim=3)
            if tuple(sparse_features.shape) != (batch_size, self.F, dim):
                raise ValueError(
                    f"sparse_features must have shape [B={batch_size}, F={self.F}, D={dim}] (dense_features is "
                    f"{tuple(dense_features.shape)}), got {tuple(sparse_features.shape)}"
                )
        batch_size, dim = dense_features.shape[0], dense_features.shape[1]
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1).reshape(batch_size, -1)
        branch1 = self.interaction_branch1(combined)  # [B, F1 * D]
        branch2 = self.interaction_branch2(combined)  # [B, F2 * D]
        if not is_fx_symbolic_tracing():
            for name, out in (("interaction_branch1", branch1), ("interaction_branch2", branch2)):
                if out.dim() != 2 or out.shape[0] != batch_size or out.shape[1] % dim != 0:
                    raise ValueError(
                        f"{name} must return [B={batch_size}, a multiple of D={dim}], got {tuple(out.shape)}"
                    )
        interactions = torch.bmm(branch1.reshape(batch_size, -1, dim), branch2.reshape(batch_size, dim, -1))
        return torch.cat((dense_features, interactions.reshape(batch_size, -1)), dim=1)


def _check_branch_sizes(layer_sizes: object, name: str, embedding_dim: int) -> list[int]:
    """``layer_sizes`` as a list of positive ints whose last is a multiple of ``embedding_dim``."""
    if not isinstance(layer_sizes, Sequence) or isinstance(layer_sizes, str) or not layer_sizes:
        raise ValueError(f"{name} must list at least one layer size, got {name}={layer_sizes!r}")
    sizes = [check_int(size, f"{name}[{i}]", 1) for i, size in enumerate(layer_sizes)]
    if sizes[-1] % embedding_dim != 0:
        raise ValueError(
            f"{name} must end with a multiple of the embedding dim {embedding_dim}, got {name}={list(layer_sizes)}"
        )
    return sizes


class DLRM_Projection(DLRM):  # torchrec's name, underscore included
    """DLRM with :class:`InteractionProjectionArch`: two DenseArch branches over the ``(F + 1) * D`` concatenated
    vectors, their outputs read as ``[B, F1, D]`` and ``[B, D, F2]`` and multiplied.

    Args: as :class:`~tritonrec.modules.DLRM`, plus ``interaction_branch1_layer_sizes`` and
    ``interaction_branch2_layer_sizes`` (DenseArch sizes whose last, ``F1 * D`` and ``F2 * D``, are multiples of
    ``D``). The OverArch takes ``D + F1 * F2`` inputs.

    ``forward(dense_features [B, Dd], sparse_features)`` -> logits ``[B, over_arch_layer_sizes[-1]]``.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        interaction_branch1_layer_sizes: Sequence[int],
        interaction_branch2_layer_sizes: Sequence[int],
        dense_device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
        )
        embedding_dim, num_sparse = self.sparse_arch.D, self.sparse_arch.F
        sizes1 = _check_branch_sizes(interaction_branch1_layer_sizes, "interaction_branch1_layer_sizes", embedding_dim)
        sizes2 = _check_branch_sizes(interaction_branch2_layer_sizes, "interaction_branch2_layer_sizes", embedding_dim)
        branch_in = num_sparse * embedding_dim + embedding_dim  # dense_arch_layer_sizes[-1] == D (checked by DLRM)
        self.inter_arch = InteractionProjectionArch(
            num_sparse_features=num_sparse,
            interaction_branch1=DenseArch(branch_in, sizes1, dense_device),
            interaction_branch2=DenseArch(branch_in, sizes2, dense_device),
        )
        over_in = embedding_dim + (sizes1[-1] // embedding_dim) * (sizes2[-1] // embedding_dim)
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, dense_device)


__all__ = ["DLRM_Projection", "InteractionProjectionArch"]
