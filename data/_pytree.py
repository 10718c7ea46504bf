"""Register the sparse types as pytree nodes, so ``torch.utils._pytree.tree_map`` (device moves of whole batches),
``torch.export`` and ``torch.compile`` see their tensors as leaves and rebuild them from a static context (with key
paths, and JSON contexts so that ``torch.export.save`` / ``load`` round-trip programs taking them)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.utils._pytree as pytree

from tritonrec.data.jagged_tensor import JaggedTensor
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.data.keyed_tensor import KeyedTensor

_FIELDS = ("_values", "_weights", "_lengths", "_offsets")


def _present(obj: object) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """Only the tensors that exist are children (so tree_map functions never see None); their names go in the
    context."""
    names = tuple(f for f in _FIELDS if getattr(obj, f) is not None)
    return names, [getattr(obj, f) for f in names]


def _flatten_jt(jt: JaggedTensor) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    names, children = _present(jt)
    return children, names


def _unflatten_jt(children: list[Any], context: tuple[str, ...]) -> JaggedTensor:
    jt = JaggedTensor.__new__(JaggedTensor)
    for name in _FIELDS:
        setattr(jt, name, None)
    for name, child in zip(context, children, strict=True):
        setattr(jt, name, child)
    return jt


def _flatten_kjt(kjt: KeyedJaggedTensor) -> tuple[list[torch.Tensor], tuple]:
    """Children: the present tensors, then the inverse indices' tensor if any (a VBE KJT keeps them through a
    ``tree_map``); their keys go in the context (``None`` without inverse indices)."""
    names, children = _present(kjt)
    inverse = kjt._inverse_indices
    if inverse is not None:
        names, children = (*names, "_inverse_indices"), [*children, inverse[1]]
    inverse_keys = None if inverse is None else list(inverse[0])
    return children, (names, kjt._keys, kjt._stride, kjt._stride_per_key_per_rank, kjt._length_per_key, inverse_keys)


def _unflatten_kjt(children: list[Any], context: tuple) -> KeyedJaggedTensor:
    names, keys, stride, strides, length_per_key = context[:5]
    inverse_keys = context[5] if len(context) > 5 else None  # contexts saved before inverse indices were kept
    parts = dict(zip(names, children, strict=True))
    inverse = None if inverse_keys is None else (list(inverse_keys), parts["_inverse_indices"])
    kjt = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
    kjt._init(keys, parts["_values"], parts.get("_weights"), parts.get("_lengths"), parts.get("_offsets"), stride,
              strides, length_per_key, inverse)  # fmt: skip
    return kjt


def _flatten_kt(kt: KeyedTensor) -> tuple[list[torch.Tensor], tuple]:
    return [kt._values], (kt._keys, kt._length_per_key, kt._key_dim)


def _unflatten_kt(children: list[Any], context: tuple) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    return KeyedTensor(keys, length_per_key, children[0], key_dim)


def _child_names(obj: object, context: Any) -> tuple[str, ...]:
    """The attribute each child comes from: named in the context for the jagged types, ``_values`` for KeyedTensor."""
    if isinstance(obj, KeyedJaggedTensor):
        return context[0]
    if isinstance(obj, JaggedTensor):
        return context
    return ("_values",)


def _with_keys(flatten: Any) -> Any:
    """``flatten_with_keys`` from ``flatten`` (``torch.export`` names every input leaf by its key path)."""

    def flatten_with_keys(obj: object) -> tuple[list[tuple[pytree.KeyEntry, Any]], Any]:
        children, context = flatten(obj)
        names = _child_names(obj, context)
        return [(pytree.GetAttrKey(name), child) for name, child in zip(names, children, strict=True)], context

    return flatten_with_keys


def _context_from_json(cls: type) -> Any:
    """The inverse of ``json.dumps`` of a context (which turns tuples into lists), for ``torch.export.load``."""

    def load(dumped: str) -> Any:
        context = json.loads(dumped)
        if cls is JaggedTensor:
            return tuple(context)
        if cls is KeyedJaggedTensor:
            return (tuple(context[0]), *context[1:])
        return tuple(context)

    return load


def register() -> None:
    """Idempotent: registering twice (e.g. a module reload in a notebook) is a no-op."""
    for cls, flatten, unflatten in (
        (JaggedTensor, _flatten_jt, _unflatten_jt),
        (KeyedJaggedTensor, _flatten_kjt, _unflatten_kjt),
        (KeyedTensor, _flatten_kt, _unflatten_kt),
    ):
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(
                cls,
                flatten,
                unflatten,
                serialized_type_name=f"tritonrec.data.{cls.__name__}",
                to_dumpable_context=json.dumps,
                from_dumpable_context=_context_from_json(cls),
                flatten_with_keys_fn=_with_keys(flatten),
            )
