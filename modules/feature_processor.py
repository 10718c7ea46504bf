"""Position-weighted features and the weighted pooled lookup they feed (torchrec's feature processors).

* ``PositionWeightedModule(max_feature_length)``: JaggedTensor -> the same JaggedTensor with ``weights`` =
  a learned weight per position in the bag (``position_weight [max_feature_length]``, initialised to 1).
* ``PositionWeightedModuleCollection(max_feature_lengths)``: the same for several keys of a KJT at once; keys
  without a position weight get weight 1.
* ``FeatureProcessedEmbeddingBagCollection(embedding_bag_collection, feature_processors)``: runs the processors,
  then the (weighted) EBC; gradients reach the position weights through the per-sample-weight gradient of the
  lookup.

A bag longer than its ``max_feature_length`` raises ``ValueError`` (torchrec would index out of range).
"""

from __future__ import annotations

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.checks import check_int
from tritonrec.modules.embedding_modules import EmbeddingBagCollection
from tritonrec.modules.fx_leaf import fx_leaf_call


def _positions_in_bags(offsets: torch.Tensor, num_values: int) -> torch.Tensor:
    """``[N]`` position of every value inside its bag (FBGEMM's ``offsets_range``)."""
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=num_values)
    return torch.arange(num_values, device=offsets.device) - starts


def _check_max_length(key: str, lengths: torch.Tensor, max_length: int) -> None:
    if lengths.numel() and int(lengths.max().item()) > max_length:
        raise ValueError(
            f"feature {key!r} has a bag of {int(lengths.max().item())} values, more than its max_feature_length "
            f"{max_length}"
        )


class PositionWeightedModule(nn.Module):
    """Learned per-position weights for one feature (see module docstring)."""

    def __init__(self, max_feature_length: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.max_feature_length = max_feature_length = check_int(max_feature_length, "max_feature_length", 1)
        self.position_weight = nn.Parameter(torch.empty(max_feature_length, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        if (leaf := fx_leaf_call(self, features)) is not None:  # plain fx: one call_module node (torchrec traces)
            return leaf  # type: ignore[return-value]
        return self.weighted(features, "<jagged tensor>")

    def weighted(self, features: JaggedTensor, name: str) -> JaggedTensor:
        """``forward`` with the feature's ``name`` for the error a too-long bag raises."""
        if not isinstance(features, JaggedTensor):
            raise TypeError(f"features must be a JaggedTensor, got {type(features).__name__}")
        _check_max_length(name, features.lengths(), self.max_feature_length)
        positions = _positions_in_bags(features.offsets(), features.values().shape[0])
        return JaggedTensor(
            values=features.values(),
            lengths=features.lengths(),
            offsets=features.offsets(),
            weights=self.position_weight[positions],
        )


class PositionWeightedModuleCollection(nn.Module):
    """Learned per-position weights for several features of a KJT (see module docstring)."""

    def __init__(self, max_feature_lengths: dict[str, int], device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(max_feature_lengths, dict) or not max_feature_lengths:
            raise ValueError(f"max_feature_lengths must be a non-empty dict, got {max_feature_lengths!r}")
        self.max_feature_lengths = {
            key: check_int(length, f"max_feature_lengths[{key!r}]", 1) for key, length in max_feature_lengths.items()
        }
        self.position_weights = nn.ParameterDict(
            {key: nn.Parameter(torch.ones(length, device=device)) for key, length in max_feature_lengths.items()}
        )

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in self.position_weights.values():
                weight.fill_(1.0)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if (leaf := fx_leaf_call(self, features)) is not None:  # plain fx: one call_module node (torchrec traces)
            return leaf  # type: ignore[return-value]
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        positions = _positions_in_bags(features.offsets(), features.values().numel())
        parts = []
        for key, start, end in zip(
            features.keys(), features.offset_per_key()[:-1], features.offset_per_key()[1:], strict=True
        ):
            if key in self.position_weights:
                _check_max_length(key, features[key].lengths(), self.max_feature_lengths[key])
                parts.append(self.position_weights[key][positions[start:end]])
            else:
                parts.append(torch.ones(end - start, device=features.values().device))
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values(),
            weights=torch.cat(parts) if parts else features.weights_or_none(),
            lengths=features.lengths(),
            offsets=features.offsets(),
            stride=features.stride(),
        )


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """Feature processors feeding a weighted :class:`EmbeddingBagCollection` (see module docstring).

    ``feature_processors`` is either a dict ``{feature: PositionWeightedModule}`` covering exactly the EBC's
    features (one per feature, also for a feature several tables read), or a
    :class:`PositionWeightedModuleCollection` (any module mapping a KJT to a weighted KJT).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: dict[str, nn.Module] | nn.Module,
    ) -> None:
        super().__init__()
        if not isinstance(embedding_bag_collection, EmbeddingBagCollection):
            raise TypeError(
                f"embedding_bag_collection must be an EmbeddingBagCollection, got "
                f"{type(embedding_bag_collection).__name__}"
            )
        if not embedding_bag_collection.is_weighted():
            raise ValueError("embedding_bag_collection must be built with is_weighted=True to take processed weights")
        self._embedding_bag_collection = embedding_bag_collection
        # processors are keyed by feature (torchrec): a feature several tables read is processed once, and each of
        # those tables pools its ids with the same processed weights
        configs = embedding_bag_collection.embedding_bag_configs()
        names = list(dict.fromkeys(f for config in configs for f in config.feature_names))
        if isinstance(feature_processors, dict):
            if set(feature_processors) != set(names):
                raise ValueError(
                    f"feature_processors must cover exactly the EBC's features {sorted(names)}, got "
                    f"{sorted(feature_processors)}"
                )
            self._feature_processors: nn.Module = nn.ModuleDict(feature_processors)
        elif isinstance(feature_processors, nn.Module):
            self._feature_processors = feature_processors
        else:
            raise TypeError(
                f"feature_processors must be a dict or an nn.Module, got {type(feature_processors).__name__}"
            )
        self._feature_names = names

    def is_weighted(self) -> bool:
        return True

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features`` (KJT over at least the EBC's feature names) -> the EBC's ``KeyedTensor`` of the processed
        features. A missing feature, or a bag longer than its processor's ``max_feature_length``, is a
        ``ValueError`` naming the feature."""
        if (leaf := fx_leaf_call(self, features)) is not None:
            return leaf  # type: ignore[return-value]
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        if isinstance(self._feature_processors, nn.ModuleDict):
            missing = [name for name in self._feature_names if name not in features.keys()]
            if missing:
                raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
            jts = features.to_dict()
            processed = [self._process(name, jts[name]) for name in self._feature_names]
            features = KeyedJaggedTensor(
                keys=self._feature_names,
                values=torch.cat([jt.values() for jt in processed]),
                weights=torch.cat([jt.weights() for jt in processed]),
                lengths=torch.cat([jt.lengths() for jt in processed]),
            )
        else:
            features = self._feature_processors(features)
        return self._embedding_bag_collection(features)

    def _process(self, name: str, features: JaggedTensor) -> JaggedTensor:
        processor = self._feature_processors[name]  # type: ignore[index]
        # its errors name the feature (it sees a bare JT); a subclass with its own forward is called as it is
        if isinstance(processor, PositionWeightedModule) and type(processor).forward is PositionWeightedModule.forward:
            return processor.weighted(features, name)
        return processor(features)
