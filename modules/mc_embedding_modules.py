"""Embedding collections behind managed-collision remapping (torchrec's ``mc_embedding_modules``).

``ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False)`` and
``ManagedCollisionEmbeddingCollection(ec, mcc, ...)``: ``forward(kjt)`` remaps the raw ids with the
``ManagedCollisionCollection`` (training mode also inserts and evicts, see :mod:`tritonrec.modules.mc_modules`),
looks the rows up in the embedding module and returns ``(embeddings, remapped kjt or None)``; the embeddings are
exactly what the plain EBC / EC gives for the remapped KJT.

State-dict keys: ``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` and
``_embedding_module.embedding_bags.<table>.weight`` (``...embeddings.<table>.weight`` for the EC), as torchrec.

As in torchrec 1.8, a row given to a new id keeps the evicted id's embedding (torchrec's ``evict`` hook is a stub);
the rows replaced are available from ``_managed_collision_collection.evict()`` until the next forward consumes them.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.mc_modules import ManagedCollisionCollection


def evict(evictions: dict[str, torch.Tensor | None], ebc: nn.Module) -> None:
    """torchrec 1.8's eviction hook: a no-op (evicted rows keep their weights), kept so behaviour matches."""
    return


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """An embedding module whose inputs are first remapped by a ``ManagedCollisionCollection``.

    Args:
        embedding_module: the ``EmbeddingBagCollection`` / ``EmbeddingCollection`` holding the tables.
        managed_collision_collection: remaps each table's ids; must hold the same configs as the module.
        return_remapped_features: also return the remapped KJT.
        allow_in_place_embed_weight_update: kept for torchrec's API (evicted rows are not rewritten).
    """

    def __init__(
        self,
        embedding_module: EmbeddingBagCollection | EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(managed_collision_collection, ManagedCollisionCollection):
            raise TypeError(
                "managed_collision_collection must be a ManagedCollisionCollection, "
                f"got {type(managed_collision_collection).__name__}"
            )
        if isinstance(embedding_module, EmbeddingBagCollection):
            configs = embedding_module.embedding_bag_configs()
        elif isinstance(embedding_module, EmbeddingCollection):
            configs = embedding_module.embedding_configs()
        else:
            raise TypeError(
                "embedding_module must be an EmbeddingBagCollection or EmbeddingCollection, "
                f"got {type(embedding_module).__name__}"
            )
        if list(configs) != list(managed_collision_collection.embedding_configs()):
            raise ValueError(
                f"the {type(embedding_module).__name__} and the ManagedCollisionCollection must hold the same "
                f"embedding configs, got tables {[c.name for c in configs]} and "
                f"{[c.name for c in managed_collision_collection.embedding_configs()]}"
            )
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = bool(return_remapped_features)
        self._allow_in_place_embed_weight_update = bool(allow_in_place_embed_weight_update)
        self._embedding_module = embedding_module

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor | dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        """Raw-id KJT -> (embeddings of the remapped KJT, the remapped KJT if ``return_remapped_features``). Under
        plain ``torch.fx.symbolic_trace`` of a model holding it: one ``call_module`` node (the remapping branches on
        the ids), like the embedding collections."""
        if (leaf := fx_leaf_call(self, features, mutate_miss_lengths)) is not None:
            return leaf  # type: ignore[return-value]
        features = self._managed_collision_collection(features, mutate_miss_lengths=mutate_miss_lengths)
        embeddings = self._embedding_module(features)
        evict(self._managed_collision_collection.evict(), self._embedding_module)
        return embeddings, (features if self._return_remapped_features else None)


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """An ``EmbeddingCollection`` (sequence embeddings) behind managed-collision remapping; output
    ``(dict[embedding name, JaggedTensor], remapped kjt or None)``."""

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        if not isinstance(embedding_collection, EmbeddingCollection):
            raise TypeError(
                f"embedding_collection must be an EmbeddingCollection, got {type(embedding_collection).__name__}"
            )
        super().__init__(
            embedding_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_collection(self) -> EmbeddingCollection:
        return self._embedding_module  # type: ignore[return-value]


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """An ``EmbeddingBagCollection`` (pooled embeddings) behind managed-collision remapping; output
    ``(KeyedTensor [B, sum(D)], remapped kjt or None)``."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        if not isinstance(embedding_bag_collection, EmbeddingBagCollection):
            raise TypeError(
                "embedding_bag_collection must be an EmbeddingBagCollection, "
                f"got {type(embedding_bag_collection).__name__}"
            )
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_module  # type: ignore[return-value]
