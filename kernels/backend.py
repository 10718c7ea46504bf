"""Which implementation of an op runs: the Triton kernel or its torch twin, and how kernels pick a launch config.

Every public op takes ``backend: Backend = "auto"`` and calls :func:`resolve_backend` once:

* ``"auto"``   -> ``"triton"`` when Triton is importable and the inputs live on CUDA, or when ``TRITON_INTERPRET=1``
  (tests run the real kernels on CPU tensors that way); ``"torch"`` otherwise (laptop CPU, notebooks).
* ``"triton"`` -> the kernel, or a ``RuntimeError`` saying why it cannot run here.
* ``"torch"``  -> the pure-torch twin, on any device.

Autotuning: kernels declare their configs next to themselves and decorate with :func:`autotune` (a thin wrapper of
``triton.autotune``). The first config of each list is the pinned default; it is the only one tried when autotuning is
switched off (``TRITONREC_AUTOTUNE=0``, :func:`set_autotune`, or the interpreter, where timing means nothing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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


def _first_config_unless_tuning(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    return configs if autotune_enabled() else configs[:1]


def autotune(configs: Sequence[Any], key: list[str], **kwargs: Any) -> Callable:
    """``triton.autotune`` whose config list shrinks to ``configs[0]`` when autotuning is off.

    ``key`` should name power-of-two bucket arguments (see :func:`pow2_bucket`) so jagged batches do not retune on
    every new total length.
    """
    if not configs:
        raise ValueError("autotune needs at least one config")
    return triton.autotune(
        configs=list(configs),
        key=key,
        prune_configs_by={"early_config_prune": _first_config_unless_tuning},
        **kwargs,
    )


def pow2_bucket(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): the autotune key of a size that varies batch to batch."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
