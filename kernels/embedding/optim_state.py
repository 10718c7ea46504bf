"""Fused optimizer rules and their state: which hyperparameters each rule takes, the fp32 state buffers laid out
like the weights, and the per-update constants (step counts, Adam bias corrections, the stochastic-rounding seed).

See :mod:`~tritonrec.kernels.embedding.fused_update` for the rules themselves.
"""

from __future__ import annotations

import enum
import itertools
import math
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tritonrec.kernels.embedding.layout import TableBatchedLayout
from tritonrec.kernels.embedding.storage import zeros_table_storage


class OptimType(enum.Enum):
    """Fused rules (FBGEMM's ``EmbOptimType`` names). ``SGD`` is an alias of ``EXACT_SGD``."""

    EXACT_SGD = "EXACT_SGD"
    SGD = "EXACT_SGD"
    EXACT_ROWWISE_ADAGRAD = "EXACT_ROWWISE_ADAGRAD"
    ADAM = "ADAM"
    EXACT_ADAGRAD = "EXACT_ADAGRAD"


_OPTIM_CODE = {
    OptimType.EXACT_SGD: 0,
    OptimType.EXACT_ROWWISE_ADAGRAD: 1,
    OptimType.ADAM: 2,
    OptimType.EXACT_ADAGRAD: 3,
}
# Rules whose ``momentum1`` is per element (``[num_weights]``, laid out like the weights) rather than per row
PER_ELEMENT_MOMENTUM1 = frozenset({OptimType.ADAM, OptimType.EXACT_ADAGRAD})
_DEFAULTS: dict[OptimType, dict[str, Any]] = {
    OptimType.EXACT_SGD: {"lr": 0.01, "weight_decay": 0.0},
    # initial_accumulator_value: what momentum1 starts at (and returns to on reset), torch.optim.Adagrad's argument
    OptimType.EXACT_ROWWISE_ADAGRAD: {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0, "initial_accumulator_value": 0.0},
    OptimType.ADAM: {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    # FBGEMM's EXACT_ADAGRAD ignores weight_decay (in every weight_decay_mode); ours adds it as L2, like
    # torch.optim.Adagrad (torchrec's spelling of this rule); at the default 0 the rules are the same
    OptimType.EXACT_ADAGRAD: {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0, "initial_accumulator_value": 0.0},
}


_STATE_KEYS = itertools.count()
_LIVE_STATES: weakref.WeakValueDictionary[int, FusedOptimizerState] = weakref.WeakValueDictionary()


@dataclass(eq=False)
class FusedOptimizerState:
    """Everything a fused update needs besides the weights. ``hyperparams`` is live: modules expose this very dict
    as ``param_groups[0]``, so changing ``lr`` there takes effect on the next backward.

    The update runs inside the ``tritonrec`` backward ops, which take the state tensors as (mutated) arguments and
    find the rest by ``op_key`` (:func:`fused_state_from_op_key`) at run time, so a compiled graph reads the current
    hyperparameters instead of baking them in. ``trigger`` is an empty leaf that requires grad: passed to a lookup,
    it makes the output require grad (so the backward, which holds the update, runs) when nothing else does.
    """

    optim: OptimType
    hyperparams: dict[str, Any]
    momentum1: torch.Tensor | None
    momentum2: torch.Tensor | None
    step: torch.Tensor
    stochastic_rounding: bool = True
    seed: int = 0
    updates: int = field(default=0)
    op_key: int = field(init=False, repr=False)
    trigger: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._register()
        self.trigger = torch.empty(0, device=self.step.device, requires_grad=True)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Copies (``copy``, ``deepcopy``, unpickling) are new states: they get a key of their own."""
        self.__dict__.update(state)
        self._register()

    def _register(self) -> None:
        self.op_key = next(_STATE_KEYS)
        _LIVE_STATES[self.op_key] = self

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The flat state buffers by name (``momentum1``, ``momentum2``, ``step``) that exist for this rule."""
        out = {"momentum1": self.momentum1, "momentum2": self.momentum2, "step": self.step}
        return {k: v for k, v in out.items() if v is not None}


def _is_number(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_hyperparameters(hyperparams: Mapping[str, Any], where: str = "") -> None:
    """Raise ``ValueError`` naming the field when ``lr``, ``eps``, ``weight_decay`` or ``initial_accumulator_value``
    is not a finite non-negative number, or ``betas`` is not two numbers in ``[0, 1)``. Other keys (``params``, a
    scheduler's ``initial_lr``) are ignored. ``where`` prefixes the message (``"param_groups[0]: "``).

    Runs at construction, on ``load_state_dict`` and at every fused update, so a NaN written into ``param_groups``
    stops the next backward before it reaches the weights (NaN compares false with everything and would pass a
    plain ``< 0`` test, turning every touched row into NaN).
    """
    for name in ("lr", "eps", "weight_decay", "initial_accumulator_value"):
        if name in hyperparams:
            value = hyperparams[name]
            if not _is_number(value) or not math.isfinite(float(value)) or float(value) < 0:
                raise ValueError(f"{where}{name} must be a non-negative number, got {name}={value!r}")
    if "betas" in hyperparams:
        betas = hyperparams["betas"]
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) for b in betas)
        if not ok or not all(0.0 <= float(b) < 1.0 for b in betas):  # NaN fails both comparisons
            raise ValueError(f"{where}betas must be two numbers in [0, 1), got betas={betas!r}")


def fused_state_from_op_key(key: int) -> FusedOptimizerState:
    state = _LIVE_STATES.get(key)
    if state is None:
        raise RuntimeError(
            f"the fused optimizer state {key} of this graph no longer exists (its module was deleted); a graph that "
            "updates tables in its backward only runs in the process that built it"
        )
    return state


def create_fused_optimizer_state(
    layout: TableBatchedLayout,
    optim: OptimType,
    device: torch.device | str | None = None,
    stochastic_rounding: bool = True,
    seed: int = 0,
    **hyperparams: Any,
) -> FusedOptimizerState:
    """Zero state for ``optim`` over ``layout`` plus validated hyperparameters (unknown names raise)."""
    if not isinstance(optim, OptimType):
        raise TypeError(f"optim must be an OptimType, got optim={optim!r}")
    allowed = _DEFAULTS[optim]
    unknown = sorted(set(hyperparams) - set(allowed))
    if unknown:
        raise ValueError(f"{optim.name} does not take {unknown}; its hyperparameters are {sorted(allowed)}")
    merged = {**allowed, **hyperparams}
    check_hyperparameters(merged)
    if optim == OptimType.ADAM:
        merged["betas"] = tuple(merged["betas"])
    zeros = lambda n: torch.zeros(n, dtype=torch.float32, device=device)
    momentum1 = momentum2 = None
    if optim == OptimType.EXACT_ROWWISE_ADAGRAD:
        momentum1 = zeros(layout.num_rows)
    elif optim in PER_ELEMENT_MOMENTUM1:
        momentum1 = zeros_table_storage(layout.num_weights, torch.float32, device)
    if optim == OptimType.ADAM:
        momentum2 = zeros_table_storage(layout.num_weights, torch.float32, device)
    step = torch.zeros(layout.num_tables, dtype=torch.int64, device=device)
    state = FusedOptimizerState(optim, merged, momentum1, momentum2, step, stochastic_rounding, seed)
    reset_fused_state(state)
    return state


def reset_fused_state(state: FusedOptimizerState) -> None:
    """Return ``state`` to a fresh one's: step counts and Adam's moments zero, Adagrad's ``momentum1`` at
    ``initial_accumulator_value`` (torch.optim.Adagrad's starting sum), the stochastic-rounding stream at its start."""
    with torch.no_grad():
        for name, tensor in state.state_tensors().items():
            if name == "momentum1" and state.optim != OptimType.ADAM:
                tensor.fill_(float(state.hyperparams.get("initial_accumulator_value", 0.0)))
            else:
                tensor.zero_()
    state.updates = 0


@dataclass(frozen=True)
class StepScalars:
    """Per-update constants, computed once on the host so kernel and twin use the same fp32 values."""

    lr: float
    eps: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    weight_decay: float
    bias1: torch.Tensor
    bias2: torch.Tensor
    seed: int


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even, as torch casts), without building a tensor: this runs
    seven times a step."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # past float32's range: torch's cast gives +-inf
        return torch.tensor(x, dtype=torch.float32).item()


def begin_step(state: FusedOptimizerState) -> StepScalars:
    """Count the update (every table's step += 1) and freeze this update's constants."""
    hp = state.hyperparams
    check_hyperparameters(hp, "fused optimizer param_groups[0]: ")  # edits since the last step, before any update
    state.step += 1
    beta1, beta2 = hp.get("betas", (0.0, 0.0))
    if state.optim == OptimType.ADAM:
        steps = state.step.double()
        bias1 = (1.0 - beta1**steps).float()
        bias2 = (1.0 - beta2**steps).float()
    else:
        bias1 = bias2 = torch.ones_like(state.step, dtype=torch.float32)
    # this update's stochastic-rounding stream (kernels get its keys, random_bits.stream_key_args(seed))
    seed = (state.seed * 0x9E3779B1 + state.updates * 0x85EBCA77 + 1) & 0x7FFFFFFF
    state.updates += 1
    return StepScalars(
        lr=_fp32(hp["lr"]),
        eps=_fp32(hp.get("eps", 0.0)),
        beta1=_fp32(beta1),
        one_minus_beta1=_fp32(1.0 - beta1),
        beta2=_fp32(beta2),
        one_minus_beta2=_fp32(1.0 - beta2),
        weight_decay=_fp32(hp.get("weight_decay", 0.0)),
        bias1=bias1,
        bias2=bias2,
        seed=seed,
    )


def optim_code(optim: OptimType) -> int:
    """The kernels' integer code for a rule (0 SGD, 1 rowwise Adagrad, 2 Adam, 3 per-element Adagrad)."""
    return _OPTIM_CODE[optim]


def hyperparameter_names(optim: OptimType) -> frozenset[str]:
    """The hyperparameters ``optim`` takes (a live param group may hold others: an LR scheduler's ``initial_lr``)."""
    return frozenset(_DEFAULTS[optim])
