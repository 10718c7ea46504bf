"""Plain ``torch.fx.symbolic_trace`` of models holding this project's embedding collections.

A collection's forward routes its KJT by key, checks ids and lengths and re-packs its tables: control flow on the
input that fx proxies cannot follow. torchrec's collections are built so plain fx can trace through them (one
``nn.EmbeddingBag`` per table); ours run table-batched kernels instead, so under fx they record themselves as one
``call_module`` node, as the leaf a sharded module already is to the train pipelines' tracer. The traced
``GraphModule`` calls the same submodule with real inputs, so it computes exactly what the eager model does
(forward, backward and fused updates alike).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _first_proxy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.Proxy | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.fx.Proxy):
            return value
    return None


def fx_leaf_call(module: nn.Module, *args: Any, **kwargs: Any) -> torch.fx.Proxy | None:
    """While fx traces a model holding ``module``, record ``module(*args, **kwargs)`` as a ``call_module`` node and
    return its proxy; otherwise (an eager call, dynamo, export: no fx proxy among the arguments) return None.

    Raises ``TypeError`` when ``module`` is the traced root itself: a graph whose only node calls its own root would
    call itself forever, so trace a module that holds it (torch.export and torch.compile take it as the root)."""
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    tracer = proxy.tracer
    path = tracer.path_of_module(module)
    if path == "":
        raise TypeError(
            f"torch.fx cannot trace a {type(module).__name__} as the root module: it records itself as one "
            "call_module node of the model that holds it; trace that model, or use torch.export / torch.compile"
        )
    return tracer.create_proxy("call_module", path, args, kwargs)


__all__ = ["fx_leaf_call"]
