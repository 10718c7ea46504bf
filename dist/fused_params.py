"""``fused_params``: what a sharder passes to the local lookups (torchrec's / FBGEMM TBE's key names).

Keys: ``optimizer`` (an ``OptimType``, its name, or ``torch.optim.SGD`` / ``Adam`` / ``Adagrad``), ``learning_rate``
(or ``lr``), ``eps``, ``beta1``, ``beta2``, ``weight_decay``, ``initial_accumulator_value`` (where the Adagrad rules'
state starts), ``stochastic_rounding``, ``bounds_check_mode`` (a ``BoundsCheckMode``), ``weights_precision`` (a
``DataType``: the storage type of every table), and ours, ``backend`` (``"auto"``/``"triton"``/``"torch"``). An
unknown key raises ``ValueError`` naming it.

A ``FusedEmbeddingBagCollection`` / ``FusedEmbeddingCollection`` carries its own optimizer; ``fused_params`` may
override its hyperparameters. Tables may also carry their own (``apply_optimizer_in_backward``,
:mod:`tritonrec.dist.in_backward`): :func:`table_fused_configs` gives each distinct one its :class:`FusedConfig`, and
the lookups group tables by (dtype, config), one fused state and one live hyperparameter dict per config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tritonrec.dist.embedding_lookup import FusedConfig
from tritonrec.kernels.embedding import BoundsCheckMode, TableBatchedLayout, TableSpec, create_fused_optimizer_state
from tritonrec.kernels.embedding.optim_state import hyperparameter_names
from tritonrec.modules.embedding_configs import DataType
from tritonrec.modules.fused_embedding_modules import resolve_optimizer_type

_HYPERPARAMS = {
    "learning_rate": "lr",
    "lr": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "initial_accumulator_value": "initial_accumulator_value",
}
_KNOWN = {
    "optimizer",
    "beta1",
    "beta2",
    "stochastic_rounding",
    "bounds_check_mode",
    "weights_precision",
    "backend",
    *_HYPERPARAMS,
}


@dataclass
class LookupOptions:
    """What the local lookups of one sharded module share. ``fused``: the module's fused optimizer (the sharder's
    ``fused_params``, else the module's own); ``table_fused``: tables with an optimizer of their own -> its config."""

    fused: FusedConfig | None
    bounds_check: BoundsCheckMode
    backend: str
    weights_precision: DataType | None
    table_fused: dict[str, FusedConfig] = field(default_factory=dict)

    def fused_of(self, table: str) -> FusedConfig | None:
        """The fused optimizer of table ``table``: its own, else the module's."""
        return self.table_fused.get(table, self.fused)

    @property
    def has_fused(self) -> bool:
        """Whether any table of the module has a fused optimizer."""
        return self.fused is not None or bool(self.table_fused)

    def fused_configs(self, tables: Iterable[str]) -> list[FusedConfig]:
        """The distinct fused optimizers of ``tables``, in order of first appearance (every rank lists the same)."""
        out: list[FusedConfig] = []
        for table in tables:
            config = self.fused_of(table)
            if config is not None and not any(config is c for c in out):
                out.append(config)
        return out


def parse_fused_params(fused_params: dict[str, Any] | None, module: object = None) -> LookupOptions:
    """Validate ``fused_params`` and merge them with a fused module's own optimizer (see module docstring)."""
    if fused_params is not None and not isinstance(fused_params, dict):
        raise TypeError(f"fused_params must be a dict or None, got {type(fused_params).__name__}")
    params = dict(fused_params or {})
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ValueError(f"fused_params has unknown keys {unknown}; known keys are {sorted(_KNOWN)}")
    kwargs: dict[str, Any] = {}
    optim = None
    stochastic = True
    module_optimizer = getattr(module, "fused_optimizer", None)
    if module_optimizer is not None and "optimizer" not in params:
        state = module._fused_states[0]  # type: ignore[attr-defined]
        optim, stochastic = state.optim, state.stochastic_rounding
        # the rule's own keys only: an LR scheduler adds ``initial_lr`` to the live group
        names = hyperparameter_names(optim)
        kwargs = {k: v for k, v in module_optimizer.param_groups[0].items() if k in names}
    if "optimizer" in params:
        optim = resolve_optimizer_type(params["optimizer"])
    for key, name in _HYPERPARAMS.items():
        if key in params:
            kwargs[name] = params[key]
    if "beta1" in params or "beta2" in params:
        beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
        kwargs["betas"] = (params.get("beta1", beta1), params.get("beta2", beta2))
    if "stochastic_rounding" in params:
        if not isinstance(params["stochastic_rounding"], bool):
            raise TypeError(
                f"fused_params['stochastic_rounding'] must be a bool, got {params['stochastic_rounding']!r}"
            )
        stochastic = params["stochastic_rounding"]
    bounds = params.get("bounds_check_mode", getattr(module, "bounds_check", BoundsCheckMode.FATAL))
    if not isinstance(bounds, BoundsCheckMode):
        raise TypeError(f"fused_params['bounds_check_mode'] must be a BoundsCheckMode, got {bounds!r}")
    backend = params.get("backend", getattr(module, "backend", "auto"))
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"fused_params['backend'] must be 'auto', 'triton' or 'torch', got {backend!r}")
    precision = params.get("weights_precision")
    if precision is not None and precision not in (DataType.FP32, DataType.FP16, DataType.BF16):
        raise ValueError(f"fused_params['weights_precision'] must be DataType.FP32, FP16 or BF16, got {precision!r}")
    fused = None
    if optim is not None:
        fused = FusedConfig(optim, kwargs, stochastic)
        # validate the hyperparameters now, on every rank (a rank without local shards builds no state)
        probe = create_fused_optimizer_state(TableBatchedLayout([TableSpec(1, 1)], [0]), optim, "cpu", **kwargs)
        fused.hyperparams = probe.hyperparams  # the live dict every group of the module shares
    elif kwargs:
        raise ValueError(f"fused_params sets {sorted(kwargs)} but no 'optimizer' to apply them to")
    return LookupOptions(fused, bounds, backend, precision)


def _rule_key(config: FusedConfig) -> tuple[Any, ...]:
    return config.optim, config.stochastic_rounding, sorted(config.kwargs.items())


def table_fused_configs(
    per_table: dict[str, dict[str, Any]], module: object = None, default: FusedConfig | None = None
) -> dict[str, FusedConfig]:
    """Table -> the :class:`FusedConfig` of its own ``fused_params`` (``per_table``: what
    :func:`~tritonrec.dist.in_backward.in_backward_fused_params` gives). Tables whose rule, hyperparameters and
    rounding are equal share one config (one fused group, one param group); one equal to ``default`` (the module's)
    shares that, so a module whose tables all agree trains exactly as with one ``fused_params``."""
    distinct: list[FusedConfig] = [] if default is None else [default]
    out: dict[str, FusedConfig] = {}
    for table, params in per_table.items():
        config = parse_fused_params(params, module).fused
        if config is None:
            raise ValueError(f"table {table!r}: its fused_params {params!r} name no optimizer")
        same = next((c for c in distinct if _rule_key(c) == _rule_key(config)), None)
        if same is None:
            distinct.append(config)
            same = config
        out[table] = same
    return out


__all__ = ["LookupOptions", "parse_fused_params", "table_fused_configs"]
