"""``FusedEmbeddingBagCollection`` / ``FusedEmbeddingCollection``: the optimizer runs inside the backward.

The backward sums each touched row's gradient once and updates the row and its optimizer state in place (no weight
gradient is materialised; the parameters' ``.grad`` stays ``None``). ``fused_optimizer`` exposes the state as a
:class:`~tritonrec.optim.KeyedOptimizer` (combine it with a dense one in a ``CombinedOptimizer``): ``state[param]``
holds live views of each table's state (``momentum1`` - per row for rowwise Adagrad, per element for Adam and
``EXACT_ADAGRAD`` -, ``momentum2`` for Adam, and ``step``), ``state_dict()`` / ``load_state_dict()`` round-trip it
exactly (keys are the parameter names, ``embedding_bags.<table>.weight``), and ``param_groups[0]`` is the live
hyperparameter dict the kernels read, so ``param_groups[0]["lr"] = x`` (or an LR scheduler) takes effect on the next
backward.
Hyperparameters are validated when built, in ``load_state_dict``, at ``step()`` and before every fused update (a NaN
``lr`` written into ``param_groups`` raises at the next backward, naming the field, before any row changes).
``step()`` updates nothing and ``zero_grad()`` does nothing. ``fused_optimizer`` is a property; calling it
(``ebc.fused_optimizer()``, torchrec's spelling) returns the same object. The tables' parameters carry torchrec's
``_in_backward_optimizers`` marker, so ``in_backward_optimizer_filter`` leaves them out of a dense optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import BoundsCheckMode, FusedOptimizerState, OptimType, create_fused_optimizer_state
from tritonrec.kernels.embedding.optim_state import check_hyperparameters, reset_fused_state
from tritonrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.table_batched import TableGroup
from tritonrec.modules.torch_optimizer_args import torch_optimizer_kwargs
from tritonrec.optim.keyed import EmptyFusedOptimizer, KeyedOptimizer

# the torchrec marker on fused tables' parameters (``in_backward_optimizer_filter`` reads it); one shared instance
_IN_BACKWARD = EmptyFusedOptimizer()


class _FusedInBackwardList(list):
    """``param._in_backward_optimizers`` of a fused table: reads as torchrec's one-marker list, refuses additions.

    torch's ``_apply_optimizer_in_backward`` appends a second optimizer to this list; a fused table has no ``.grad``
    for it to step, and torch then failed on a missing ``_optimizer_classes`` with a bare ``AttributeError``. The
    refusal names the parameter and the rule already in place.
    """

    def __init__(self, name: str, rule: str) -> None:
        super().__init__([_IN_BACKWARD])
        self.name, self.rule = name, rule

    def append(self, optimizer: object) -> None:
        raise ValueError(
            f"apply_optimizer_in_backward: parameter {self.name!r} belongs to a fused collection and already updates "
            f"in the backward with its {self.rule} rule; {type(optimizer).__name__} cannot be added. Choose the "
            "rule with the collection's optimizer_type / optimizer_kwargs, or apply it to a plain "
            "EmbeddingBagCollection / EmbeddingCollection (DistributedModelParallel fuses it when sharding)"
        )


# torchrec's mapping of torch optimizers to fused rules (``torch.optim.Adagrad`` is per-element Adagrad)
_TORCH_RULES: dict[type, OptimType] = {
    torch.optim.SGD: OptimType.EXACT_SGD,
    torch.optim.Adam: OptimType.ADAM,
    torch.optim.Adagrad: OptimType.EXACT_ADAGRAD,
}


def resolve_optimizer_type(optimizer_type: object) -> OptimType:
    """An :class:`OptimType`, its name, or ``torch.optim.SGD`` / ``Adam`` / ``Adagrad`` (torchrec's spelling)."""
    if isinstance(optimizer_type, OptimType):
        return optimizer_type
    if isinstance(optimizer_type, str) and optimizer_type.upper() in OptimType.__members__:
        return OptimType[optimizer_type.upper()]
    if optimizer_type in _TORCH_RULES:
        return _TORCH_RULES[optimizer_type]
    raise ValueError(
        f"optimizer_type={optimizer_type!r} cannot be fused; use one of {[o.name for o in OptimType]} "
        "(OptimType or its name) or torch.optim.SGD / torch.optim.Adam / torch.optim.Adagrad"
    )


def _table_state_views(state: FusedOptimizerState, group: TableGroup, t: int) -> dict[str, torch.Tensor]:
    """Table ``t``'s slice of each state buffer: per-row state ``[rows]``, per-element ``[rows, dim]``, step 0-d."""
    layout, views = group.layout, {}
    if state.momentum1 is not None:
        if state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
            views["momentum1"] = state.momentum1[layout.table_row_offsets[t] : layout.table_row_offsets[t + 1]]
        else:
            views["momentum1"] = layout.table_view(state.momentum1, t)
    if state.momentum2 is not None:
        views["momentum2"] = layout.table_view(state.momentum2, t)
    views["step"] = state.step[t]
    return views


class EmbeddingFusedOptimizer(KeyedOptimizer):
    """The fused optimizer's state and hyperparameters, seen as a :class:`~tritonrec.optim.KeyedOptimizer` (see
    module docstring). Unlike the base class, ``state_dict()`` returns copies and saves ``param_groups`` by default.

    ``slots`` lists every table as ``(parameter name, its group, its index in the group)`` in config order;
    ``states[i]`` is group ``i``'s state; ``hyperparams`` (shared by all states) becomes ``param_groups[0]``.
    """

    def __init__(
        self,
        slots: list[tuple[str, TableGroup, int]],
        states: list[FusedOptimizerState],
        groups: list[TableGroup],
        hyperparams: dict[str, Any],
    ) -> None:
        self._slots, self._fused_states, self._table_groups = slots, states, groups
        super().__init__(self._names, {}, [hyperparams])
        self.save_param_groups(True)
        self.rebuild_state_views()

    @property
    def _names(self) -> dict[str, nn.Parameter]:
        """Parameter name -> the table's current parameter, in config order."""
        return {name: group.params[t] for name, group, t in self._slots}

    def rebuild_state_views(self) -> None:
        """Point ``params`` and ``state[param]`` at the current parameters and state buffers (after a device move
        or a re-pack replaced them), and mark the parameters as updated in the backward."""
        self.state.clear()
        for _, group, t in self._slots:
            state = self._fused_states[self._table_groups.index(group)]
            self.state[group.params[t]] = _table_state_views(state, group, t)
        self.params = self._names
        for name, group, t in self._slots:
            rule = self._fused_states[self._table_groups.index(group)].optim.name
            group.params[t]._in_backward_optimizers = _FusedInBackwardList(name, rule)  # type: ignore[attr-defined]
        self.param_groups[0]["params"] = list(self.params.values())

    @property
    def optimizer_type(self) -> OptimType:
        """The fused rule (what the planner counts optimizer state for)."""
        return self._fused_states[0].optim

    def __call__(self) -> EmbeddingFusedOptimizer:
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Everything (torch's Optimizer keeps only defaults, state and param_groups, which would leave a deep copy
        of a fused module without its tables)."""
        return self.__dict__.copy()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """No update (it already happened in the backward); checks the hyperparameters, so an invalid edit of
        ``param_groups`` raises here as well as at the next backward."""
        check_hyperparameters(self.param_groups[0], "fused optimizer param_groups[0]: ")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused tables never hold gradients."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {param_name: {state_name: tensor copy}}, "param_groups": [{hyperparams, "params": names}]}``
        (``param_groups`` left out after ``save_param_groups(False)``)."""
        state = {
            name: {key: value.detach().clone() for key, value in self.state[param].items()}
            for name, param in self._names.items()
        }
        if not self.defaults["_save_param_groups"]:
            return {"state": state}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(self._names)
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Copy a :meth:`state_dict` into the live state and hyperparameters (same tables and shapes, valid
        hyperparameters required; nothing is written unless everything checks)."""
        saves_groups = self.defaults["_save_param_groups"]
        needed = ["state", "param_groups"] if saves_groups else ["state"]
        if not isinstance(state_dict, Mapping) or not set(needed) <= set(state_dict):
            names = " and ".join(repr(k) for k in needed)
            raise ValueError(f"state_dict must hold {names} (as returned by state_dict())")
        loaded_state = state_dict["state"]
        if set(loaded_state) != set(self._names):
            raise ValueError(
                f"state_dict['state'] has tables {sorted(loaded_state)}, this optimizer has {sorted(self._names)}"
            )
        for name, param in self._names.items():
            live = self.state[param]
            if set(loaded_state[name]) != set(live):
                raise ValueError(f"state of {name} has keys {sorted(loaded_state[name])}, expected {sorted(live)}")
            for key, target in live.items():
                shape = tuple(torch.as_tensor(loaded_state[name][key]).shape)
                if shape != tuple(target.shape):
                    raise ValueError(f"state {name}.{key} has shape {shape}, expected {tuple(target.shape)}")
        groups = state_dict["param_groups"] if saves_groups else []
        if saves_groups:
            if len(groups) != 1:
                raise ValueError(f"state_dict['param_groups'] must hold one group, got {len(groups)}")
            check_hyperparameters(groups[0], "loaded fused optimizer param_groups[0]: ")
        with torch.no_grad():
            for name, param in self._names.items():
                for key, target in self.state[param].items():
                    target.copy_(torch.as_tensor(loaded_state[name][key]))
        for key, value in (groups[0] if groups else {}).items():
            if key != "params":
                self.param_groups[0][key] = tuple(value) if key == "betas" else value
        self.post_load_state_dict()


class _FusedMixin:
    """Optimizer state creation, device moves of the state and the ``fused_optimizer`` property."""

    _groups: list[TableGroup]
    _fused_states: list[FusedOptimizerState]
    _optim: EmbeddingFusedOptimizer

    def _init_fused(
        self,
        optimizer_type: object,
        optimizer_kwargs: dict[str, Any] | None,
        device: torch.device | str | None,
        stochastic_rounding: bool,
        container: nn.ModuleDict,
        prefix: str,
    ) -> None:
        optim = resolve_optimizer_type(optimizer_type)
        if optimizer_kwargs is not None and not isinstance(optimizer_kwargs, Mapping):
            raise TypeError(f"optimizer_kwargs must be a dict, got {type(optimizer_kwargs).__name__}")
        kwargs = dict(optimizer_kwargs or {})
        if optimizer_type in _TORCH_RULES:  # the torch class's keywords: defaults dropped, the rest refused
            kwargs = torch_optimizer_kwargs(optimizer_type, optim, kwargs)  # type: ignore[arg-type]
        states: list[FusedOptimizerState] = []
        for seed, group in enumerate(self._groups):
            state = create_fused_optimizer_state(group.layout, optim, device, stochastic_rounding, seed, **kwargs)
            if states:  # every group reads one hyperparameter dict, the optimizer's single param group
                state.hyperparams = states[0].hyperparams
            states.append(state)
        self._fused_states = states
        where = {spec.name: (group, t) for group in self._groups for t, spec in enumerate(group.layout.tables)}
        slots = [(f"{prefix}.{name}.weight", *where[name]) for name in container]  # container follows the configs
        self._optim = EmbeddingFusedOptimizer(slots, states, self._groups, states[0].hyperparams)

    def reset_parameters(self) -> None:
        """Re-draw every table from its config's ``init_fn`` (as the plain collection does) and return the fused
        optimizer state to a freshly built module's: step counts and Adam's moments zero, Adagrad's sums at
        ``initial_accumulator_value``, stochastic rounding's update count back to 0 (the same random stream again).
        Hyperparameters (``param_groups[0]``) are kept."""
        super().reset_parameters()  # type: ignore[misc]
        for state in self._fused_states:
            reset_fused_state(state)

    def _ensure_packed(self) -> bool:
        repacked = super()._ensure_packed()  # type: ignore[misc]
        if repacked:
            self._optim.rebuild_state_views()
        return repacked

    def _move_fused_state(self, fn: Any) -> None:
        """Follow the parameters' device; state stays fp32 whatever ``fn`` does to floating-point dtypes."""
        for state in self._fused_states:
            target = fn(state.step.new_empty(0, dtype=torch.float32)).device
            for name in ("momentum1", "momentum2", "step"):
                tensor = getattr(state, name)
                if tensor is not None and tensor.device != target:
                    setattr(state, name, tensor.to(target))
            if state.trigger.device != target:  # a new leaf: a moved one would not be a leaf
                state.trigger = torch.empty(0, device=target, requires_grad=True)
        self._optim.rebuild_state_views()

    @property
    def fused_optimizer(self) -> EmbeddingFusedOptimizer:
        return self._optim


class FusedEmbeddingBagCollection(_FusedMixin, EmbeddingBagCollection):
    """:class:`EmbeddingBagCollection` whose backward applies ``optimizer_type`` in place (see module docstring).

    Args:
        tables, is_weighted, device, bounds_check, backend: as for :class:`EmbeddingBagCollection`.
        optimizer_type: ``OptimType.EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` / ``EXACT_ADAGRAD`` / ``ADAM`` (or
            ``torch.optim.SGD`` / ``torch.optim.Adagrad`` / ``torch.optim.Adam``).
        optimizer_kwargs: ``lr``, ``eps``, ``betas``, ``weight_decay`` (and the Adagrad rules'
            ``initial_accumulator_value``) as the rule takes them; with a torch optimizer class, that class's
            keywords (:mod:`~tritonrec.modules.torch_optimizer_args`).
        stochastic_rounding: round fp16 / bf16 weights stochastically after each update (else to nearest).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        optimizer_type: object,
        optimizer_kwargs: dict[str, Any] | None = None,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        stochastic_rounding: bool = True,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
    ) -> None:
        EmbeddingBagCollection.__init__(self, tables, is_weighted, device, bounds_check=bounds_check, backend=backend)
        self._init_fused(
            optimizer_type, optimizer_kwargs, device, stochastic_rounding, self.embedding_bags, "embedding_bags"
        )

    def _fused_state(self, group_index: int) -> FusedOptimizerState | None:
        return self._fused_states[group_index]

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._move_fused_state(fn)
        return self


class FusedEmbeddingCollection(_FusedMixin, EmbeddingCollection):
    """:class:`EmbeddingCollection` whose backward applies ``optimizer_type`` in place (see module docstring)."""

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        optimizer_type: object,
        optimizer_kwargs: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        stochastic_rounding: bool = True,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
    ) -> None:
        EmbeddingCollection.__init__(self, tables, device, need_indices, bounds_check=bounds_check, backend=backend)
        self._init_fused(optimizer_type, optimizer_kwargs, device, stochastic_rounding, self.embeddings, "embeddings")

    def _fused_state(self, group_index: int) -> FusedOptimizerState | None:
        return self._fused_states[group_index]

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._move_fused_state(fn)
        return self
