"""Plain ``torch.fx.symbolic_trace`` of forwards that build the sparse types (torchrec's approach).

The sparse types' metaclass derives from torch.fx's ``ProxyableClassMeta``: calling the class with a ``Proxy``
among its arguments (at any depth, e.g. in a list) while fx traces records one ``call_function`` node whose target
is the class, so the constructor, and every check it makes, runs when the graph runs, on real tensors. Outside a
symbolic trace a call costs one flag test and one Python frame more than ``type.__call__`` (a few hundred ns).
Static constructors and comparisons that inspect their arguments (``KeyedTensor.regroup`` / ``from_tensor_list``,
``KeyedJaggedTensor.concat`` / ``from_jt_dict`` / ``empty_like``, ``JaggedTensor.from_dense_lengths``,
``kjt_is_equal``, ``jt_is_equal``) delegate to module-level functions registered with ``torch.fx.wrap``, which trace
to one node in the same way; ``from_lengths_sync`` / ``from_offsets_sync`` trace to the constructor node and a
``sync`` call.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Proxy, ProxyableClassMeta, _symbolic_trace
from torch.fx.node import map_aggregate

_type_call = type.__call__

if hasattr(_symbolic_trace, "_is_fx_tracing_flag"):  # torch 2.x: the flag symbolic_trace sets while it traces

    def _tracing() -> bool:
        return _symbolic_trace._is_fx_tracing_flag

else:  # a torch without that private flag: the public (slower) test
    _tracing = _symbolic_trace.is_fx_symbolic_tracing


def _first_proxy(args: tuple, kwargs: dict[str, Any]) -> Proxy | None:
    found: list[Proxy] = []

    def visit(a: object) -> None:
        if not found and isinstance(a, Proxy):
            found.append(a)

    map_aggregate(args, visit)
    map_aggregate(kwargs, visit)
    return found[0] if found else None


class SparseTypeMeta(ProxyableClassMeta):
    """``ProxyableClassMeta`` without its per-call cost in eager: ``ProxyableClassMeta.__call__`` calls
    ``is_fx_tracing()`` (which also warns about ``torch.export``) on every construction; this reads the symbolic
    tracing flag and otherwise constructs as ``type`` does."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _tracing():
            proxy = _first_proxy(args, kwargs)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", cls, args, kwargs)
        return _type_call(cls, *args, **kwargs)
