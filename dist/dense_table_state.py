"""Dense optimizers over sharded tables on the dense compute kernel (a plain collection under DistributedModelParallel,
trained by the caller's optimizer): how a checkpoint holds their state.

Each rank's optimizer holds state for the shards it owns (``<table>.weight``, ``weight_1``, ...), which depend on the
plan and the rank. The checkpoint therefore keeps that state as it keeps the weights: per table and state entry
(Adagrad's ``sum``, Adam's ``exp_avg`` ...), one ``ShardedTensor`` of the whole table assembled from every rank's
shards, keyed ``<table>.weight`` (scalar entries such as ``step``: the rank's first shard's), so it loads under
another plan or world size. The same parameters take no part in matching the optimizer's param groups to the saved
ones, which are rank 0's: another rank holds other tables.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.dist.sharded_state import is_data_parallel, sharded_tensor
from tritonrec.dist.sharded_tables import TableShards
from tritonrec.dist.types import EmbeddingComputeKernel


def dense_kernel_tables(model: nn.Module) -> dict[str, TableShards]:
    """``<table module path>.weight`` -> the table's shards on this rank (maybe none), for every sharded table on the
    dense kernel (data-parallel tables are whole on every rank: ordinary parameters)."""
    return {
        f"{path}.weight" if path else "weight": module
        for path, module in model.named_modules()
        if isinstance(module, TableShards)
        and module.table.sharding.compute_kernel == EmbeddingComputeKernel.DENSE.value
        and not is_data_parallel(module.table)
    }


def shard_parameter_ids(tables: dict[str, TableShards]) -> set[int]:
    """The ids of this rank's shard parameters of ``tables``."""
    return {id(weight.weight) for module in tables.values() for _, weight in module.local}


def table_state(optimizer: torch.optim.Optimizer, tables: dict[str, TableShards]) -> dict[str, dict[str, Any]]:
    """``<table>.weight`` -> ``{state name: ShardedTensor of the table (live views of the shards' state) or the first
    shard's scalar value}``, for the tables whose local shards all have state."""
    out: dict[str, dict[str, Any]] = {}
    for key, module in tables.items():
        states = [optimizer.state.get(weight.weight) for _, weight in module.local]
        if not states or not all(states):
            continue
        entry: dict[str, Any] = {}
        for name, value in states[0].items():  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor) and value.shape == module.local[0][1].weight.shape:
                pairs = [(shard.spec, state[name]) for (shard, _), state in zip(module.local, states, strict=True)]
                entry[name] = sharded_tensor(module.table, pairs, module._pg, value.device)  # type: ignore[index]
            else:
                entry[name] = value
        out[key] = entry
    return out


def shards_of_saved_tables(tables: dict[str, TableShards], names: dict[int, str], saved: set[str]) -> set[str]:
    """The names of this rank's shard parameters of the tables ``saved`` names (by their first shard's name, which
    is the table's key): a checkpoint's table state covers all of them."""
    out: set[str] = set()
    for module in tables.values():
        if module.local and names.get(id(module.local[0][1].weight)) in saved:
            out.update(names[id(weight.weight)] for _, weight in module.local)
    return out


def copy_scalar_state(optimizer: torch.optim.Optimizer, tables: dict[str, TableShards]) -> None:
    """After a load (which filled the first shard's scalars): the same scalars (``step``) on the table's other local
    shards."""
    for module in tables.values():
        states = [optimizer.state.get(weight.weight) for _, weight in module.local]
        if len(states) < 2 or not all(states):
            continue
        first = states[0]
        for state in states[1:]:
            for name, value in first.items():  # type: ignore[union-attr]
                if not isinstance(value, torch.Tensor):
                    state[name] = value  # type: ignore[index]
                elif value.dim() == 0:  # per-shard tensors (shaped like the shard) came with the table's ShardedTensor
                    state[name].copy_(value)  # type: ignore[index]


__all__ = ["copy_scalar_state", "dense_kernel_tables", "shard_parameter_ids", "shards_of_saved_tables", "table_state"]
