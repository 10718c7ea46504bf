"""Awaitables: the handles every collective returns (torchrec's ``Awaitable``, ``NoWait``, ``LazyAwaitable``,
``LazyNoWait``).

A comm op launches its collective and returns at once; whoever needs the result calls ``wait()``. That is what lets
a pipeline overlap the input/output distribution of one batch with the compute of another. ``callbacks`` run on the
result inside ``wait()``, in order, each replacing the result with its return value.

``LazyAwaitable`` waits by itself as late as possible: when a torch function receives it as an argument (through
``__torch_function__``), when an attribute of the result is read, or when it meets a Python operator. Code written
for plain tensors then runs unchanged on awaitables, and the wait happens at the first real use.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from tritonrec.dist.record import record

W = TypeVar("W")


class Awaitable(abc.ABC, Generic[W]):
    """A result that may not exist yet. Subclasses implement ``_wait_impl``; ``wait()`` adds the callbacks."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []

    @abc.abstractmethod
    def _wait_impl(self) -> W:
        """Block until the result exists and return it (without callbacks)."""

    def wait(self) -> W:
        with record(f"## {type(self).__name__} wait() ##"):
            result: W = self._wait_impl()
            for callback in self.callbacks:
                result = callback(result)
        return result

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        """Functions applied to the result by ``wait()``, in order; append to add one."""
        return self._callbacks


class NoWait(Awaitable[W]):
    """An awaitable whose result is already known (single-rank shortcuts, tests)."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


def _resolve(obj: Any) -> Any:
    """``obj``'s result if it is a LazyAwaitable (waiting once, then cached), else ``obj`` itself."""
    if isinstance(obj, LazyAwaitable):
        if obj._result is None:
            obj._result = obj.wait()
        return obj._result
    return obj


def _resolve_nested(obj: Any) -> Any:
    """``_resolve`` through lists, tuples and dicts (torch functions take tensors inside containers, e.g. cat)."""
    if isinstance(obj, (list, tuple)):
        return type(obj)(_resolve_nested(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _resolve_nested(value) for key, value in obj.items()}
    return _resolve(obj)


class LazyAwaitable(Awaitable[W]):
    """An awaitable that waits by itself on first use (torch function argument, attribute read, operator).

    The result is cached after the first wait. When a call takes two lazy awaitables, they are waited in argument
    order, so the overlap is only as good as that order.
    """

    def __init__(self) -> None:
        super().__init__()
        self._result: W | None = None

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return func(*_resolve_nested(args), **_resolve_nested(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the awaitable itself lacks: those belong to the result.
        if name == "_result":
            raise RuntimeError(f"{type(self).__name__} was not initialised: its __init__ must call super().__init__()")
        if name.startswith("__") and name.endswith("__"):
            # copy/pickle probe dunders such as __setstate__ or __deepcopy__; waiting here would surprise them.
            raise AttributeError(name)
        return getattr(_resolve(self), name)


class LazyNoWait(LazyAwaitable[W]):
    """A lazy awaitable whose result is already known."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


def _install_operators() -> None:
    """Give LazyAwaitable the Python operators (``a + b``, ``a[0]``, ``-a``...), each waiting for its operands.

    The names come from torch.fx's operator tables, the same ones torchrec uses, so the two cover the same set.
    """

    def binary_or_unary(op: Callable[..., Any], name: str) -> Callable[..., Any]:
        def method(*args: Any) -> Any:
            return op(*(_resolve(a) for a in args))

        method.__name__ = name
        return method

    def reflected(op: Callable[..., Any], name: str) -> Callable[..., Any]:
        def method(self: Any, other: Any) -> Any:
            return op(_resolve(other), _resolve(self))

        method.__name__ = name
        return method

    for op_name in torch.fx.graph.magic_methods:
        if hasattr(operator, op_name):  # the table also lists "div", which Python 3 no longer has
            dunder = f"__{op_name.rstrip('_')}__"  # operator.and_ -> __and__
            setattr(LazyAwaitable, dunder, binary_or_unary(getattr(operator, op_name), dunder))
    for op_name in torch.fx.graph.reflectable_magic_methods:
        if hasattr(operator, op_name) and op_name != "getitem":
            dunder = f"__r{op_name.rstrip('_')}__"
            setattr(LazyAwaitable, dunder, reflected(getattr(operator, op_name), dunder))


_install_operators()

__all__ = ["Awaitable", "LazyAwaitable", "LazyNoWait", "NoWait"]
