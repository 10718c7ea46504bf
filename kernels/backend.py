"""Which implementation of an op runs: the Triton kernel or its torch twin, and how kernels pick a launch config.

Every public op takes ``backend: Backend = "auto"`` and calls :func:`resolve_backend` once:

* ``"auto"``   -> ``"triton"`` when Triton is importable and the inputs live on CUDA, or when ``TRITON_INTERPRET=1``
  (tests run the real kernels on CPU tensors that way); ``"torch"`` otherwise (laptop CPU, notebooks).
* ``"triton"`` -> the kernel, or a ``RuntimeError`` saying why it cannot run here.
* ``"torch"``  -> the pure-torch twin, on any device.

Autotuning: kernels declare their configs next to themselves and decorate with :func:`autotune` (a thin wrapper of
``triton.autotune``). For each new autotune key a kernel picks, in order:

1. the config a tuning sweep pinned (:func:`pinned_config`, used by ``scripts/autotune.py``);
2. the config recorded for that key in the tuned file of the current device (:mod:`tritonrec.kernels.tuned`), so
   production runs skip runtime autotuning;
3. every config (runtime autotuning), or only the first one, the pinned default, when autotuning is switched off
   (``TRITONREC_AUTOTUNE=0``, :func:`set_autotune`, or the interpreter, where timing means nothing).

A kernel may pass ``fits(config_kwargs, args) -> bool`` to rule configs out for some launches (a tile too large for
the registers at that shape); the choice above is made among the configs that fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from tritonrec.kernels._triton import HAS_TRITON, TRITON_IMPORT_ERROR, interpreter_enabled, triton

Backend = Literal["auto", "triton", "torch"]
ResolvedBackend = Literal["triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")

_autotune_override: bool | None = None


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> ResolvedBackend:
    """Pick the implementation for ``tensors`` (``None`` entries are ignored). See the module docstring."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got backend={backend!r}")
    devices = {t.device.type for t in tensors if t is not None}
    on_cuda = "cuda" in devices
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if HAS_TRITON and (on_cuda or interpreter_enabled()) else "torch"
    if not HAS_TRITON:
        raise RuntimeError(f"backend='triton' was requested but Triton cannot be imported ({TRITON_IMPORT_ERROR})")
    if not on_cuda and not interpreter_enabled():
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got devices {sorted(devices)}) or TRITON_INTERPRET=1 set before "
            "tritonrec.kernels is imported; use backend='torch' or 'auto' on this device"
        )
    return "triton"


def set_autotune(enabled: bool | None) -> None:
    """Force autotuning on or off for every tritonrec kernel; ``None`` restores the default (env and interpreter).

    The choice applies to shapes not tuned yet: Triton caches the config picked for each autotune key.
    """
    global _autotune_override
    _autotune_override = enabled


def autotune_enabled() -> bool:
    """Whether kernels benchmark all their configs (True) or take the first, pinned one (False)."""
    if _autotune_override is not None:
        return _autotune_override
    if interpreter_enabled():
        return False
    return os.environ.get("TRITONREC_AUTOTUNE", "1").lower() not in ("0", "false", "off", "no")


class ConfigChooser:
    """The ``early_config_prune`` of a tritonrec kernel: which configs autotuning may try for one launch (see the
    module docstring for the order). Triton calls it once per new autotune key."""

    def __init__(self, name: str, key: Sequence[str], fits: Callable[[dict, dict], bool] | None) -> None:
        self.name, self.key, self.fits = name, list(key), fits
        self.last_count = 0  # configs the last call kept (read by _ChosenConfigBench)

    def fitting(self, configs: list[Any], args: dict[str, Any]) -> list[Any]:
        if self.fits is None:
            return list(configs)
        kept = [c for c in configs if self.fits(c.all_kwargs(), args)]
        if not kept:
            raise ValueError(f"no autotune config of {self.name} fits this launch ({_describe(self.key, args)})")
        return kept

    def __call__(self, configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        chosen = self._choose(configs, named_args, **kwargs)
        self.last_count = len(chosen)
        return chosen

    def _choose(self, configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        args = {**named_args, **kwargs}
        fitting = self.fitting(configs, args)
        if _all_configs_depth:
            return fitting
        pinned = _pinned.get(self.name)
        if pinned is not None:
            return [pinned]
        from tritonrec.kernels import tuned

        choice = tuned.tuned_config(self.name, tuned.tuning_key(self.key, args), fitting)
        if choice is not None:
            return [choice]
        return fitting if autotune_enabled() else fitting[:1]


def _describe(key: Sequence[str], args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={args.get(k)!r}" for k in key)


_all_configs_depth = 0
_pinned: dict[str, Any] = {}


@contextlib.contextmanager
def all_configs_considered() -> Iterator[None]:
    """Within the block, kernels offer every config that fits (no tuned file, no pin, autotuning on): what the AOT
    compiler and the tuning sweep enumerate."""
    global _all_configs_depth
    _all_configs_depth += 1
    try:
        yield
    finally:
        _all_configs_depth -= 1


@contextlib.contextmanager
def pinned_config(kernel_name: str, config: Any) -> Iterator[None]:
    """Within the block, kernel ``module:function`` runs ``config`` for keys it has not cached yet (clear the
    autotuner's ``cache`` to re-choose)."""
    _pinned[kernel_name] = config
    try:
        yield
    finally:
        _pinned.pop(kernel_name, None)


def autotune(
    configs: Sequence[Any], key: list[str], fits: Callable[[dict, dict], bool] | None = None, **kwargs: Any
) -> Callable:
    """``triton.autotune`` whose configs are chosen by :class:`ConfigChooser` (pin, tuned file, or all / first).

    ``key`` should name power-of-two bucket arguments (see :func:`pow2_bucket`) so jagged batches do not retune on
    every new total length. ``fits(config.all_kwargs(), launch args)`` may rule configs out per launch.
    """
    if not configs:
        raise ValueError("autotune needs at least one config")

    def decorate(fn: Callable) -> Callable:
        chooser = ConfigChooser(_function_name(fn), key, fits)
        kwargs.setdefault("do_bench", _ChosenConfigBench(chooser))
        return triton.autotune(
            configs=list(configs), key=key, prune_configs_by={"early_config_prune": chooser}, **kwargs
        )(fn)

    return decorate


class _ChosenConfigBench:
    """The autotuner's timer: times nothing when the chooser kept one config. Triton 3.9 then skips the benchmark
    itself; Triton 3.6 (torch 2.11's) times the lone config anyway, running the kernel over and over at the first
    launch of every key, and under the interpreter on a machine without a GPU driver it fails."""

    def __init__(self, chooser: ConfigChooser) -> None:
        self.chooser = chooser

    def __call__(self, kernel_call: Callable[[], Any], quantiles: Sequence[float]) -> list[float]:
        if self.chooser.last_count <= 1:
            return [0.0] * len(quantiles)
        return _default_benchmarker()(kernel_call, quantiles=quantiles)


def _default_benchmarker() -> Callable[..., list[float]]:
    """What ``triton.autotune`` times with when given no ``do_bench`` (the active driver's benchmarker)."""
    from triton.runtime import driver

    return driver.active.get_benchmarker()


def _function_name(fn: Any) -> str:
    """``module:function`` of the Python function under the jit / heuristics wrappers (the kernel's tuned-file id)."""
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{fn.__module__}:{fn.__qualname__}"


# Programs a launch puts on grid axis x, at most: CUDA allows 2**31 - 1, but on AMD programs x threads per program
# must stay below 2**32 (the dispatch packet's work-item count is a uint32), so with up to 1024 threads per program
# (16 warps of 64 lanes) 2**22 - 1 programs is the portable limit. Kernels whose work can exceed it stride over it.
MAX_PROGRAMS = (2**32 - 1) // 1024


def grid_programs(work_items: int) -> int:
    """Programs for ``work_items`` independent items on grid axis x: one each, capped at :data:`MAX_PROGRAMS` (the
    kernel then strides, ``for item in range(tl.program_id(0), work_items, tl.num_programs(0))``)."""
    return max(1, min(int(work_items), MAX_PROGRAMS))


def pow2_bucket(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): the autotune key of a size that varies batch to batch."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
