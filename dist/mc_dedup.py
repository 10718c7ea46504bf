"""Index dedup of the sharded managed-collision EC (torchrec 1.8's ``use_index_dedup`` on the EC sharder, which the
MC-EC's ``ShardedManagedCollisionCollection._dedup_indices`` runs), row-wise only.

On the sample-owning rank, after the MC preprocess (``input_hash_func``) and before the input dist, each table's ids
in this rank's batch are made unique over all its features (torchrec linearizes them with one hash offset per
table, so an id two features of a table share is sent once), ascending; the table's first feature holds them (its
first bag), its other features send none. The MCH modules thus see each id once per table and source rank (an LFU
count grows by one per rank that saw the id, not per occurrence), the lookup reads each row once, and after the
sequence all-to-all every feature's rows are expanded back from its table's unique rows with its inverse, so the
output (and, through ``index_select``'s backward, the gradients of repeated ids, which add up) is that of the
un-deduplicated batch. ``need_indices`` still gives this rank's input ids. Refused with ``return_remapped_features``
(the returned rows would be the unique ids', in their order).
"""

from __future__ import annotations

import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.embedding import EmbeddingCollectionAwaitable


def dedup_per_table(
    features: KeyedJaggedTensor, feature_to_table: dict[str, str]
) -> tuple[KeyedJaggedTensor, dict[str, tuple[str, torch.Tensor]]]:
    """``features`` (one stride for all keys) -> the same keys holding each table's unique ids (ascending) in its
    first feature's first bag, and per feature ``(the feature holding its table's unique ids, [N_f] inverse into
    them)``. Weights are dropped (the EC's lookup reads none)."""
    keys, batch = features.keys(), features.stride()
    per_key = dict(zip(keys, features.values().split(features.length_per_key()), strict=True))
    by_table: dict[str, list[str]] = {}
    for key in keys:
        by_table.setdefault(feature_to_table[key], []).append(key)
    held: dict[str, torch.Tensor] = {}
    inverse: dict[str, tuple[str, torch.Tensor]] = {}
    for names in by_table.values():
        ids = torch.cat([per_key[n] for n in names])
        held[names[0]], table_inverse = torch.unique(ids, return_inverse=True)
        for name, part in zip(names, table_inverse.split([per_key[n].numel() for n in names]), strict=True):
            inverse[name] = (names[0], part)
    lengths = torch.zeros(len(keys), batch, dtype=features.lengths().dtype, device=features.device())
    if batch:
        for i, key in enumerate(keys):
            if key in held:
                lengths[i, 0] = held[key].numel()
    empty = features.values()[:0]
    values = torch.cat([held.get(key, empty) for key in keys]) if keys else empty
    return KeyedJaggedTensor(keys, values, lengths=lengths.flatten(), stride=batch), inverse


class DedupEmbeddingCollectionAwaitable(EmbeddingCollectionAwaitable):
    """The sequence output of a deduplicated batch: each embedding's rows are its table's unique rows (held by the
    table's first feature) expanded with the feature's inverse."""

    def __init__(self, plain: EmbeddingCollectionAwaitable, inverse: dict[str, tuple[str, torch.Tensor]]) -> None:
        super().__init__(plain._awaitables, plain._ctx, plain._names, plain._need_indices, plain._sources)
        self._inverse = inverse
        self._name_of = {feature: name for name, feature in plain._sources.items()}

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        joined = self._rows_by_name()
        out = {}
        for name in self._names:
            feature = self._sources[name]
            holder, inverse = self._inverse[feature]
            unique_rows = joined[self._name_of[holder]]
            original = self._ctx.input_features[feature]
            out[name] = JaggedTensor(
                values=unique_rows.index_select(0, inverse),
                lengths=original.lengths(),
                weights=original.values() if self._need_indices else None,
            )
        return out


__all__ = ["DedupEmbeddingCollectionAwaitable", "dedup_per_table"]
