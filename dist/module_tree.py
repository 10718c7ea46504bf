"""Walks of a model's module tree that treat sharded modules as leaves, and a deep copy of a model that keeps its
process groups: what :class:`~tritonrec.dist.model_parallel.DistributedModelParallel` does to the modules around
its sharded ones. Kept apart so the DMP module holds the wrapper itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.types import ShardedModule


def apply_outside_sharded(module: nn.Module, fn: Any) -> None:
    """``fn`` on ``module`` and its descendants, not descending into sharded modules."""
    fn(module)
    if isinstance(module, ShardedModule):
        return
    for child in module.children():
        apply_outside_sharded(child, fn)


def load_into(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    strict: bool,
    missing: list[str],
    unexpected: list[str],
) -> None:
    """torchrec's recursive load: own entries through ``_load_from_state_dict``, sharded modules through their
    ``load_state_dict`` (which may take sharded or unsharded tensors)."""
    if isinstance(module, ShardedModule):
        own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = module.load_state_dict(own, strict=strict)
        missing.extend(prefix + k for k in result.missing_keys)
        unexpected.extend(prefix + k for k in result.unexpected_keys)
        return
    errors: list[str] = []
    module._load_from_state_dict(state_dict, prefix, {}, strict, missing, unexpected, errors)
    if errors:
        raise RuntimeError("load_state_dict: " + "; ".join(errors))
    for name, child in module.named_children():
        load_into(child, state_dict, f"{prefix}{name}.", strict, missing, unexpected)


def copies_itself(module: nn.Module) -> bool:
    """torchrec's ``CopyMixIn``: the module's class defines ``copy(device)`` (``nn.Module`` has none), which a model
    copy calls instead of deep-copying the module (the quantized collections, sharded or not, return themselves:
    their tables stay where they are, as torchrec's ``ModuleNoCopyMixin``)."""
    return callable(getattr(type(module), "copy", None))


def self_copying_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module``'s tree that :func:`copies_itself` holds for, not descending into them."""
    if copies_itself(module):
        return [module]
    return [found for child in module.children() for found in self_copying_modules(child)]


def move_outside(module: nn.Module, device: torch.device, kept: set[int]) -> None:
    """``module.to(device)``, except for the modules whose ids are in ``kept`` (and their descendants)."""
    if id(module) in kept:
        return
    if not any(id(m) in kept for m in module.modules()):
        module.to(device)
        return
    module._apply(lambda t: t.to(device), recurse=False)
    for child in module.children():
        move_outside(child, device, kept)


@contextlib.contextmanager
def process_groups_not_copied() -> Iterator[None]:
    """``copy.deepcopy`` of a model keeps its process groups (they cannot be copied; the copy talks on the same)."""
    had = "__deepcopy__" in dist.ProcessGroup.__dict__
    previous = dist.ProcessGroup.__dict__.get("__deepcopy__")
    dist.ProcessGroup.__deepcopy__ = lambda self, memo: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            dist.ProcessGroup.__deepcopy__ = previous  # type: ignore[method-assign]
        else:
            del dist.ProcessGroup.__deepcopy__
