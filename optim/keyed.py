"""Optimizers keyed by parameter name (torchrec's ``torchrec.optim.keyed`` names and semantics).

* :class:`KeyedOptimizer`: a torch ``Optimizer`` over ``{name: parameter}`` whose ``state_dict`` is keyed by
  parameter name (not by position), so a checkpoint survives re-sharding and a model whose ranks hold different
  parameters. It is strict: ``load_state_dict`` copies into the existing state tensors in place and refuses a state
  with other parameters or other state sizes. ``param_groups`` are saved only after ``save_param_groups(True)``.
  What ``state_dict`` / ``load_state_dict`` see of the state goes through four hooks (``keyed_state``,
  ``keyed_group_params``, ``check_keyed_state``, ``copy_keyed_state``): the sharded fused optimizer
  (:mod:`tritonrec.dist.sharded_fused_optimizer`) saves whole tables as ShardedTensors through them, also inside a
  ``CombinedOptimizer``.
* :class:`KeyedOptimizerWrapper`: a ``KeyedOptimizer`` around any torch optimizer built by a factory.
* :class:`CombinedOptimizer`: several keyed optimizers (say the fused embedding optimizer and a dense Adam) seen as
  one; names get the optimizer's key as prefix.
* :func:`in_backward_optimizer_filter`: split ``named_parameters()`` into the parameters updated inside the backward
  (fused tables) and the rest (which a dense optimizer must own).

Hyperparameters are validated when an optimizer is built, before every ``step`` and in ``load_state_dict``: a NaN,
infinite or negative ``lr`` / ``eps`` / ``weight_decay`` or ``betas`` outside ``[0, 1)`` is a ``ValueError`` naming
the field (an LR schedule that divides by zero is caught before it poisons the weights).
The checks and the in-place copy of a loaded state live in :mod:`tritonrec.optim.keyed_state`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tritonrec.optim.keyed_state import check_loadable as _check_loadable
from tritonrec.optim.keyed_state import check_param_groups
from tritonrec.optim.keyed_state import copy_into as _copy_into
from tritonrec.optim.keyed_state import init_torch_optimizer_fields as _init_torch_optimizer_fields

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

__all__ = [
    "CombinedOptimizer",
    "EmptyFusedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerFactory",
    "in_backward_optimizer_filter",
]


def _hooks(optimizer: torch.optim.Optimizer, registry: str) -> list[Callable[..., Any]]:
    """The hooks registered in one of torch's optimizer hook registries (none if the registry is missing)."""
    return list(getattr(optimizer, registry, {}).values())


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is keyed by parameter name (see module docstring).

    Args:
        params: parameter name -> parameter.
        state: parameter -> its state dict (every key must be one of ``params``' values).
        param_groups: the groups, each with ``"params"`` (a list of parameters) and its hyperparameters.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        state: Mapping[Any, Any],
        param_groups: Collection[Mapping[str, Any]],
    ) -> None:
        _init_torch_optimizer_fields(self)
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping of name -> parameter, got {type(params).__name__}")
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups  # type: ignore[assignment]
        self.params = params
        self.defaults: dict[str, Any] = {"_save_param_groups": False}
        known = {id(p) for p in params.values()}
        strangers = [key for key in state if id(key) not in known]
        if strangers:
            raise ValueError(f"every state key must be one of params; {len(strangers)} are not")
        check_param_groups(self.param_groups, self._label())

    def _label(self) -> str:
        """How error messages name this optimizer."""
        return type(self).__name__

    def _param_keys(self) -> dict[int, str]:
        return {id(param): key for key, param in self.params.items()}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {name: state}}`` (live tensors, so a checkpoint loader can fill them in place), plus
        ``"param_groups"`` (hyperparameters, ``"params"`` as sorted names) after ``save_param_groups(True)``.

        ``param_groups`` is a tuple of dicts, not a list: ``torch.distributed.checkpoint`` stores a tuple whole under
        one key in both of its key layouts, while a list of dicts is split per entry in its current layout and
        kept whole in the torch 2.3 layout it falls back to when a rank holds a ShardedTensor without local shards
        (a table-wise table on the other ranks) - that load then fails looking for ``param_groups``.

        Hooks registered with torch's ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` run as
        in ``torch.optim.Optimizer.state_dict`` (a post hook's non-None return replaces the result)."""
        for pre_hook in _hooks(self, "_optimizer_state_dict_pre_hooks"):
            pre_hook(self)
        out: dict[str, Any] = {"state": self.keyed_state()}
        if self.defaults["_save_param_groups"]:
            groups = []
            for group in self.param_groups:
                saved = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                saved["params"] = self.keyed_group_params(group)
                groups.append(saved)
            out["param_groups"] = tuple(groups)
        for post_hook in _hooks(self, "_optimizer_state_dict_post_hooks"):
            result = post_hook(self, out)
            out = out if result is None else result
        return out

    # The hooks below are what ``state_dict`` / ``load_state_dict`` (and a CombinedOptimizer holding this one) see of
    # the state: an optimizer whose saved form differs from its live ``state`` (the sharded fused optimizer saves
    # whole tables as sharded tensors) overrides them.
    def keyed_state(self) -> dict[str, Any]:
        """Parameter name -> its state, live (what ``state_dict()["state"]`` holds)."""
        keys = self._param_keys()
        return {keys[id(param)]: state for param, state in self.state.items()}

    def keyed_optional(self) -> set[str]:
        """Names a loaded ``state`` may hold beyond :meth:`keyed_state`'s, ignored (none by default; the sharded
        fused optimizer: tables of which this rank holds nothing)."""
        return set()

    def check_state_names(self, loaded: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``loaded`` holds every name of :meth:`keyed_state` and no unknown one."""
        live = set(self.keyed_state())
        if not live <= set(loaded) <= live | self.keyed_optional():
            raise ValueError(f"state_dict['state'] has parameters {sorted(loaded)}, this optimizer has {sorted(live)}")

    def keyed_group_params(self, group: Mapping[str, Any]) -> list[str]:
        """The sorted names that stand for ``group``'s parameters in ``state_dict()["param_groups"]``."""
        keys = self._param_keys()
        return sorted(keys[id(p)] for p in group["params"])

    def check_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the parameter when ``loaded`` (a ``state_dict()["state"]``) cannot be copied
        into the live state: other parameters, state keys or shapes. Writes nothing."""
        self.check_state_names(loaded)
        for name, state in self.keyed_state().items():
            _check_loadable(state, loaded[name], name)

    def copy_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        """Copy a checked ``state_dict()["state"]`` into the live state, in place."""
        for name, state in self.keyed_state().items():
            _copy_into(state, loaded[name])

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Copy a :meth:`state_dict` into the live state (and hyperparameters, when param groups are saved).

        Everything is checked before anything is written: the same parameters with the same state keys and shapes,
        and valid hyperparameters. Hooks from torch's ``register_load_state_dict_pre_hook`` (which may return a
        replacement state dict) run first, those of ``register_load_state_dict_post_hook`` last."""
        for pre_hook in _hooks(self, "_optimizer_load_state_dict_pre_hooks"):
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if not isinstance(state_dict, Mapping) or "state" not in state_dict:
            raise ValueError("state_dict must hold 'state' (as returned by state_dict())")
        loaded = state_dict["state"]
        if not isinstance(loaded, Mapping):
            raise ValueError(f"state_dict['state'] must be a dict of name -> state, got {type(loaded).__name__}")
        self.check_state_names(loaded)
        new_groups = self._matched_groups(state_dict) if self.defaults["_save_param_groups"] else None
        self.check_keyed_state(loaded)
        self.copy_keyed_state(loaded)
        if new_groups is not None:
            for group, new_group in new_groups:
                for k, v in new_group.items():
                    if k != "params":
                        group[k] = tuple(v) if k == "betas" and isinstance(v, list) else copy.deepcopy(v)
        self.post_load_state_dict()
        for post_hook in _hooks(self, "_optimizer_load_state_dict_post_hooks"):
            post_hook(self)

    def _matched_groups(self, state_dict: Mapping[str, Any]) -> list[tuple[dict[str, Any], Mapping[str, Any]]]:
        """Pair each live group with the saved group over the same parameter names; validate the saved ones."""
        if "param_groups" not in state_dict:
            raise ValueError("state_dict has no 'param_groups' but this optimizer saves them")
        saved = {"/".join(sorted(g["params"])): g for g in state_dict["param_groups"]}
        pairs = []
        for group in self.param_groups:
            key = "/".join(self.keyed_group_params(group))
            if key not in saved:
                raise ValueError(f"no saved param group holds the parameters {key.split('/')}")
            pairs.append((group, saved[key]))
        check_param_groups([g for _, g in pairs], f"loaded {self._label()}")
        return pairs  # type: ignore[return-value]

    def post_load_state_dict(self) -> None:
        """Called at the end of :meth:`load_state_dict` (subclasses refresh derived state)."""

    def add_param_group(self, param_group: Any) -> None:
        raise NotImplementedError("a KeyedOptimizer's parameters are fixed when it is built")

    def init_state(self, sparse_grad_parameter_names: set[str] | None = None) -> None:
        """Run one step on zero gradients so lazily created state exists (and a checkpoint can be loaded in place)."""
        for key, param in self.params.items():
            if param.requires_grad:
                grad = torch.zeros_like(param)
                if sparse_grad_parameter_names is not None and key in sparse_grad_parameter_names:
                    grad = grad.to_sparse()
                param.grad = grad
        self.step(closure=None)

    def save_param_groups(self, save: bool) -> None:
        self.defaults["_save_param_groups"] = bool(save)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__


class KeyedOptimizerWrapper(KeyedOptimizer):
    """A :class:`KeyedOptimizer` around ``optim_factory(list(params.values()))`` (or ``optim_factory(params)`` with
    ``pass_params_dict=True``), e.g. ``KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p:
    torch.optim.Adam(p, lr=1e-3))``."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], optim_factory: OptimizerFactory, pass_params_dict: bool = False
    ) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping of name -> parameter, got {type(params).__name__}")
        self._optimizer = optim_factory(params if pass_params_dict else list(params.values()))
        if not isinstance(self._optimizer, torch.optim.Optimizer):
            raise TypeError(f"optim_factory must return a torch.optim.Optimizer, got {type(self._optimizer).__name__}")
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def _label(self) -> str:
        return type(self._optimizer).__name__

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        check_param_groups(self.param_groups, self._label())
        return self._optimizer.step(closure=closure)

    def __repr__(self) -> str:
        return f"KeyedOptimizerWrapper({self._optimizer!r})"


class EmptyFusedOptimizer(KeyedOptimizer):
    """A marker with no parameters: ``param._in_backward_optimizers = [EmptyFusedOptimizer()]`` says that the
    parameter is updated inside the backward (torchrec's convention; :func:`in_backward_optimizer_filter` reads it)."""

    def __init__(self) -> None:
        super().__init__({}, {}, [])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _prepend(name: str, key: str) -> str:
    if not name:
        return key
    return f"{key}.{name}" if key else name


class CombinedOptimizer(KeyedOptimizer):
    """Several keyed optimizers as one: ``step`` / ``zero_grad`` reach each, ``params`` / ``state`` /
    ``param_groups`` are their union (live: an LR scheduler on the combined optimizer edits each child's groups),
    names are prefixed with the child's key (``"sparse.embedding_bags.t0.weight"``).

    Args:
        optims: keyed optimizers, or ``(key, optimizer)`` pairs to prefix their parameter names with ``key``.
    """

    def __init__(self, optims: list[KeyedOptimizer | tuple[str, KeyedOptimizer]]) -> None:
        _init_torch_optimizer_fields(self)
        self._optims: list[tuple[str, KeyedOptimizer]] = []
        for item in optims:
            pair = ("", item) if isinstance(item, KeyedOptimizer) else item
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)) or not isinstance(
                pair[1], KeyedOptimizer
            ):
                raise TypeError(f"optims must hold KeyedOptimizers or (str, KeyedOptimizer) pairs, got {item!r}")
            key, optimizer = pair
            self._optims.append((key, optimizer))
        seen: set[str] = set()
        for key, optimizer in self._optims:
            for name in optimizer.params:
                full = _prepend(name, key)
                if full in seen:
                    raise ValueError(f"duplicate parameter key {full!r} in CombinedOptimizer")
                seen.add(full)
        first = self._optims[0][1].defaults["_save_param_groups"] if self._optims else False
        self.defaults = {"_save_param_groups": first}

    @property
    def optimizers(self) -> list[tuple[str, KeyedOptimizer]]:
        return self._optims

    @property
    def params(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {_prepend(name, key): p for key, opt in self._optims for name, p in opt.params.items()}

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {param: state for _, opt in self._optims for param, state in opt.state.items()}

    @property
    def param_groups(self) -> list[Mapping[str, Any]]:  # type: ignore[override]
        return [group for _, opt in self._optims for group in opt.param_groups]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for _, optimizer in self._optims:
            optimizer.step(closure=closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, optimizer in self._optims:
            optimizer.zero_grad(set_to_none=set_to_none)

    # state dicts: each child's own saved form (its hooks), under prefixed names
    def keyed_state(self) -> dict[str, Any]:
        return {_prepend(name, key): s for key, opt in self._optims for name, s in opt.keyed_state().items()}

    def keyed_group_params(self, group: Mapping[str, Any]) -> list[str]:
        for key, optimizer in self._optims:
            if any(g is group for g in optimizer.param_groups):
                return sorted(_prepend(name, key) for name in optimizer.keyed_group_params(group))
        raise ValueError("the param group belongs to none of the combined optimizers")

    def keyed_optional(self) -> set[str]:
        return {_prepend(name, key) for key, opt in self._optims for name in opt.keyed_optional()}

    def _split(self, loaded: Mapping[str, Any]) -> list[tuple[str, KeyedOptimizer, dict[str, Any]]]:
        """Each child with its share of ``loaded`` (a combined ``state_dict()["state"]``), names unprefixed."""
        out = []
        for key, opt in self._optims:
            names = set(opt.keyed_state()) | opt.keyed_optional()
            out.append((key, opt, {n: loaded[_prepend(n, key)] for n in names if _prepend(n, key) in loaded}))
        return out

    def check_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        self.check_state_names(loaded)
        for key, optimizer, share in self._split(loaded):
            try:
                optimizer.check_keyed_state(share)
            except ValueError as err:  # the child names its parameters without the prefix
                raise ValueError(f"optimizer {key!r}: {err}" if key else str(err)) from None

    def copy_keyed_state(self, loaded: Mapping[str, Any]) -> None:
        for _, optimizer, share in self._split(loaded):
            optimizer.copy_keyed_state(share)

    def post_load_state_dict(self) -> None:
        for _, optimizer in self._optims:
            optimizer.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self.defaults["_save_param_groups"] = bool(save)
        for _, optimizer in self._optims:
            optimizer.save_param_groups(save)

    def __repr__(self) -> str:
        return "CombinedOptimizer(" + ", ".join(f"{key!r}: {opt!r}" for key, opt in self._optims) + ")"


def in_backward_optimizer_filter(
    named_parameters: Iterator[tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[tuple[str, nn.Parameter]]:
    """The ``(name, parameter)`` pairs updated inside the backward (``include=True``: fused tables, which carry
    ``_in_backward_optimizers``) or, by default, the others (what a dense optimizer must own)::

        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), adam_factory)
    """
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param
