"""The parts of DLRM (torchrec names, argument order and state-dict keys): MLP, SparseArch, DenseArch, the dot
product InteractionArch, the DCNv2 InteractionDCNArch with its LowRankCrossNet, and OverArch.

Notation: ``B`` batch size, ``F`` sparse features, ``D`` embedding dim (shared by all tables), ``Dd`` dense inputs.
Only the SparseArch touches embeddings; every other arch is plain torch, so sharding can swap the embedding module
without touching them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.checks import check_int
from tritonrec.modules.embedding_configs import get_embedding_names
from tritonrec.modules.embedding_modules import EmbeddingBagCollection
from tritonrec.modules.feature_processor import FeatureProcessedEmbeddingBagCollection
from tritonrec.modules.input_checks import check_dense_input
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

# Collections whose output KeyedTensor lists the embedding names in config order (what SparseArch reads), so a
# graph traced through SparseArch takes their values as they are.
_KEYED_IN_CONFIG_ORDER = (EmbeddingBagCollection, FeatureProcessedEmbeddingBagCollection, QuantEmbeddingBagCollection)


def _check_layer_sizes(layer_sizes: object, name: str, min_layers: int = 1) -> list[int]:
    if not isinstance(layer_sizes, Sequence) or isinstance(layer_sizes, str) or len(layer_sizes) < min_layers:
        raise ValueError(f"{name} must list at least {min_layers} layer size(s), got {name}={layer_sizes!r}")
    return [check_int(size, f"{name}[{i}]", 1) for i, size in enumerate(layer_sizes)]


def _check_positive(value: object, name: str) -> int:
    return check_int(value, name, 1)


class Perceptron(nn.Module):
    """``Linear`` then ReLU (torchrec's Perceptron, keys ``_linear.weight`` / ``_linear.bias``)."""

    def __init__(self, in_size: int, out_size: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._linear = nn.Linear(in_size, out_size, bias=True, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self._linear(x))


class MLP(nn.Module):
    """Stack of :class:`Perceptron` s: ``[B, in_size] -> [B, layer_sizes[-1]]`` (torchrec's MLP with ReLU)."""

    def __init__(self, in_size: int, layer_sizes: Sequence[int], device: torch.device | str | None = None) -> None:
        super().__init__()
        in_size = _check_positive(in_size, "in_size")
        sizes = _check_layer_sizes(layer_sizes, "layer_sizes")
        self._mlp = nn.Sequential(
            *(Perceptron(a, b, device) for a, b in zip([in_size, *sizes[:-1]], sizes, strict=True))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x)


class SparseArch(nn.Module):
    """Pooled embeddings of every sparse feature: KJT -> ``[B, F, D]`` (embeddings in the tables' order). ``F``
    counts embeddings, not distinct features: a feature read by several tables gives one embedding per table
    (``feature@table``, torchrec's names)."""

    def __init__(self, embedding_bag_collection: nn.Module) -> None:
        super().__init__()
        configs = getattr(embedding_bag_collection, "embedding_bag_configs", None)
        if configs is None or not configs():
            raise ValueError("embedding_bag_collection must be an EmbeddingBagCollection with at least one table")
        self.embedding_bag_collection = embedding_bag_collection
        self.D: int = configs()[0].embedding_dim
        self._sparse_feature_names: list[str] = get_embedding_names(configs())
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> list[str]:
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``features`` -> ``[B, F, D]``."""
        return self.to_tensor(self.embedding_bag_collection(features))

    def to_tensor(self, pooled: KeyedTensor) -> torch.Tensor:
        """The collection's output (a KeyedTensor, or a sharded collection's lazy awaitable of one, waited here) ->
        ``[B, F, D]``."""
        if isinstance(pooled, torch.fx.Proxy):  # plain fx tracing: the keys are not known until the graph runs
            keys_in_order = isinstance(self.embedding_bag_collection, _KEYED_IN_CONFIG_ORDER)
        else:
            keys_in_order = pooled.keys() == self._sparse_feature_names
        if keys_in_order:  # the collection's output order: no regrouping copy needed
            values = pooled.values()
        else:
            by_name = pooled.to_dict()
            values = torch.cat([by_name[name] for name in self._sparse_feature_names], dim=1)
        return values.reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """MLP over the dense features: ``[B, in_features] -> [B, layer_sizes[-1]]`` (the last size must be ``D``)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], device: torch.device | str | None = None) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class _PairwiseDots(torch.autograd.Function):
    """``vectors [B, N, D]`` -> ``[B, P]``: the dot products of the pairs at flat positions ``pairs`` (``i * N + j``)
    of the ``[N, N]`` Gram matrix.

    Autograd through ``bmm(C, C^T)`` and an index would run two batched matmuls in the backward and add them; with the
    Gram matrix symmetric, ``dC = (G + G^T) C`` is one. On CPU a bmm of many tiny matrices costs about one BLAS call
    per sample (~0.35 ms for 512 x 9 x 64), so the interaction's forward + backward drops from three to two."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, vectors: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(vectors, pairs)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, N, N]
        # under autocast the bmm ran in a lower precision than the vectors (e.g. bf16 of fp32 embeddings); the
        # backward, which runs outside autocast, computes in that same dtype, as autograd through autocast would
        ctx.compute_dtype = gram.dtype
        return gram.flatten(1).index_select(1, pairs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        vectors, pairs = ctx.saved_tensors
        batch, n = vectors.shape[0], vectors.shape[1]
        compute = ctx.compute_dtype  # type: ignore[attr-defined]
        grad = grad.to(compute)
        # each pair sits in the upper triangle once, so G + G^T holds each pair's gradient at (i, j) and (j, i)
        both = torch.cat((pairs, (pairs % n) * n + pairs // n))
        sym = grad.new_zeros(batch, n * n).index_copy_(1, both, torch.cat((grad, grad), dim=1))
        return torch.bmm(sym.view(batch, n, n), vectors.to(compute)).to(vectors.dtype), None


def pairwise_dots(vectors: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``vectors [B, N, D]``, ``pairs [P]`` -> ``[B, P]`` through :class:`_PairwiseDots` (its one-bmm backward).
    A leaf to ``torch.fx``, so a traced model keeps that backward instead of autograd's through the inlined ops."""
    return _PairwiseDots.apply(vectors, pairs)


torch.fx.wrap("pairwise_dots")


class InteractionArch(nn.Module):
    """Dot-product interaction: ``[B, D]`` dense and ``[B, F, D]`` sparse -> ``[B, D + F + F choose 2]``: the
    dense vector followed by the pairwise dot products of all ``F + 1`` vectors (upper triangle, no diagonal)."""

    def __init__(self, num_sparse_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.F = check_int(num_sparse_features, "num_sparse_features", 0)
        # on the dense layers' device (index_select needs its index where the Gram matrix is), except meta: a module
        # materialised from meta gets zero-filled buffers, so these stay on the CPU until the model is moved
        if device is not None and torch.device(device).type == "meta":
            device = None
        triu = torch.triu_indices(self.F + 1, self.F + 1, offset=1, device=device)
        self.register_buffer("triu_indices", triu, persistent=False)
        # the same pairs as flat positions of the [F + 1, F + 1] Gram matrix, row by row
        self.register_buffer("_pair_positions", self.triu_indices[0] * (self.F + 1) + self.triu_indices[1],
                             persistent=False)  # fmt: skip

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)  # [B, F + 1, D]
        return torch.cat((dense_features, pairwise_dots(combined, self._pair_positions)), dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers with low-rank weights: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``, ``[B, N] ->
    [B, N]`` with ``W_l [N, r]``, ``V_l [r, N]`` (torchrec's parameter names and initialisation)."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        self._in_features = in_features = _check_positive(in_features, "in_features")
        self._num_layers = _check_positive(num_layers, "num_layers")
        self._low_rank = _check_positive(low_rank, "low_rank")
        self.W_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)]
        )
        self.V_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)]
        )
        self.bias = nn.ParameterList([nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [B, N]`` -> ``[B, N]``."""
        check_dense_input(input, "input", f"[B, in_features={self._in_features}]", ndim=2, last_dim=self._in_features)
        x_0 = x_l = input
        for layer in range(self._num_layers):
            projected = nn.functional.linear(nn.functional.linear(x_l, self.V_kernels[layer]), self.W_kernels[layer])
            x_l = x_0 * (projected + self.bias[layer]) + x_l
        return x_l


class InteractionDCNArch(nn.Module):
    """DCNv2 interaction: ``[B, D]`` dense and ``[B, F, D]`` sparse -> ``crossnet`` over their concatenation,
    ``[B, (F + 1) * D]``."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape(dense_features.shape[0], -1))


class OverArch(nn.Module):
    """MLP with ReLU on all but the last layer, which is a plain Linear: ``[B, in_features] -> [B,
    layer_sizes[-1]]`` (the logits)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], device: torch.device | str | None = None) -> None:
        super().__init__()
        sizes = _check_layer_sizes(layer_sizes, "over_arch_layer_sizes", min_layers=2)
        self.model = nn.Sequential(
            MLP(in_features, sizes[:-1], device), nn.Linear(sizes[-2], sizes[-1], bias=True, device=device)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)
