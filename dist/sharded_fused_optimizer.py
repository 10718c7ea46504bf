"""The fused optimizer of a sharded collection: a :class:`~tritonrec.optim.KeyedOptimizer` whose ``state_dict`` holds
whole tables as ``ShardedTensor``\\ s, so ``torch.distributed.checkpoint`` (DCP) saves and re-shards it exactly.

Its live ``state`` / ``params`` are this rank's shards (``<container>.<table>.weight``, ``weight_1``, ...: what the
kernels update). Its ``state_dict()`` is keyed by table, the same on every rank, as torchrec's::

    {"state": {"<container>.<table>.weight": {"momentum1": ShardedTensor, "momentum2": ..., "step": Tensor}},
     "param_groups": [{hyperparameters, "params": the names of its tables}, ...]}

One param group per distinct fused optimizer of the module's fused tables (one, unless ``apply_optimizer_in_backward``
gave tables different optimizers or hyperparameters), each the live hyperparameter dict of its tables' fused state:
an LR scheduler or a ``param_groups[i]["lr"]`` edit reaches exactly those tables. Every rank has every group (empty
where it holds none of its tables), so the groups and their order are the same on every rank.

* per-element state (Adam's moments, ``EXACT_ADAGRAD``'s ``momentum1``) ``[rows, dim]``, sharded like the table's
  weight (same shard metadata: a column-split table's blocks each hold their own columns' state);
* per-row state (rowwise Adagrad's ``momentum1``) ``[rows]``, one shard per row range; a column-split table's
  blocks share one per-row state (:mod:`tritonrec.dist.column_adagrad`), saved by each row range's first column
  block and sent to the other blocks after a load (as :mod:`tritonrec.dist.checkpoint` saves it);
* data-parallel tables: the local replica (a plain tensor: DCP writes one copy);
* ``step``: a plain 0-d tensor on the ranks holding a shard of the table (equal on all of them).

Plain tensors of per-rank shards would be taken for replicated copies: DCP would keep one rank's and load it on every
rank (silently wrong with equal shard sizes, a size error otherwise). ``ShardedTensor``\\ s carry their global
offsets, so a checkpoint saved under one plan loads under another::

    sd = dmp.fused_optimizer.state_dict()          # every rank
    dcp.load(sd, checkpoint_id=path)               # DCP reads each local shard's region, in place
    dmp.fused_optimizer.load_state_dict(sd)        # copies into the live state (collective: column-split tables)

``load_state_dict`` also takes an unsharded module's state dict (full tensors: each rank keeps its slice) and checks
everything before writing anything; ``state_dict()`` returns copies (as the unsharded fused optimizer does), the
combined ``dmp.fused_optimizer.state_dict()`` live views (for DCP to load into).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from tritonrec.dist.sharded_state import (
    check_covered,
    fused_optimizer_state_dict,
    fused_state_keys,
    fused_tables,
    is_data_parallel,
    load_fused_optimizer_state_dict,
    syncs_column_row_state,
)
from tritonrec.dist.sharding.common import ShardedTable
from tritonrec.kernels.embedding import FusedOptimizerState
from tritonrec.kernels.embedding.optim_state import check_hyperparameters
from tritonrec.modules.fused_embedding_modules import EmbeddingFusedOptimizer
from tritonrec.modules.table_batched import TableGroup
from tritonrec.optim.keyed import KeyedOptimizer
from tritonrec.optim.keyed_state import check_param_groups


def _clone(value: Any) -> Any:
    """A copy of a state tensor (a ShardedTensor keeps its metadata, its local shards are copied)."""
    if isinstance(value, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in value.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, value.metadata(), process_group=value._process_group
        )
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _global_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.size()) if isinstance(value, ShardedTensor) else tuple(value.shape)


class ShardedFusedState:
    """The sharded ``state_dict`` / ``load_state_dict`` of a sharded collection's fused optimizer (see module
    docstring); mixed into a :class:`~tritonrec.optim.KeyedOptimizer` whose ``_sharded_module`` is the collection."""

    _sharded_module: Any

    def _label(self) -> str:
        return "fused optimizer"

    def _key(self, table: str) -> str:
        return f"{self._sharded_module._container}.{table}.weight"

    def keyed_state(self) -> dict[str, Any]:
        """Table weight name -> ``{state name: ShardedTensor (live views) | Tensor}``, of the fused tables this rank
        holds a shard of. A ShardedTensor without local shards is left out (as an empty table entry): DCP drops
        one from what it loads, and a dropped key makes it guess a torch 2.3 checkpoint, whose key layout differs
        for an empty dict."""
        out = {}
        for table, entry in fused_optimizer_state_dict(self._sharded_module).items():
            kept = {k: v for k, v in entry.items() if not (isinstance(v, ShardedTensor) and not v.local_shards())}
            if kept:
                out[self._key(table)] = kept
        return out

    def keyed_optional(self) -> set[str]:
        """Every fused table's name: a full (unsharded) state dict or another rank's has them all."""
        return {self._key(t.name) for t in fused_tables(self._sharded_module)}

    def keyed_group_params(self, group: Mapping[str, Any]) -> list[str]:
        """The names of the fused tables whose hyperparameters ``group`` is, the same on every rank (DCP saves one
        rank's param groups); every fused table's when the module has one group."""
        module = self._sharded_module
        tables = fused_tables(module)
        if len(self.param_groups) > 1:  # type: ignore[attr-defined]
            tables = [t for t in tables if module.lookup_options.fused_of(t.name).hyperparams is group]
        return sorted(self._key(t.name) for t in tables)

    def state_dict(self) -> dict[str, Any]:
        """The sharded state dict (see module docstring), as copies."""
        out = KeyedOptimizer.state_dict(self)  # type: ignore[arg-type]
        out["state"] = {name: {k: _clone(v) for k, v in entry.items()} for name, entry in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a :meth:`state_dict` (after a DCP load into it, or with full tensors) into the live state and
        hyperparameters; nothing is written unless everything checks. Collective when a column-split table has
        per-row state."""
        KeyedOptimizer.load_state_dict(self, state_dict)  # type: ignore[arg-type]

    def check_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the table and state when ``loaded`` does not fit: other tables or state keys,
        another global shape, a ShardedTensor whose local shards miss part of this rank's shards."""
        error: ValueError | None = None
        try:
            self.check_state_names(loaded)  # type: ignore[attr-defined]
            live = self.keyed_state()
            for table in fused_tables(self._sharded_module):
                name = self._key(table.name)
                if name in live:
                    self._check_entry(name, table, live[name], loaded[name])
        except (ValueError, TypeError) as err:
            error = ValueError(str(err)) if isinstance(err, TypeError) else err
        self._agree(error)

    def _check_entry(self, name: str, table: ShardedTable, live: dict[str, Any], got: Any) -> None:
        if not isinstance(got, Mapping):
            raise ValueError(f"state {name} must be a dict of state name -> tensor, got {type(got).__name__}")
        known = set(fused_state_keys(self._sharded_module, table.name)) | {"step"}
        if not set(live) <= set(got) <= known:  # more than this rank's: a full state dict, or another rank's
            raise ValueError(f"state {name} has keys {sorted(got)}, expected {sorted(live)}")
        module = self._sharded_module
        specs = [shard.spec for shard, _ in module.embedding_tables().get(table.name, [])]
        first_block = min(s.col_offset for s in table.shards)
        for key, target in live.items():
            value = got[key]
            if key == "step" and not isinstance(value, (torch.Tensor, ShardedTensor)):
                value = torch.as_tensor(value)
            if not isinstance(value, (torch.Tensor, ShardedTensor)):
                raise ValueError(f"state {name}.{key} must be a tensor or ShardedTensor, got {type(value).__name__}")
            if _global_shape(value) != _global_shape(target):
                raise ValueError(
                    f"state {name}.{key} has shape {_global_shape(value)}, expected {_global_shape(target)}"
                )
            if isinstance(value, ShardedTensor):
                rowwise = len(_global_shape(value)) == 1
                for spec in specs:
                    if not rowwise or spec.col_offset == first_block or is_data_parallel(table):
                        check_covered(f"{name}.{key}", value, spec, rowwise)

    def _agree(self, error: ValueError | None) -> None:
        """Raise ``error``; when the load is collective (column-split per-row state is sent between ranks after the
        copy), every rank raises if one does, instead of the others waiting for it."""
        module = self._sharded_module
        pg = module.process_group
        if syncs_column_row_state(module) and pg is not None and dist.is_initialized() and dist.get_world_size(pg) > 1:
            flag = torch.tensor([0 if error is None else 1], device=module.state_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
            if error is None and int(flag.item()):
                raise ValueError("fused optimizer load_state_dict: another rank refused the state (see its error)")
        if error is not None:
            raise error

    def copy_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        module = self._sharded_module
        load_fused_optimizer_state_dict(
            module, {t.name: loaded.get(self._key(t.name), {}) for t in fused_tables(module)}
        )


class ShardedEmbeddingFusedOptimizer(ShardedFusedState, EmbeddingFusedOptimizer):
    """:class:`~tritonrec.modules.EmbeddingFusedOptimizer` over this rank's shards of ``module``'s tables, with the
    sharded state dict and one param group per fused optimizer (see module docstring).

    Args:
        module: the sharded collection.
        slots / states / groups: as for the unsharded optimizer (every state's ``hyperparams`` is one of
            ``hyperparams``).
        hyperparams: the live hyperparameter dict of each distinct fused optimizer, the param groups in order.
    """

    def __init__(
        self,
        module: Any,
        slots: list[tuple[str, TableGroup, int]],
        states: list[FusedOptimizerState],
        groups: list[TableGroup],
        hyperparams: list[dict[str, Any]],
    ) -> None:
        self._sharded_module = module
        self._group_hyperparams = list(hyperparams)
        super().__init__(slots, states, groups, hyperparams[0])
        check_param_groups(self.param_groups, self._label())

    def rebuild_state_views(self) -> None:
        """As the unsharded optimizer's, then each param group gets the parameters of its tables."""
        EmbeddingFusedOptimizer.rebuild_state_views(self)
        self.param_groups = list(self._group_hyperparams)
        for group in self.param_groups:
            group["params"] = []
        for _, group, t in self._slots:
            hyperparams = self._fused_states[self._table_groups.index(group)].hyperparams
            owner = next((g for g in self.param_groups if g is hyperparams), None)
            if owner is None:
                raise RuntimeError(f"the fused state of table slot {t} has hyperparameters of no param group")
            owner["params"].append(group.params[t])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """No update (it already happened in the backward); checks every group's hyperparameters."""
        for i, group in enumerate(self.param_groups):
            check_hyperparameters(group, f"fused optimizer param_groups[{i}]: ")


class NoLocalShardsOptimizer(ShardedFusedState, KeyedOptimizer):
    """The fused optimizer of a rank that holds no shard: no live state, the module's param groups (the live dicts:
    an LR schedule on them reaches the other ranks' the same way), and the same state dict keys as the other ranks."""

    def __init__(self, module: Any, hyperparams: list[dict[str, Any]]) -> None:
        self._sharded_module = module
        for group in hyperparams:
            group.setdefault("params", [])
        super().__init__({}, {}, list(hyperparams))
        self.save_param_groups(True)

    def __call__(self) -> NoLocalShardsOptimizer:
        return self

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """No-op (no shards)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op (no shards)."""


class HyperparamsOnlyOptimizer(KeyedOptimizer):
    """A module's fused optimizer seen from DistributedModelParallel's combined one where it holds no keyed state:
    its param groups are shared (so an LR schedule sees them), its step and zero_grad do nothing (the update runs in
    the backward)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__({}, {}, optimizer.param_groups)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


__all__ = ["HyperparamsOnlyOptimizer", "NoLocalShardsOptimizer", "ShardedEmbeddingFusedOptimizer", "ShardedFusedState"]
