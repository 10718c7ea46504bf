"""``torch.optim.SGD`` / ``Adam`` / ``Adagrad`` keyword arguments as the fused rules take them.

A fused collection built with a torch optimizer class (torchrec's spelling: SGD -> ``EXACT_SGD``, Adam -> ``ADAM``,
Adagrad -> ``EXACT_ADAGRAD``) takes that class's keyword arguments:

* the rule's own hyperparameters pass through (``lr``, ``eps``, ``weight_decay``, Adam's ``betas``, Adagrad's
  ``initial_accumulator_value``, which the fused state starts at, as torch's ``state_sum``);
* implementation choices that do not change the result are dropped at any value: ``foreach`` (how torch loops over
  parameters) and ``fused`` (the fused rule is fused anyway);
* every other argument is dropped at its default (``lr_decay=0``, ``momentum=0``, ``amsgrad=False``,
  ``maximize=False``, ``differentiable=False``, ``capturable=False``, ...; SGD's ``dampening`` at any value, since
  it has no effect without momentum) and refused otherwise with a ``ValueError`` naming the argument, its value and
  why the fused rule cannot honour it.

(torchrec 1.8 hands these arguments to FBGEMM's TBE, which raises ``TypeError`` on every one it does not know, at
defaults too (``lr_decay=0``, ``foreach=None``), and silently ignores SGD's ``momentum``.)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from tritonrec.kernels.embedding import OptimType
from tritonrec.kernels.embedding.optim_state import hyperparameter_names

# arguments that pick how torch computes the same rule, not what it computes: accepted at any value
_IMPLEMENTATION_ONLY = frozenset({"foreach", "fused"})

# why a non-default value cannot be honoured (the message's last part)
_REASONS = {
    "momentum": "the fused SGD rule keeps no momentum buffer",
    "nesterov": "the fused SGD rule keeps no momentum buffer",
    "lr_decay": (
        "the fused Adagrad rule has no learning-rate decay (schedule lr through fused_optimizer.param_groups[0] "
        "instead)"
    ),
    "amsgrad": "the fused Adam rule keeps no running maximum of the second moment",
    "decoupled_weight_decay": "the fused Adam rule adds weight decay to the gradient (Adam's L2), not to the weights",
    "maximize": "the fused rules descend the gradient",
    "differentiable": "the fused update runs inside the backward, outside autograd",
    "capturable": "the fused rules take no CUDA-graph capturable mode",
}


def _is_default(value: Any, default: Any) -> bool:
    """``value`` equals the class's default (``None``, or a number / bool / one-element tensor of its value)."""
    if default is None:
        return value is None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex:
            return False
        value = value.item()
    return isinstance(value, (bool, int, float)) and value == default


def torch_optimizer_kwargs(
    optimizer_class: type, optim: OptimType, optimizer_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """``optimizer_kwargs`` of ``optimizer_class`` (a torch optimizer mapped to the fused rule ``optim``) as the
    rule's hyperparameters (see module docstring); raises ``ValueError`` naming an argument the class does not take
    or a value the rule cannot honour."""
    name = f"torch.optim.{optimizer_class.__name__}"
    signature = {
        key: parameter.default
        for key, parameter in inspect.signature(optimizer_class.__init__).parameters.items()
        if key not in ("self", "params")
    }
    rule_names = hyperparameter_names(optim)
    out: dict[str, Any] = {}
    for key, value in optimizer_kwargs.items():
        if key in rule_names:
            out[key] = value
        elif key not in signature:
            raise ValueError(f"{name} takes no argument {key!r} (got {key}={value!r}); it takes {sorted(signature)}")
        elif key in _IMPLEMENTATION_ONLY:
            continue
        elif key == "dampening" and _is_default(optimizer_kwargs.get("momentum", 0), 0):
            continue  # dampening scales the momentum buffer, which does not exist without momentum
        elif not _is_default(value, signature[key]):
            reason = _REASONS.get(key, f"the fused {optim.name} rule only takes it at its default")
            raise ValueError(
                f"{name} argument {key}={value!r} cannot be honoured by the fused {optim.name} rule: {reason}; "
                f"pass {key}={signature[key]!r} or leave it out"
            )
    return out


__all__ = ["torch_optimizer_kwargs"]
