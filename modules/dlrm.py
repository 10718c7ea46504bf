"""DLRM ("Deep Learning Recommendation Model", arXiv:1906.00091) with torchrec's names and arguments: ``DLRM`` (dot
product interaction), ``DLRM_DCN`` (DCNv2 low-rank cross interaction) and ``DLRMTrain`` (loss wrapper).

Data flow (``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``Dd`` dense inputs)::

    dense [B, Dd] -> DenseArch -> [B, D] --+
                                           +-> InteractionArch / InteractionDCNArch -> OverArch -> logits [B, 1]
    KJT ---------> SparseArch -> [B, F, D] +

The embedding collection is passed in (a FusedEmbeddingBagCollection whose optimizer runs in the backward, a plain
EmbeddingBagCollection, or later a sharded one): the model never builds tables itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.modules.dlrm_archs import (
    DenseArch,
    InteractionArch,
    InteractionDCNArch,
    LowRankCrossNet,
    OverArch,
    SparseArch,
)


def _shared_embedding_dim(embedding_bag_collection: nn.Module) -> int:
    configs = getattr(embedding_bag_collection, "embedding_bag_configs", None)
    if configs is None or not configs():
        raise ValueError("embedding_bag_collection must be an EmbeddingBagCollection with at least one table")
    dims = {c.name: c.embedding_dim for c in configs()}
    if len(set(dims.values())) != 1:
        raise ValueError(f"DLRM needs one embedding_dim for all tables, got {dims}")
    return next(iter(dims.values()))


def _check_dense_features(dense: torch.Tensor, dense_in_features: int, sparse: KeyedJaggedTensor) -> None:
    """``dense [B, Dd]`` must be a floating tensor with ``Dd == dense_in_features`` and ``B`` the KJT's stride (one
    batch size per key); raises naming the argument and its value (shapes only: no device sync)."""
    if not isinstance(dense, torch.Tensor) or not dense.is_floating_point():
        got = dense.dtype if isinstance(dense, torch.Tensor) else type(dense).__name__
        raise TypeError(f"dense_features must be a floating-point tensor, got {got}")
    if dense.dim() != 2 or dense.shape[1] != dense_in_features:
        raise ValueError(
            f"dense_features must have shape [B, dense_in_features={dense_in_features}], got {tuple(dense.shape)}"
        )
    one_stride = isinstance(sparse, KeyedJaggedTensor) and not sparse.variable_stride_per_key()
    if one_stride and dense.shape[0] != sparse.stride():
        raise ValueError(
            f"dense_features has batch size {dense.shape[0]} but sparse_features has stride {sparse.stride()}"
        )


class DLRM(nn.Module):
    """DLRM with the dot-product interaction.

    Args:
        embedding_bag_collection: pooled embeddings of the sparse features (all tables of one ``embedding_dim`` D).
        dense_in_features: ``Dd``.
        dense_arch_layer_sizes: DenseArch MLP sizes; the last must equal D.
        over_arch_layer_sizes: OverArch sizes (at least two; the last is the number of logits, 1 for CTR).
        dense_device: device of the dense parameters.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dense_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        embedding_dim = _shared_embedding_dim(embedding_bag_collection)
        if not isinstance(dense_arch_layer_sizes, Sequence) or not dense_arch_layer_sizes:
            raise ValueError(f"dense_arch_layer_sizes must list layer sizes, got {dense_arch_layer_sizes!r}")
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"dense_arch_layer_sizes must end with the embedding dim {embedding_dim}, got "
                f"dense_arch_layer_sizes={list(dense_arch_layer_sizes)}"
            )
        self.sparse_arch = SparseArch(embedding_bag_collection)
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        self._dense_in_features = dense_in_features
        self.inter_arch: nn.Module = InteractionArch(num_sparse, dense_device)
        over_in = embedding_dim + math.comb(num_sparse, 2) + num_sparse
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """``dense_features [B, Dd]``, ``sparse_features`` (stride B) -> logits ``[B, over_arch_layer_sizes[-1]]``."""
        if not is_fx_symbolic_tracing():  # train pipelines trace the model with fx proxies
            _check_dense_features(dense_features, self._dense_in_features, sparse_features)
        # The lookup first: a sharded collection returns a lazy awaitable, so its output all-to-all is in flight
        # while the dense arch runs, and in the backward (autograd runs the latest-created ready node first) the dense
        # arch's gradients - and DDP's all-reduce of them - come before the embedding update instead of after it.
        pooled = self.sparse_arch.embedding_bag_collection(sparse_features)
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch.to_tensor(pooled)
        return self.over_arch(self.inter_arch(embedded_dense, embedded_sparse))


class DLRM_DCN(DLRM):  # torchrec's name, underscore included
    """DLRM whose interaction is a low-rank DCNv2 cross network over ``[dense, sparse...]`` (``(F + 1) * D`` wide).

    Args: as :class:`DLRM`, plus ``dcn_num_layers`` cross layers of rank ``dcn_low_rank_dim``.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
        )
        embedding_dim = self.sparse_arch.D
        num_sparse = self.sparse_arch.F
        width = (num_sparse + 1) * embedding_dim
        crossnet = LowRankCrossNet(width, dcn_num_layers, dcn_low_rank_dim)
        self.inter_arch = InteractionDCNArch(num_sparse, crossnet.to(dense_device))
        self.over_arch = OverArch(width, over_arch_layer_sizes, dense_device)


class DLRMTrain(nn.Module):
    """Wraps a DLRM for training: ``forward(batch) -> (loss, (loss, logits, labels))`` (all but the first detached).

    The loss is binary cross-entropy with logits averaged over the batch's valid rows: padded rows
    (``valid_mask`` False) weigh zero, so a padded last batch trains exactly like its real rows alone.
    """

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        if not isinstance(dlrm_module, nn.Module):
            raise TypeError(f"dlrm_module must be an nn.Module, got {type(dlrm_module).__name__}")
        self.model = dlrm_module

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if not isinstance(batch, Batch) and not is_fx_symbolic_tracing():  # train pipelines trace with fx proxies
            raise TypeError(f"batch must be a tritonrec.data.batch.Batch, got {type(batch).__name__}")
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def masked_bce_with_logits(logits: torch.Tensor, labels: torch.Tensor, valid_mask: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy over the rows where ``valid_mask`` is True (``[B]`` each -> scalar; 0 if none)."""
    per_row = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    weights = valid_mask.to(per_row.dtype)
    return (per_row * weights).sum() / weights.sum().clamp(min=1.0)  # clamp instead of a sync-inducing branch
