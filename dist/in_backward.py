"""torch's ``apply_optimizer_in_backward`` on an unsharded module's tables -> the sharded module's fused optimizer.

torchrec's recipe (its dlrm_main) chooses the embedding optimizer this way: ``apply_optimizer_in_backward(
torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": ...})`` before ``DistributedModelParallel``. It marks each
table's parameter with ``_optimizer_classes`` / ``_optimizer_kwargs`` (and, in eager, steps it inside the backward);
the sharder reads them and the tables' shards update inside the backward with the matching fused rule. Without this
the sharded tables would silently lose the optimizer the user chose.

A table's own optimizer overrides the sharder's ``fused_params`` (torchrec's ``merge_fused_params`` order).
Hyperparameters the user left out take the torch class's defaults (``torch.optim.SGD``'s lr 1e-3, ``Adagrad``'s eps
1e-10), so the sharded tables train as the same tables did in eager before sharding; torchrec passes only the given
keys and FBGEMM fills in its own defaults. Each table keeps its own optimizer: tables of one module with different
in-backward optimizers (or hyperparameters) get one fused group each per distinct optimizer, as torchrec's per-table
``fused_params`` do; a table without one takes the sharder's ``fused_params`` (or the module's own fused optimizer).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tritonrec.kernels.embedding.optim_state import hyperparameter_names
from tritonrec.modules.fused_embedding_modules import resolve_optimizer_type
from tritonrec.modules.torch_optimizer_args import torch_optimizer_kwargs

# the keys of fused_params that name the rule and its hyperparameters: a table's own optimizer replaces all of them
_RULE_KEYS = frozenset(
    {"optimizer", "learning_rate", "lr", "eps", "beta1", "beta2", "weight_decay", "initial_accumulator_value"}
)


def torch_optimizer_fused_params(optimizer: type, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``fused_params`` (``optimizer`` and its hyperparameters) of torch optimizer class ``optimizer`` built with
    ``kwargs``; a hyperparameter of the rule the user left out takes the class's default. The keywords are checked
    as a fused collection checks them (:func:`~tritonrec.modules.torch_optimizer_args.torch_optimizer_kwargs`): one
    the fused rule cannot apply at its value (SGD's ``momentum=0.9``, ``maximize=True``) is a ``ValueError`` naming
    it, prefixed by ``where`` (the table)."""
    rule = resolve_optimizer_type(optimizer)
    signature = inspect.signature(optimizer.__init__).parameters  # type: ignore[misc]
    defaults = {
        name: signature[name].default
        for name in hyperparameter_names(rule)
        if name in signature and signature[name].default is not inspect.Parameter.empty
    }
    try:
        hyperparams = torch_optimizer_kwargs(optimizer, rule, {**defaults, **kwargs})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    out: dict[str, Any] = {"optimizer": rule}
    for name, value in hyperparams.items():
        if name == "betas":
            out["beta1"], out["beta2"] = value
        else:
            out[name] = value
    return out


def in_backward_fused_params(
    fused_params: dict[str, Any] | None, weights: dict[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """Per table that ``apply_optimizer_in_backward`` gave an optimizer (``weights``: table name -> its unsharded
    parameter), ``fused_params`` merged with that optimizer: the table's rule and hyperparameters replace the
    sharder's (``optimizer``, ``lr`` / ``learning_rate``, ``eps``, ...), the other keys (``backend``, ...) are kept.
    Tables without one are left out (they take ``fused_params`` as given). A table with several optimizers is a
    ``ValueError`` naming it."""
    out: dict[str, dict[str, Any]] = {}
    for name, weight in weights.items():
        classes = getattr(weight, "_optimizer_classes", None)
        if classes is None:
            continue
        all_kwargs = getattr(weight, "_optimizer_kwargs", [{}])
        if len(classes) != 1 or len(all_kwargs) != 1:
            raise ValueError(
                f"table {name!r} has {len(classes)} optimizers applied in backward; a fused table takes exactly one "
                "(call apply_optimizer_in_backward once per parameter)"
            )
        merged = {k: v for k, v in (fused_params or {}).items() if k not in _RULE_KEYS}
        merged.update(torch_optimizer_fused_params(classes[0], dict(all_kwargs[0]), f"table {name!r}"))
        out[name] = merged
    return out


__all__ = ["in_backward_fused_params", "torch_optimizer_fused_params"]
