"""``SimpleDeepFMNN`` (torchrec.models.deepfm) with torchrec's arguments, parts and state-dict keys.

Data flow (``B`` batch, ``F`` sparse embeddings, ``D`` embedding dim shared by all tables, ``Dd`` dense inputs,
``H`` hidden size, ``DI`` deep FM dimension)::

    dense [B, Dd] -> DenseArch -> [B, D] ----------+
                                                   +-> FMInteractionArch -> [B, D + DI + 1] -> OverArch -> [B, 1]
    KJT ---------> SparseArch -> KeyedTensor F x D +

The parts keep torchrec's names from ``torchrec.models.deepfm``; ``DenseArch``, ``OverArch`` and ``SparseArch`` here
are DeepFM's (a two-layer ReLU MLP, a sigmoid head, the collection's KeyedTensor as is), not DLRM's parts of the same
names in :mod:`tritonrec.modules.dlrm_archs`. ``OverArch`` ends in a sigmoid, so the model returns probabilities
(torchrec calls them logits).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.checks import check_int
from tritonrec.modules.deepfm import DeepFM, FactorizationMachine
from tritonrec.modules.embedding_configs import get_embedding_names
from tritonrec.modules.input_checks import check_dense_input


class SparseArch(nn.Module):
    """The embedding collection's pooled output as is: KJT -> KeyedTensor (``[B, F * D]`` values, one key per
    embedding)."""

    def __init__(self, embedding_bag_collection: nn.Module) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.embedding_bag_collection(features)


class DenseArch(nn.Module):
    """``Linear -> ReLU -> Linear -> ReLU``: ``[B, in_features] -> [B, embedding_dim]`` (keys ``model.0``,
    ``model.2``)."""

    def __init__(self, in_features: int, hidden_layer_size: int, embedding_dim: int) -> None:
        super().__init__()
        in_features = check_int(in_features, "in_features", 1)
        hidden_layer_size = check_int(hidden_layer_size, "hidden_layer_size", 1)
        embedding_dim = check_int(embedding_dim, "embedding_dim", 1)
        self.model = nn.Sequential(
            nn.Linear(in_features, hidden_layer_size), nn.ReLU(), nn.Linear(hidden_layer_size, embedding_dim), nn.ReLU()
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, in_features]`` -> ``[B, embedding_dim]``."""
        return self.model(features)


class FMInteractionArch(nn.Module):
    """DeepFM interaction of ``dense_features [B, D]`` and the sparse KeyedTensor: ``[B, D + DI + 1]``, the dense
    vector, then :class:`DeepFM` (``Linear(fm_in_features, DI) -> ReLU``) and :class:`FactorizationMachine` over the
    list ``[dense, sparse[name] for name in sparse_feature_names]``.

    Args:
        fm_in_features: flat width of that list, ``D + sum`` of the named blocks' widths (``(F + 1) * D``).
        sparse_feature_names: the KeyedTensor keys to read, in order; empty means the output is ``dense_features``.
        deep_fm_dimension: ``DI``.
    """

    def __init__(self, fm_in_features: int, sparse_feature_names: list[str], deep_fm_dimension: int) -> None:
        super().__init__()
        self._fm_in_features = check_int(fm_in_features, "fm_in_features", 1)
        deep_fm_dimension = check_int(deep_fm_dimension, "deep_fm_dimension", 1)
        if isinstance(sparse_feature_names, str) or not all(isinstance(n, str) for n in sparse_feature_names):
            raise TypeError(f"sparse_feature_names must be a list of str, got {sparse_feature_names!r}")
        self.sparse_feature_names: list[str] = list(sparse_feature_names)
        self.deep_fm = DeepFM(dense_module=nn.Sequential(nn.Linear(fm_in_features, deep_fm_dimension), nn.ReLU()))
        self.fm = FactorizationMachine()

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        """``dense_features [B, D]``, ``sparse_features`` (KeyedTensor, ``[B, F * D]``) -> ``[B, D + DI + 1]``."""
        if not self.sparse_feature_names:
            return dense_features
        check_dense_input(dense_features, "dense_features", "[B, D]", ndim=2)
        blocks = [dense_features] + [sparse_features[name] for name in self.sparse_feature_names]
        if not is_fx_symbolic_tracing():
            width = sum(block.shape[1] for block in blocks)
            if width != self._fm_in_features:
                raise ValueError(
                    f"dense_features width {dense_features.shape[1]} plus the widths of sparse_features "
                    f"{self.sparse_feature_names} is {width}, but fm_in_features={self._fm_in_features}"
                )
        return torch.cat([dense_features, self.deep_fm(blocks), self.fm(blocks)], dim=1)


class OverArch(nn.Module):
    """``Linear(in_features, 1) -> Sigmoid``: ``[B, in_features] -> [B, 1]`` probabilities (key ``model.0``)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(check_int(in_features, "in_features", 1), 1), nn.Sigmoid())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, in_features]`` -> ``[B, 1]``."""
        return self.model(features)


class SimpleDeepFMNN(nn.Module):
    """DeepFM recommendation model: dense features projected to the embedding space, DeepFM + FM interaction of all
    ``F + 1`` vectors, and a sigmoid head.

    Args:
        num_dense_features: ``Dd``.
        embedding_bag_collection: pooled embeddings of the sparse features, every table of one ``embedding_dim``
            ``D`` (an :class:`~tritonrec.modules.EmbeddingBagCollection` or one with its API).
        hidden_layer_size: ``H``, the DenseArch's hidden width.
        deep_fm_dimension: ``DI``, the DeepFM part's output width.

    ``forward(dense_features [B, Dd], sparse_features)`` -> ``[B, 1]``.
    """

    def __init__(
        self,
        num_dense_features: int,
        embedding_bag_collection: nn.Module,
        hidden_layer_size: int,
        deep_fm_dimension: int,
    ) -> None:
        super().__init__()
        self._num_dense_features = check_int(num_dense_features, "num_dense_features", 1)
        hidden_layer_size = check_int(hidden_layer_size, "hidden_layer_size", 1)
        deep_fm_dimension = check_int(deep_fm_dimension, "deep_fm_dimension", 1)
        configs = getattr(embedding_bag_collection, "embedding_bag_configs", None)
        if configs is None or not configs():
            raise ValueError("embedding_bag_collection must be an EmbeddingBagCollection with at least one table")
        dims = {config.name: config.embedding_dim for config in configs()}
        if len(set(dims.values())) != 1:
            raise ValueError(f"SimpleDeepFMNN needs one embedding_dim for all tables, got {dims}")
        embedding_dim = next(iter(dims.values()))
        # the collection's output keys: a feature's name, or feature@table for a feature read by several tables
        feature_names = get_embedding_names(configs())
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(self._num_dense_features, hidden_layer_size, embedding_dim)
        self.inter_arch = FMInteractionArch(
            fm_in_features=embedding_dim * (len(feature_names) + 1),
            sparse_feature_names=feature_names,
            deep_fm_dimension=deep_fm_dimension,
        )
        self.over_arch = OverArch(embedding_dim + deep_fm_dimension + 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """``dense_features [B, Dd]``, ``sparse_features`` (stride ``B``) -> ``[B, 1]``."""
        batch_size = None
        if isinstance(sparse_features, KeyedJaggedTensor) and not sparse_features.variable_stride_per_key():
            batch_size = sparse_features.stride()
        rows = "B" if batch_size is None else f"B={batch_size} (the sparse_features stride)"
        check_dense_input(
            dense_features,
            "dense_features",
            f"[{rows}, num_dense_features={self._num_dense_features}]",
            ndim=2,
            last_dim=self._num_dense_features,
            batch_size=batch_size,
        )
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


__all__ = ["DenseArch", "FMInteractionArch", "OverArch", "SimpleDeepFMNN", "SparseArch"]
