"""Which ``@triton.jit`` functions a package defines, and which of them the AOT compiler reaches: the launched kernels
plus every jitted helper their source calls. A function reached by neither is a kernel no workload of
:mod:`tritonrec.kernels.aot_workloads` launches, so no target ever compiles it."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from typing import Any

from tritonrec.kernels.launch_capture import kernel_name


def _is_jitted(obj: Any) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics")


def discover_kernels(package: str = "tritonrec.kernels") -> set[str]:
    """``module:function`` of every ``@triton.jit`` function defined in ``package`` (kernels and device helpers)."""
    root = importlib.import_module(package)
    modules = [root] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, f"{package}.")]
    found = set()
    for module in modules:
        for obj in vars(module).values():
            if _is_jitted(obj) and kernel_name(obj).split(":")[0] == module.__name__:
                found.add(kernel_name(obj))
    return found


def reached_kernels(launched: set[str], package: str = "tritonrec.kernels") -> set[str]:
    """``launched`` plus every jitted helper of ``package`` their source calls, transitively (names resolved in each
    function's module globals, ``module.helper`` attributes included)."""
    from tritonrec.kernels.aot_compile import resolve_kernel

    reached, todo = set(), list(launched)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        fn = resolve_kernel(name)
        while hasattr(fn, "fn"):
            fn = fn.fn
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            target = None
            if isinstance(node, ast.Name):
                target = fn.__globals__.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = getattr(fn.__globals__.get(node.value.id), node.attr, None)
            if target is not None and _is_jitted(target) and kernel_name(target).startswith(f"{package}."):
                todo.append(kernel_name(target))
    return reached


def unreached_kernels(launched: set[str], package: str = "tritonrec.kernels") -> list[str]:
    """Jitted functions of ``package`` that no captured launch compiles (neither launched nor called)."""
    return sorted(discover_kernels(package) - reached_kernels(launched, package))
