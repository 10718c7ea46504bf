"""``EmbeddingTower`` and ``EmbeddingTowerCollection`` (``torchrec.modules.embedding_tower``): an embedding module
whose output goes straight into its own interaction module, and a collection of such towers whose outputs are
concatenated.

A tower's state dict is its embedding module's under ``embedding.`` and its interaction's under ``interaction.``; a
collection's is ``towers.{i}.`` before that (torchrec's keys), e.g.
``towers.0.embedding.embedding_bags.t0.weight``.

These are the unsharded modules. Under :class:`tritonrec.dist.DistributedModelParallel` the embedding collection
inside a tower is sharded like any other (DMP shards the modules its sharders cover wherever they sit), and the
interaction stays a data-parallel dense module. With ``EmbeddingTowerSharder`` / ``EmbeddingTowerCollectionSharder``
(:mod:`tritonrec.dist.embedding_tower_sharding`, torchrec's) each whole tower (tables and interaction) is placed on
one host instead, and its interaction's parameters live there only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection


def tower_input_params(module: nn.Module) -> tuple[bool, bool]:
    """Which KJTs a tower's embedding module takes: ``(features, weighted_features)`` (torchrec's rule).

    An :class:`EmbeddingCollection` takes ``features``; an :class:`EmbeddingBagCollection` (fused ones included)
    takes ``weighted_features`` when it is weighted, else ``features``; any other module takes both, as
    ``module(features, weighted_features)``.
    """
    if isinstance(module, EmbeddingCollection):
        return True, False
    if isinstance(module, EmbeddingBagCollection):
        return not module.is_weighted(), module.is_weighted()
    return True, True


def _check_module(value: object, name: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {type(value).__name__}")
    return value


class EmbeddingTower(nn.Module):
    """``interaction_module(embedding_module(*args, **kwargs))``.

    Args:
        embedding_module: e.g. an :class:`EmbeddingBagCollection` (``KJT -> KeyedTensor [B, sum(D)]``) or an
            :class:`EmbeddingCollection` (``KJT -> {name: JaggedTensor}``).
        interaction_module: maps the embedding module's output to a ``[B, N]`` tensor (``N`` this tower's width).
        device: accepted for torchrec's signature; the two modules already live where they were built.

    Submodules (torchrec's names): ``embedding``, ``interaction``.
    """

    def __init__(
        self,
        embedding_module: nn.Module,
        interaction_module: nn.Module,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.embedding = _check_module(embedding_module, "embedding_module")
        self.interaction = _check_module(interaction_module, "interaction_module")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The embedding module's arguments (e.g. ``features: KJT``) -> the interaction's ``[B, N]``."""
        return self.interaction(self.embedding(*args, **kwargs))


class EmbeddingTowerCollection(nn.Module):
    """Runs every tower on the KJT(s) its embedding module takes (see :func:`tower_input_params`) and concatenates
    their outputs: ``[B, N_0]``, ``[B, N_1]``, ... -> ``[B, sum(N_i)]``.

    Args:
        towers: the towers (at least one).
        device: accepted for torchrec's signature; the towers already live where they were built.

    Submodules (torchrec's names): ``towers.{i}`` (an ``nn.ModuleList``).
    """

    def __init__(self, towers: list[EmbeddingTower], device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(towers, (list, tuple, nn.ModuleList)) or not len(towers):
            raise ValueError(f"towers must be a non-empty list of EmbeddingTowers, got towers={towers!r}")
        for i, tower in enumerate(towers):
            if not isinstance(tower, EmbeddingTower):
                raise TypeError(f"towers[{i}] must be an EmbeddingTower, got {type(tower).__name__}")
        self.towers = nn.ModuleList(towers)
        # read once, from the unsharded modules: DMP may later swap a tower's embedding for its sharded version
        self._input_params = [tower_input_params(tower.embedding) for tower in towers]

    def forward(
        self,
        features: KeyedJaggedTensor | None = None,
        weighted_features: KeyedJaggedTensor | None = None,
    ) -> torch.Tensor:
        """``features`` and/or ``weighted_features`` (each a KJT over at least the keys of the towers that take it;
        a tower reads only its own keys) -> ``[B, sum(N_i)]``: the towers' outputs side by side, in tower order."""
        outputs = []
        for i, (tower, (takes_features, takes_weighted)) in enumerate(
            zip(self.towers, self._input_params, strict=True)
        ):
            if takes_features and features is None:
                raise ValueError(f"towers[{i}] reads features, but features is None")
            if takes_weighted and weighted_features is None:
                raise ValueError(f"towers[{i}] reads weighted_features, but weighted_features is None")
            if takes_features and takes_weighted:
                outputs.append(tower(features, weighted_features))
            else:
                outputs.append(tower(features if takes_features else weighted_features))
        if not is_fx_symbolic_tracing():
            _check_outputs(outputs)
        return torch.cat(outputs, dim=1)


def _check_outputs(outputs: list[torch.Tensor]) -> None:
    """Every tower returned a ``[B, N_i]`` tensor with the first tower's ``B``."""
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor) or out.dim() != 2:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"towers[{i}] must return a [B, N] tensor, got {shape}")
        if out.shape[0] != outputs[0].shape[0]:
            raise ValueError(
                f"towers[{i}] returned {out.shape[0]} rows but towers[0] returned {outputs[0].shape[0]}; the towers "
                "must share the batch"
            )


__all__ = ["EmbeddingTower", "EmbeddingTowerCollection", "tower_input_params"]
