"""Record the Triton launches a piece of host code makes: which kernel, with which arguments, constexprs and grid.

The AOT compiler (:mod:`tritonrec.kernels.aot`) and the tuning sweep (``scripts/autotune.py``) both need the real
launches of the real launchers, not a hand-kept list of signatures that drifts when a kernel changes. Every launch
goes through ``kernel[grid](*args, **kwargs)``, i.e. ``KernelInterface.__getitem__`` of the outermost wrapper
(autotuner, heuristics or the jitted function itself), so :func:`capture_launches` patches that one method for the
duration of a ``with`` block. With ``execute=False`` launches are recorded and skipped, which lets host code run on
``meta`` tensors at production sizes to check grids without computing anything.

:func:`expand_launch` then turns one recorded launch into the compile variants a GPU could see: one per autotune
config that survives the kernel's config filter (with its heuristics applied), each with its grid.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tritonrec.kernels._triton import HAS_TRITON

if HAS_TRITON:
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import KernelInterface


@dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call as the launcher made it (before autotuning picked a config)."""

    kernel: Any
    args: tuple
    kwargs: dict[str, Any]
    grid: Any
    label: str = ""


@dataclass
class Variant:
    """One compilable specialisation of a launch: the innermost jitted function, every parameter's value in order
    (launcher arguments, config, heuristics), the compile options (warps, stages, fp fusion) and the grid."""

    name: str
    jit: Any
    args: tuple
    constexprs: dict[str, Any]
    options: dict[str, Any]
    grid: tuple[int, int, int]
    config: str


def kernel_name(kernel: Any) -> str:
    """``module:function`` of the Python function under any autotune / heuristics / jit wrappers."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{fn.__module__}:{fn.__qualname__}"


@contextlib.contextmanager
def capture_launches(execute: bool = True, label: str = "") -> Iterator[list[Launch]]:
    """Within the block, every Triton launch is appended to the yielded list (and run only if ``execute``).

    It patches ``KernelInterface.__getitem__`` process-wide for the block's duration, so launches from any thread
    are recorded (autograd's backward thread included); do not capture in two threads at once.
    """
    if not HAS_TRITON:
        raise RuntimeError("capturing launches needs Triton")
    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def getitem(self: Any, grid: Any) -> Callable:
        def launch(*args: Any, **kwargs: Any) -> Any:
            launches.append(Launch(self, args, dict(kwargs), grid, label))
            return self.run(*args, grid=grid, warmup=False, **kwargs) if execute else None

        return launch

    KernelInterface.__getitem__ = getitem
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def config_label(config: Any) -> str:
    """``BLOCK_L=16,num_warps=4,num_stages=3`` for an autotune config, ``launcher`` when there is none."""
    if config is None:
        return "launcher"
    return ",".join(f"{k}={v}" for k, v in config.all_kwargs().items())


def candidate_configs(autotuner: Any, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The configs autotuning would try for this launch: the kernel's filter applied, tuned / pinned choices off."""
    from tritonrec.kernels import backend

    named = dict(zip(autotuner.arg_names, args, strict=False))
    prune = autotuner.early_config_prune
    if prune is None:
        return list(autotuner.configs)
    with backend.all_configs_considered():
        return list(prune(autotuner.configs, named, **kwargs))


def _parameters(fn: Any) -> list[inspect.Parameter]:
    while hasattr(fn, "fn"):
        fn = fn.fn
    return list(inspect.signature(fn).parameters.values())


def expand_launch(launch: Launch, all_configs: bool = True) -> list[Variant]:
    """The compile variants of ``launch``: every candidate config (or only the one the launch would use when
    ``all_configs`` is False and autotuning is off), heuristics applied, grid evaluated (padded to 3 axes).
    Arguments passed by name (as ``torch.library.wrap_triton`` does) are put back in parameter order."""
    kernel, args = launch.kernel, launch.args
    configs: list[Any] = [None]
    wrapped = kernel
    if isinstance(kernel, Autotuner):
        configs = candidate_configs(kernel, args, launch.kwargs)
        if not all_configs:
            configs = configs[:1]
        wrapped = kernel.fn
    params = _parameters(kernel)
    variants = []
    for config in configs:
        kwargs = dict(launch.kwargs)
        if config is not None:
            kwargs.update(config.all_kwargs())
        inner = wrapped
        while isinstance(inner, Heuristics):
            named = dict(zip(inner.arg_names, args, strict=False))
            for name, rule in inner.values.items():
                kwargs[name] = rule({**named, **kwargs})
            inner = inner.fn
        named = {**{p.name: p.default for p in params if p.default is not p.empty}, **kwargs}
        named |= dict(zip((p.name for p in params), args, strict=False))
        values = tuple(named[p.name] for p in params)
        constexprs = {p.name: named[p.name] for p in params if "constexpr" in str(p.annotation)}
        options = {k: v for k, v in kwargs.items() if k not in {p.name for p in params}}
        grid = launch.grid(named) if callable(launch.grid) else launch.grid
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        variants.append(Variant(kernel_name(kernel), inner, values, constexprs, options, grid, config_label(config)))
    return variants
