"""``ShardedManagedCollisionCollection`` (torchrec's, row-wise only): the managed-collision half of a sharded
MC-EBC / MC-EC.

torchrec's design (``torchrec/distributed/mc_modules.py``), which this follows:

* every table is row-wise: rank ``r`` holds rows ``[o_r, o_r + n_r)`` of the table (the plan's shard) and an MCH
  module rebuilt from the unsharded one by ``rebuild_with_output_id_range((o_r, o_r + n_r), segments)``: it owns
  ``zch_size = n_r`` rows (its miss row is its last one), the same ``input_hash_size``, ``buckets = W``;
* raw ids go to ranks by raw-id range: feature ``f`` of a table with ``input_hash_size H`` sends id ``x`` to rank
  ``x // ceil(H / W)`` (torchrec's ``RwSparseFeaturesDist(feature_hash_sizes=H, keep_original_indices=True)``);
  ``input_hash_func`` runs before, on the rank owning the sample (``need_preprocess``). A
  ``HashZchManagedCollisionModule`` table (torchrec's MPZCH sharding) instead sends ``x`` to the rank owning its
  bucket, ids unchanged, and its rebuilt module owns that rank's ``B / W`` buckets
  (:mod:`tritonrec.dist.mc_hash_zch_sharding`, which also lists what it refuses);
* each rank profiles and remaps the raw ids it received, one id stream per table: its features in config order,
  each feature's ids from rank 0's samples, then rank 1's, ...; rows come out global and are made local
  (``- o_r``) for the rank's own row-wise shard: no second all-to-all;
* state dict: ``_managed_collision_modules.<table>.<buffer>`` is a ``ShardedTensor`` of ``[num_embeddings, ...]``
  (this rank's ``[n_r, ...]`` at offset ``o_r``) for every persistent buffer and parameter (hash ZCH's
  ``_hash_zch_identities``) but ``_output_segments_tensor``, ``_current_iter_tensor`` and ``_hash_zch_bucket``,
  which stay this rank's plain tensors (torchrec's ``sharded_parameter_names``); loading takes those
  ``ShardedTensor``\\ s;
* ``return_remapped_features``: the remapped rows (made global) go back to the ranks owning their samples by the
  reverse of the input all-to-all (:meth:`ShardedManagedCollisionCollection.return_dist`), and the unbucketize
  permutation puts them in input order (:class:`RemappedFeaturesAwaitable`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.dist.awaitable import LazyAwaitable
from tritonrec.dist.mc_hash_zch_sharding import HashZchRoute, check_hash_zch_table
from tritonrec.dist.sharding.common import ShardedTable, ShardingContext
from tritonrec.dist.types import ShardingType
from tritonrec.modules.mc_base import check_id_features
from tritonrec.modules.mc_collection import ManagedCollisionCollection
from tritonrec.modules.mc_hash_zch import HashZchManagedCollisionModule
from tritonrec.modules.mc_modules import MCHManagedCollisionModule

# torchrec keeps these rank-local (sharded_parameter_names skips them)
_LOCAL_BUFFERS = ("_output_segments_tensor", "_current_iter_tensor", "_hash_zch_bucket")


def check_row_wise_plan(tables: list[ShardedTable], owner: str) -> None:
    """Managed-collision tables shard row-wise only (as torchrec): raise naming the first other table."""
    for table in tables:
        if table.sharding_type != ShardingType.ROW_WISE.value:
            raise ValueError(
                f"{owner} shards managed-collision tables row-wise only: table {table.name!r} has sharding type "
                f"{table.sharding_type!r} (use row_wise())"
            )


class ShardedManagedCollisionCollection(nn.Module):
    """This rank's MCH modules over its row ranges (see the module docstring).

    Args:
        module: the unsharded ``ManagedCollisionCollection``.
        tables: the embedding module's tables with their (row-wise) placement, in module order.
        pg: the sharding's process group (the state dict's ``ShardedTensor``\\ s live on it).
        device: where the rebuilt modules' state lives.
    """

    def __init__(
        self,
        module: ManagedCollisionCollection,
        tables: list[ShardedTable],
        pg: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        super().__init__()
        if not isinstance(module, ManagedCollisionCollection):
            raise TypeError(f"module must be a ManagedCollisionCollection, got {type(module).__name__}")
        for name, table_module in module._managed_collision_modules.items():
            if not isinstance(table_module, (MCHManagedCollisionModule, HashZchManagedCollisionModule)):
                raise NotImplementedError(
                    f"table {name!r}: sharding a {type(table_module).__name__} is not built; the sharded "
                    "managed-collision modules take MCHManagedCollisionModule and HashZchManagedCollisionModule "
                    "tables only"
                )
        check_row_wise_plan(tables, type(self).__name__)
        self._pg = pg
        self._rank, self._world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.need_preprocess = module.need_preprocess
        self._output_features = list(module._feature_names)  # the unsharded remapped KJT's keys
        self._device = device
        self._table_to_features = {t.name: list(t.config.feature_names) for t in tables}
        self._feature_to_table = {f: t for t, features in self._table_to_features.items() for f in features}
        self._table_to_offset: dict[str, int] = {}
        self._shard_metadata: dict[str, list[tuple[int, int, int]]] = {}  # table -> per rank (offset, rows, rank)
        modules: dict[str, nn.Module] = {}
        routes: dict[str, HashZchRoute] = {}  # hash ZCH tables: ids go to the rank owning their bucket
        for table in tables:
            unsharded = module._managed_collision_modules[table.name]
            if isinstance(unsharded, HashZchManagedCollisionModule):
                rows = [(s.row_offset, s.rows, s.rank) for s in table.shards]
                routes[table.name] = check_hash_zch_table(table.name, unsharded, rows, self._world_size)
            (mine,) = [s for s in table.shards if s.rank == self._rank]
            if mine.rows < 1:
                raise ValueError(
                    f"table {table.name!r}: rank {self._rank} holds no rows, but its managed-collision module needs "
                    "at least one (its miss row): use even row_wise() blocks or fewer ranks"
                )
            segments = [s.row_offset for s in table.shards] + [table.config.num_embeddings]
            modules[table.name] = module._managed_collision_modules[table.name].rebuild_with_output_id_range(
                (mine.row_offset, mine.row_offset + mine.rows), segments, device
            )
            self._table_to_offset[table.name] = mine.row_offset
            self._shard_metadata[table.name] = [(s.row_offset, s.rows, s.rank) for s in table.shards]
        self._managed_collision_modules = nn.ModuleDict(modules)
        # MCH: ids go to ranks by raw-id range, ceil(input_hash_size / W) ids per rank (torchrec's feature_hash_sizes),
        # made local to it by the bucketizer (remap adds the block back); hash ZCH: by bucket, ids unchanged (block 0)
        self._feature_block_size = {
            f: 0 if t in routes else -(-self._managed_collision_modules[t].input_size() // self._world_size)
            for f, t in self._feature_to_table.items()
        }
        self._feature_route = {
            f: routes.get(t) or HashZchRoute(self._feature_block_size[f], shift=self._feature_block_size[f])
            for f, t in self._feature_to_table.items()
        }
        self._routes_by_bucket = {f for f, t in self._feature_to_table.items() if t in routes}
        self._register_state_dict_hook(_to_sharded_tensors)
        self._register_load_state_dict_pre_hook(_from_sharded_tensors, with_module=True)

    def block_sizes(self, features: list[str]) -> list[int]:
        """Per feature of ``features``: the raw ids each rank receives (the bucketizer's block size)."""
        return [self._feature_block_size[f] for f in features]

    def routes(self, features: list[str]) -> list[HashZchRoute] | None:
        """Per feature of ``features``, its route when one of them is a hash ZCH table's (bucket by
        :func:`~tritonrec.dist.mc_hash_zch_sharding.bucketize_by_rank`); None: bucket by :meth:`block_sizes`."""
        if not self._routes_by_bucket.intersection(features):
            return None
        return [self._feature_route[f] for f in features]

    @torch.no_grad()
    def preprocess(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """On the sample-owning rank, before the input dist: each table's ``input_hash_func`` (``need_preprocess``),
        then the check that every id lies in ``[0, input_hash_size)`` (the bucketizer would misplace others)."""
        keys = features.keys()
        segments = dict(zip(keys, features.values().split(features.length_per_key()), strict=True))
        changed = False
        for table, module in self._managed_collision_modules.items():
            names = [f for f in self._table_to_features[table] if f in segments]
            if not names:
                continue
            ids = JaggedTensor(values=torch.cat([segments[f] for f in names]), lengths=_counts(segments, names))
            if self.need_preprocess and getattr(module, "_input_hash_func", None) is not None:
                ids = module.preprocess({table: ids})[table]
                for f, part in zip(names, ids.values().split(_sizes(segments, names)), strict=True):
                    segments[f] = part
                changed = True
            bound = module.input_size() or None  # hash ZCH's input_hash_size 0: any non-negative id
            check_id_features({table: ids}, bound, f"{type(self).__name__} (table {table!r})", nonnegative=True)
        if not changed:
            return features
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([segments[k] for k in keys]),
            weights=features.weights_or_none(),
            lengths=features.lengths(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
            stride=None if features.variable_stride_per_key() else features.stride(),
            inverse_indices=features.inverse_indices_or_none(),
        )

    @torch.no_grad()
    def remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The KJT this rank's input dist delivered (ids made local to this rank's raw-id block by the bucketizer,
        each key's ids rank by rank) -> the same KJT holding this rank's local rows ``[0, n_r)``. Training mode
        also inserts / evicts (:mod:`tritonrec.modules.mc_modules`)."""
        keys = features.keys()
        base = self._rank
        segments = {
            k: part + base * self._feature_block_size[k]
            for k, part in zip(keys, features.values().split(features.length_per_key()), strict=True)
        }
        for table, module in self._managed_collision_modules.items():
            names = [f for f in self._table_to_features[table] if f in segments]
            if not names:
                continue
            ids = JaggedTensor(values=torch.cat([segments[f] for f in names]), lengths=_counts(segments, names))
            rows = module.remap(module.profile({table: ids}))[table].values() - self._table_to_offset[table]
            for f, part in zip(names, rows.split(_sizes(segments, names)), strict=True):
                segments[f] = part
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([segments[k] for k in keys]) if keys else features.values(),
            weights=features.weights_or_none(),
            lengths=features.lengths(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
            stride=None if features.variable_stride_per_key() else features.stride(),
        )

    @torch.no_grad()
    def return_dist(self, remapped: KeyedJaggedTensor, ctx: ShardingContext, pg: dist.ProcessGroup) -> Any:
        """The reverse of the input all-to-all for :meth:`remap`'s output (local rows, each key's bags source rank
        by source rank): its rows made global, sent back to their source ranks. Returns ``(work, received)``:
        ``received`` holds this rank's samples' rows in the bucketized order it sent its ids in."""
        keys, batch = remapped.keys(), ctx.batch_size_per_rank
        parts = remapped.values().split(remapped.length_per_key())
        rows = [p + self._table_to_offset[self._feature_to_table[k]] for k, p in zip(keys, parts, strict=True)]
        lengths = remapped.lengths().view(len(keys), -1)
        totals = torch.stack([c.sum(1) for c in lengths.split(batch, dim=1)]).tolist()  # [source][key]
        pieces = [list(p.split(row)) for p, row in zip(rows, zip(*totals, strict=True), strict=True)]  # [key][source]
        send = torch.cat([pieces[t][s] for s in range(len(batch)) for t in range(len(keys))])
        received = send.new_empty(sum(ctx.input_splits))
        work = dist.all_to_all_single(
            received, send, ctx.input_splits, [sum(row) for row in totals], group=pg, async_op=True
        )
        return work, received

    def evict(self) -> dict[str, torch.Tensor | None]:
        """Per table, the local rows ``[E]`` given to new ids since the last call (torchrec's local indices)."""
        out: dict[str, torch.Tensor | None] = {}
        for table, module in self._managed_collision_modules.items():
            rows = module.evict()
            out[table] = None if rows is None else rows - self._table_to_offset[table]
        return out

    def open_slots(self) -> dict[str, torch.Tensor]:
        return {table: module.open_slots() for table, module in self._managed_collision_modules.items()}

    def sharded_buffer_names(self, prefix: str = "") -> list[str]:
        """The buffers saved as ``ShardedTensor``\\ s (torchrec's ``sharded_parameter_names``)."""
        names = []
        for table, module in self._managed_collision_modules.items():
            for name, _ in module.named_buffers():
                if name not in _LOCAL_BUFFERS and name not in module._non_persistent_buffers_set:
                    names.append(f"{prefix}_managed_collision_modules.{table}.{name}")
            for name, _ in module.named_parameters():  # hash ZCH's _hash_zch_identities
                names.append(f"{prefix}_managed_collision_modules.{table}.{name}")
        return names


class RemappedFeaturesAwaitable(LazyAwaitable[KeyedJaggedTensor]):
    """The remapped KJT of this rank's samples, as the unsharded module returns it (the MCC's keys, the input's
    lengths and weights, global rows as values).

    Args:
        features: this rank's preprocessed input (keys, lengths, weights).
        keys: the output's keys (the unsharded ``ManagedCollisionCollection``'s feature order).
        returns: per sharding, ``(its feature names, its context, (work, received))`` of
            :meth:`ShardedManagedCollisionCollection.return_dist`; ``received`` is in the bucketized order and the
            context's ``unbucketize_permute`` puts it back in input order.
    """

    def __init__(self, features: KeyedJaggedTensor, keys: list[str], returns: list[tuple[list[str], Any, Any]]):
        super().__init__()
        self._features, self._keys, self._returns = features, keys, returns

    def _wait_impl(self) -> KeyedJaggedTensor:
        values: dict[str, torch.Tensor] = {}
        for names, ctx, (work, received) in self._returns:
            work.wait()
            rows = received.index_select(0, ctx.unbucketize_permute.long())
            sizes = ctx.lengths.view(len(names), -1).sum(1).tolist()
            values.update(zip(names, rows.split(sizes), strict=True))
        per_key = self._features.to_dict()
        weights = self._features.weights_or_none()
        return KeyedJaggedTensor(
            keys=self._keys,
            values=torch.cat([values[k] for k in self._keys]),
            weights=None if weights is None else torch.cat([per_key[k].weights() for k in self._keys]),
            lengths=torch.cat([per_key[k].lengths() for k in self._keys]),
            stride=self._features.stride(),
        )


def _counts(segments: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """``[len(names)]`` id counts (one bag per feature: the MCH modules read values only)."""
    return torch.tensor(_sizes(segments, names), dtype=torch.int64, device=segments[names[0]].device)


def _sizes(segments: dict[str, torch.Tensor], names: list[str]) -> list[int]:
    return [segments[f].numel() for f in names]


def _to_sharded_tensors(
    module: ShardedManagedCollisionCollection, destination: dict[str, Any], prefix: str, _metadata: Any
) -> None:
    """Post state-dict hook: per-slot buffers -> ``ShardedTensor`` of the table's ``[num_embeddings]``."""
    for key in module.sharded_buffer_names(prefix):
        table = key[len(prefix) :].split(".")[1]
        local = destination[key]
        where = {
            r: f"rank:{dist.get_global_rank(module._pg, r)}/{local.device}" for _, _, r in module._shard_metadata[table]
        }
        shards = [ShardMetadata([o], [n], where[r]) for o, n, r in module._shard_metadata[table] if n > 0]
        total = sum(n for _, n, _ in module._shard_metadata[table])
        size = torch.Size([total, *local.shape[1:]])
        if local.dim() > 1:
            shards = [
                ShardMetadata([m.shard_offsets[0], 0], [m.shard_sizes[0], *local.shape[1:]], m.placement)
                for m in shards
            ]
        offset = module._table_to_offset[table]
        (mine,) = [m for m in shards if m.shard_offsets[0] == offset]
        meta = ShardedTensorMetadata(shards, size, TensorProperties(dtype=local.dtype))
        destination[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, mine)], meta, process_group=module._pg
        )


def _from_sharded_tensors(
    module: ShardedManagedCollisionCollection, state_dict: dict[str, Any], prefix: str, *_args: Any
) -> None:
    """Load pre-hook: a ``ShardedTensor`` entry -> its local shard (it must hold this rank's rows, as DCP loads)."""
    for key in module.sharded_buffer_names(prefix):
        value = state_dict.get(key)
        if value is None:
            continue
        if not isinstance(value, ShardedTensor):
            raise TypeError(
                f"state_dict[{key!r}] must be a ShardedTensor (a sharded managed-collision buffer), "
                f"got {type(value).__name__}"
            )
        table = key[len(prefix) :].split(".")[1]
        offset = module._table_to_offset[table]
        local = [s.tensor for s in value.local_shards() if s.metadata.shard_offsets[0] == offset]
        if len(local) != 1:
            raise ValueError(f"state_dict[{key!r}] holds no local shard at row {offset} (this rank's rows)")
        state_dict[key] = local[0]


__all__ = ["RemappedFeaturesAwaitable", "ShardedManagedCollisionCollection", "check_row_wise_plan"]
