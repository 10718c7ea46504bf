"""The state plumbing of :class:`~tritonrec.optim.keyed.KeyedOptimizer`: hyperparameter checks of param groups, the
fields ``torch.optim.Optimizer.__init__`` would have set, and the strict, check-then-copy load of a saved state into
the live one (same keys and shapes, tensors filled in place). ``check_param_groups`` is re-exported by
:mod:`tritonrec.optim.keyed`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

import torch

from tritonrec.kernels.embedding.optim_state import check_hyperparameters

__all__ = ["check_loadable", "check_param_groups", "copy_into", "init_torch_optimizer_fields"]


def check_param_groups(param_groups: Collection[Mapping[str, Any]], what: str) -> None:
    """Validate every group's ``lr`` / ``eps`` / ``weight_decay`` / ``betas`` (see
    :mod:`tritonrec.optim.keyed`'s docstring)."""
    for i, group in enumerate(param_groups):
        check_hyperparameters(group, f"{what} param_groups[{i}]: ")


def init_torch_optimizer_fields(optimizer: torch.optim.Optimizer) -> None:
    """The hook registries ``torch.optim.Optimizer.__init__`` creates (which we cannot call: it adds param groups
    by position, while keyed optimizers take their groups as they are)."""
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    optimizer._patch_step_function()  # step pre/post hooks and the profiler label, as torch's __init__ sets up


def check_loadable(current: Any, loaded: Any, path: str) -> None:
    """Raise ``ValueError`` naming ``path`` when ``loaded`` cannot be copied into ``current`` (other keys or shapes)."""
    if isinstance(current, dict):
        if not isinstance(loaded, Mapping) or set(loaded) != set(current):
            keys = sorted(loaded) if isinstance(loaded, Mapping) else type(loaded).__name__
            raise ValueError(f"state {path} has keys {keys}, expected {sorted(current)}")
        for key in current:
            check_loadable(current[key], loaded[key], f"{path}.{key}")
    elif isinstance(current, torch.Tensor):
        shape = tuple(torch.as_tensor(loaded).shape)
        if shape != tuple(current.shape):
            raise ValueError(f"state {path} has shape {shape}, expected {tuple(current.shape)}")


def copy_into(current: Any, loaded: Any) -> Any:
    """Copy ``loaded`` into ``current`` in place where it is a tensor, a nested dict or a stateful object; return
    the value to store for anything else (a deep copy)."""
    if isinstance(current, dict):
        for key in current:
            current[key] = copy_into(current[key], loaded[key])
        return current
    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.copy_(torch.as_tensor(loaded))
        return current
    if hasattr(current, "load_state_dict") and callable(current.load_state_dict):
        current.load_state_dict(loaded)
        return current
    return copy.deepcopy(loaded)
