"""Embedding collections behind managed-collision remapping (torchrec's ``mc_embedding_modules``).

``ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False)`` and
``ManagedCollisionEmbeddingCollection(ec, mcc, ...)``: ``forward(kjt)`` remaps the raw ids with the
``ManagedCollisionCollection`` (training mode also inserts and evicts, see :mod:`tritonrec.modules.mc_modules`),
looks the rows up in the embedding module and returns ``(embeddings, remapped kjt or None)``; the embeddings are
exactly what the plain EBC / EC gives for the remapped KJT.

State-dict keys: ``_managed_collision_collection._managed_collision_modules.<table>.<buffer>`` and
``_embedding_module.embedding_bags.<table>.weight`` (``...embeddings.<table>.weight`` for the EC), as torchrec.

Evicted rows. As in torchrec 1.8's unsharded modules, by default a row given to a new id keeps the evicted id's
embedding (torchrec's ``evict`` hook is a stub); the forward consumes ``_managed_collision_collection.evict()``.
``reset_evicted_rows=True`` (ours, off by default) does what torchrec's *sharded* modules do
(:mod:`tritonrec.dist.mc_row_reset`): after the remap and before the lookup, each table's rows handed to new ids
(slots newly filled or taken from an evicted id) are redrawn with the table's ``init_fn``, so the new id starts from
a fresh row. The unsharded tables have no fused optimizer, so an external optimizer's state of those rows is left as
it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.mc_modules import ManagedCollisionCollection


def evict(evictions: dict[str, torch.Tensor | None], ebc: nn.Module) -> None:
    """torchrec 1.8's unsharded eviction hook: a no-op (evicted rows keep their weights), kept so behaviour matches."""
    return


def reinit_rows(
    weight: torch.Tensor,
    rows: torch.Tensor,
    init_fn: Callable[[torch.Tensor], torch.Tensor | None],
    bypass_autograd: bool = False,
) -> None:
    """torchrec's sharded reset of evicted rows: ``weight[rows] = init_fn(weight[rows])``, where ``init_fn`` gets a
    copy of the ``[E, D]`` rows (its in-place result is used when it returns None). ``bypass_autograd`` writes
    through ``.data`` (torchrec's ``allow_in_place_embed_weight_update``): the version counter is not bumped, so a
    graph that saved ``weight`` in an earlier forward can still run its backward."""
    with torch.no_grad():
        drawn = weight[rows]
        out = init_fn(drawn)
        target = weight.data if bypass_autograd else weight
        target[rows] = drawn if out is None else out.to(weight.dtype)


def _reset_evicted_rows(
    evictions: dict[str, torch.Tensor | None], embedding_module: nn.Module, bypass_autograd: bool
) -> None:
    """``reset_evicted_rows=True``: each table's rows in ``evictions`` redrawn with its config's ``init_fn``."""
    if isinstance(embedding_module, EmbeddingBagCollection):
        configs, tables = embedding_module.embedding_bag_configs(), embedding_module.embedding_bags
    else:
        configs, tables = embedding_module.embedding_configs(), embedding_module.embeddings
    for config in configs:
        rows = evictions.get(config.name)
        if rows is not None and rows.numel() > 0:
            weight = tables[config.name].weight
            reinit_rows(weight, rows.to(weight.device, torch.int64), config.init_fn, bypass_autograd)


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """An embedding module whose inputs are first remapped by a ``ManagedCollisionCollection``.

    Args:
        embedding_module: the ``EmbeddingBagCollection`` / ``EmbeddingCollection`` holding the tables.
        managed_collision_collection: remaps each table's ids; must hold the same configs as the module.
        return_remapped_features: also return the remapped KJT.
        allow_in_place_embed_weight_update: rewrite evicted rows through ``.data`` (see :func:`reinit_rows`); used
            with ``reset_evicted_rows`` and by the sharded modules.
        reset_evicted_rows: (ours, default False as torchrec's unsharded module) redraw the rows handed to new ids
            with the table's ``init_fn`` before the lookup, as torchrec's sharded modules do (module docstring).
    """

    def __init__(
        self,
        embedding_module: EmbeddingBagCollection | EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
        *,
        reset_evicted_rows: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(reset_evicted_rows, bool):
            raise TypeError(f"reset_evicted_rows must be a bool, got reset_evicted_rows={reset_evicted_rows!r}")
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
        self._reset_evicted_rows = reset_evicted_rows
        self._embedding_module = embedding_module

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor | dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        """Raw-id KJT -> (embeddings of the remapped KJT, the remapped KJT if ``return_remapped_features``). Under
        plain ``torch.fx.symbolic_trace`` of a model holding it: one ``call_module`` node (the remapping branches on
        the ids), like the embedding collections."""
        if (leaf := fx_leaf_call(self, features, mutate_miss_lengths)) is not None:
            return leaf  # type: ignore[return-value]
        if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            # the collection refuses it too, but only after the remap had inserted the batch's ids
            raise ValueError(
                f"{type(self).__name__} needs one batch size for all keys (its {type(self._embedding_module).__name__}"
                f" does); got a variable-stride KJT with stride_per_key={features.stride_per_key()}"
            )
        features = self._managed_collision_collection(features, mutate_miss_lengths=mutate_miss_lengths)
        if self._reset_evicted_rows:  # before the lookup, as torchrec's sharded modules
            evictions = self._managed_collision_collection.evict()
            _reset_evicted_rows(evictions, self._embedding_module, self._allow_in_place_embed_weight_update)
            return self._embedding_module(features), (features if self._return_remapped_features else None)
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
        *,
        reset_evicted_rows: bool = False,
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
            reset_evicted_rows=reset_evicted_rows,
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
        *,
        reset_evicted_rows: bool = False,
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
            reset_evicted_rows=reset_evicted_rows,
        )

    @property
    def _embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_module  # type: ignore[return-value]
