"""What a checkpoint holds: one nested state dict that ``torch.distributed.checkpoint`` (DCP) saves, and loads back in
place into the same structure built from the objects being restored.

    {"model": model.state_dict(),                       # sharded tables as ShardedTensors (any plan, or unsharded)
     "fused_optimizer": {module path: {table: {"momentum1": ..., "momentum2": ..., "step": ...}}},
     "fused_hyperparameters": {module path: JSON of the fused optimizer's param_groups[0] (a list of all its
                               groups when it has several: tables with different optimizers)},
     "optimizers": {name: {"state": {parameter name: {state name: tensor}}, "param_groups": JSON}},
     "extra": {name: torch.save bytes of the object's state}}

Everything is keyed by name (table, parameter, module path), never by position or rank, so a checkpoint saved under
one plan and world size loads under another, and sharded and unsharded models read each other's checkpoints. Fused
optimizer state is keyed by table in both forms (sharded modules: :mod:`tritonrec.dist.sharded_state`). Dense
optimizer state is replicated across ranks (DDP), so DCP writes it once, except that of sharded tables on the dense
kernel, which is whole tables as ShardedTensors (:mod:`tritonrec.dist.dense_table_state`). Extra state (a data
position, a history) is an opaque blob written by rank 0: an object with ``state_dict`` / ``load_state_dict`` (or
datarax's ``get_state`` / ``set_state``) is restored through them, any other value is returned as loaded.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tritonrec.dist.dense_table_state import (
    copy_scalar_state,
    dense_kernel_tables,
    shard_parameter_ids,
    shards_of_saved_tables,
    table_state,
)
from tritonrec.dist.embedding_tower_base import ShardedEmbeddingTowers
from tritonrec.dist.model_parallel import get_unwrapped_module
from tritonrec.dist.sharded_fused_optimizer import HyperparamsOnlyOptimizer
from tritonrec.dist.sharded_state import fused_optimizer_state_dict, load_fused_optimizer_state_dict
from tritonrec.dist.sharded_tables import NoLocalShardsOptimizer, ShardedTablesMixin
from tritonrec.kernels.embedding.optim_state import check_hyperparameters
from tritonrec.modules.fused_embedding_modules import EmbeddingFusedOptimizer, _FusedMixin
from tritonrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, check_param_groups

_FUSED_OPTIMIZERS = (EmbeddingFusedOptimizer, HyperparamsOnlyOptimizer, NoLocalShardsOptimizer)
_SHARDED_TABLES = "sharded_tables"  # in a saved param group: the keys of the dense-kernel sharded tables


# ------------------------------------------------------------------------------------------------ fused optimizer
def fused_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> every sharded table collection and unsharded fused collection of ``model``."""
    return {
        path: m
        for path, m in get_unwrapped_module(model).named_modules()
        if isinstance(m, (ShardedTablesMixin, _FusedMixin)) and getattr(m, "fused_optimizer", None) is not None
    }


def _unsharded_fused_state(module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{table: {state name: live view}}`` of an unsharded fused collection (parameters ``<c>.<table>.weight``)."""
    optimizer = module.fused_optimizer  # type: ignore[attr-defined]
    return {name.split(".")[-2]: dict(optimizer.state[param]) for name, param in optimizer.params.items()}


def _hyperparameters(module: nn.Module) -> list[dict[str, Any]]:
    """The live param groups of ``module``'s fused optimizer."""
    return list(module.fused_optimizer.param_groups)  # type: ignore[attr-defined]


def _fused_entries(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    states, hyper = {}, {}
    for path, module in fused_modules(model).items():
        if isinstance(module, ShardedTablesMixin):
            if not module.lookup_options.has_fused:
                continue  # dense kernel: no fused optimizer state
            states[path] = fused_optimizer_state_dict(module)
        else:
            states[path] = _unsharded_fused_state(module)
        groups = [_without_params(group) for group in _hyperparameters(module)]
        hyper[path] = _to_json(groups[0] if len(groups) == 1 else groups, f"fused optimizer of {path!r}")
    return states, hyper


# ----------------------------------------------------------------------------------------------- dense optimizers
def _without_params(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError as err:
        raise TypeError(f"{what}: hyperparameters must be plain numbers, strings or lists to be saved: {err}") from None


def dense_optimizers(optimizers: Mapping[str, Any] | torch.optim.Optimizer | None) -> dict[str, torch.optim.Optimizer]:
    """Name -> every optimizer that is not a fused one (a CombinedOptimizer contributes its dense children)."""
    if optimizers is None:
        return {}
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = {"optimizer": optimizers}
    if not isinstance(optimizers, Mapping):
        raise TypeError(f"optimizers must be a dict of name -> optimizer, got {type(optimizers).__name__}")
    out: dict[str, torch.optim.Optimizer] = {}

    def collect(name: str, optimizer: Any) -> None:
        if isinstance(optimizer, CombinedOptimizer):
            for i, (key, child) in enumerate(optimizer.optimizers):
                collect(f"{name}.{key or i}", child)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{name!r}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        elif not isinstance(optimizer, _FUSED_OPTIMIZERS):  # fused state is saved per table, from the model
            out[name] = optimizer

    for name, optimizer in optimizers.items():
        collect(str(name), optimizer)
    return out


def _parameter_names(optimizer: torch.optim.Optimizer, model: nn.Module, name: str) -> dict[int, str]:
    """id(parameter) -> its name: the keyed optimizer's own names, else the model's."""
    if isinstance(optimizer, KeyedOptimizer):
        return {id(p): key for key, p in optimizer.params.items()}
    names = {id(p): key for key, p in get_unwrapped_module(model).named_parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"optimizers[{name!r}] param_groups[{i}] holds a parameter the model does not have")
    return names


def _host_local_parameter_ids(model: nn.Module) -> set[int]:
    """The parameters that live on some ranks only: a tower-sharded module's interactions, on their tower's host.
    Like sharded tables' shards they take no part in naming a param group, whose saved copy must be the same on
    every rank (their state is saved by name, by the ranks that hold them)."""
    return {
        id(p)
        for m in get_unwrapped_module(model).modules()
        if isinstance(m, ShardedEmbeddingTowers)
        for p in m.parameters()
    }


def _dense_entry(optimizer: torch.optim.Optimizer, model: nn.Module, name: str) -> dict[str, Any]:
    names = _parameter_names(optimizer, model, name)
    tables = dense_kernel_tables(get_unwrapped_module(model))
    shards = shard_parameter_ids(tables)
    unnamed = shards | _host_local_parameter_ids(model)  # left out of the groups' names (their state is saved)
    groups = []
    for group in optimizer.param_groups:
        saved = _without_params(group)
        saved["params"] = [names[id(p)] for p in group["params"] if id(p) not in unnamed]  # the same on every rank
        saved[_SHARDED_TABLES] = sorted(tables)  # every rank knows every table (not which group holds it)
        groups.append(saved)
    state = {names[id(p)]: s for p, s in optimizer.state.items() if s and id(p) not in shards}
    state.update(table_state(optimizer, tables))  # whole tables, as ShardedTensors (dist/dense_table_state.py)
    return {"state": state, "param_groups": _to_json(groups, f"optimizers[{name!r}]")}


def saved_state_names(saved_keys: set[str], name: str, parameter_names: list[str]) -> set[str]:
    """The parameters of dense optimizer ``name`` that the checkpoint (its flattened keys ``saved_keys``) holds state
    for: keys ``optimizers.<name>.state.<parameter>.<state name>``, matched to the longest parameter name."""
    prefix = f"optimizers.{name}.state."
    by_length = sorted(parameter_names, key=len, reverse=True)
    out = set()
    for key in saved_keys:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            match = next((p for p in by_length if rest.startswith(p + ".")), None)
            if match is not None:
                out.add(match)
    return out


def init_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None, saved: set[str] | None = None
) -> None:
    """Make the optimizer's state hold exactly the parameters a checkpoint has state for, so that a strict load has
    a tensor for each of its entries and no entry it lacks: the missing state is created by one step on zero
    gradients of those parameters only (the parameters it may move are restored by the same load); the state of a
    parameter the checkpoint has none for is dropped (torch's optimizers skip a parameter whose gradient was
    ``None``: an unused head or a frozen branch had no state when saved, and must have none after the load).

    ``names``: ``id(parameter) -> name``; ``saved``: the names with state in the checkpoint (both ``None``: every
    parameter that requires a gradient, the behaviour for an optimizer without any state)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if saved is None or names is None:
        wanted = {id(p) for p in params if p.requires_grad}
    else:
        wanted = {id(p) for p in params if names.get(id(p)) in saved}
    for param in params:
        if id(param) not in wanted and optimizer.state.get(param):
            del optimizer.state[param]
    create = {id(p) for p in params if id(p) in wanted and not optimizer.state.get(p)}
    if not create:
        return
    grads = [p.grad for p in params]
    try:
        for param in params:  # only the parameters to create state for take part in the step
            param.grad = torch.zeros_like(param) if id(param) in create else None
        optimizer.step()
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad


def _apply_param_groups(optimizer: torch.optim.Optimizer, saved_json: str, model: nn.Module, name: str) -> None:
    saved = json.loads(saved_json)
    names = _parameter_names(optimizer, model, name)
    tables = dense_kernel_tables(get_unwrapped_module(model))
    shards = shard_parameter_ids(tables) | _host_local_parameter_ids(model)  # as in _dense_entry
    # sharded tables (here, or when saved) take no part in matching groups: which group holds them depends on the rank
    skip = set(tables) | {t for g in saved for t in g.pop(_SHARDED_TABLES, [])}
    by_params = {tuple(sorted(n for n in g["params"] if n not in skip)): g for g in saved}
    pairs = []
    keys = [
        tuple(sorted(names[id(p)] for p in group["params"] if id(p) not in shards and names[id(p)] not in skip))
        for group in optimizer.param_groups
    ]
    for i, (group, key) in enumerate(zip(optimizer.param_groups, keys, strict=True)):
        if key not in by_params:
            raise ValueError(f"optimizers[{name!r}] param_groups[{i}]: the checkpoint has no group over {list(key)}")
        if keys.count(key) > 1:  # only sharded tables' shards tell them apart, and those differ by rank and plan
            raise ValueError(
                f"optimizers[{name!r}] has {keys.count(key)} param groups over the same parameters {list(key)} apart "
                "from sharded tables' shards: a checkpoint cannot tell them apart; give each group a parameter of its "
                "own"
            )
        pairs.append((group, by_params[key]))
    check_param_groups([g for _, g in pairs], f"optimizers[{name!r}] in the checkpoint:")
    for group, loaded in pairs:
        for key, value in loaded.items():
            if key != "params":
                group[key] = tuple(value) if key == "betas" else value


# ---------------------------------------------------------------------------------------------------- extra state
def _extra_state(value: Any) -> Any:
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return value.state_dict()
    if callable(getattr(value, "get_state", None)) and callable(getattr(value, "set_state", None)):
        return value.get_state()
    return value


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _restore_extra(target: Any, blob: bytes, name: str) -> Any:
    value = torch.load(io.BytesIO(blob), weights_only=False)
    if callable(getattr(target, "state_dict", None)) and callable(getattr(target, "load_state_dict", None)):
        target.load_state_dict(value)
        return target
    if callable(getattr(target, "get_state", None)) and callable(getattr(target, "set_state", None)):
        target.set_state(value)
        return target
    return value


# -------------------------------------------------------------------------------------------------------- the whole
def build_state(
    model: nn.Module,
    optimizers: Mapping[str, Any] | torch.optim.Optimizer | None,
    extra_state: Mapping[str, Any] | None,
    saved_keys: set[str] | None = None,
) -> dict[str, Any]:
    """The nested state dict of ``model``, its optimizers and ``extra_state`` (see module docstring); live tensors,
    so a DCP load fills them in place. For a load, ``saved_keys`` are the checkpoint's (flattened) keys: a dense
    optimizer whose state the checkpoint holds gets its lazily created state first."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if extra_state is not None and not isinstance(extra_state, Mapping):
        raise TypeError(f"extra_state must be a dict of name -> value, got {type(extra_state).__name__}")
    dense = dense_optimizers(optimizers)
    for_load = saved_keys is not None
    for name, optimizer in dense.items():
        if for_load:  # the live state must hold exactly the parameters the checkpoint has state for
            names = _parameter_names(optimizer, model, name)
            saved = saved_state_names(saved_keys, name, list(names.values()))  # type: ignore[arg-type]
            saved |= shards_of_saved_tables(dense_kernel_tables(get_unwrapped_module(model)), names, saved)
            init_optimizer_state(optimizer, names, saved)
    fused, hyper = _fused_entries(model)
    return {
        "model": model.state_dict(),
        "fused_optimizer": fused,
        "fused_hyperparameters": hyper,
        "optimizers": {name: _dense_entry(opt, model, name) for name, opt in dense.items()},
        "extra": {str(k): b"" if for_load else _to_bytes(_extra_state(v)) for k, v in (extra_state or {}).items()},
    }


def apply_loaded_state(
    state: dict[str, Any],
    model: nn.Module,
    optimizers: Mapping[str, Any] | torch.optim.Optimizer | None,
    extra_state: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """After a DCP load into :func:`build_state`'s dict: load what was not filled in place (sharded modules' state
    dicts, column blocks' per-row state, hyperparameters, extra state); returns the extra state as restored."""
    model.load_state_dict(state["model"])
    modules = fused_modules(model)
    for path, entry in state["fused_optimizer"].items():
        if isinstance(modules[path], ShardedTablesMixin):
            load_fused_optimizer_state_dict(modules[path], entry)
    for path, saved in state["fused_hyperparameters"].items():
        loaded = json.loads(saved)
        groups = loaded if isinstance(loaded, list) else [loaded]
        live_groups = _hyperparameters(modules[path])
        if len(groups) != len(live_groups):
            raise ValueError(
                f"fused optimizer of {path!r}: the checkpoint has {len(groups)} param groups, the model "
                f"{len(live_groups)} (its tables' fused optimizers differ)"
            )
        for i, hyper in enumerate(groups):
            check_hyperparameters(hyper, f"fused optimizer of {path!r} in the checkpoint, param_groups[{i}]: ")
        for hyper, live in zip(groups, live_groups, strict=True):
            for key, value in hyper.items():
                live[key] = tuple(value) if key == "betas" else value
    dense = dense_optimizers(optimizers)
    tables = dense_kernel_tables(get_unwrapped_module(model))
    for name, entry in state["optimizers"].items():
        _apply_param_groups(dense[name], entry["param_groups"], model, name)
        copy_scalar_state(dense[name], tables)
    return {k: _restore_extra(v, state["extra"][str(k)], str(k)) for k, v in (extra_state or {}).items()}


__all__ = [
    "apply_loaded_state",
    "build_state",
    "dense_optimizers",
    "fused_modules",
    "init_optimizer_state",
    "saved_state_names",
]
