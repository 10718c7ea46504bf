"""``quantize_embeddings``: swap a model's embedding collections for their quantized inference counterparts
(torchrec's ``torchrec.inference.modules.quantize_embeddings``).

Every :class:`EmbeddingBagCollection` becomes a :class:`QuantEmbeddingBagCollection` and every
:class:`EmbeddingCollection` a :class:`QuantEmbeddingCollection` (torchrec swaps only the EBC unless the EC is named
in ``additional_qconfig_spec_keys`` and ``additional_mapping``; we swap both, and those arguments still add types).
Types match exactly, as torch's ``quantize_dynamic``: a subclass (fused, feature-processed) is left alone unless
named. The swap follows torchrec's protocol, so a class named in ``additional_mapping`` works as it would there: the
float module gets a ``qconfig`` (:class:`QuantConfig`: weight ``dtype``, activation ``output_dtype``,
``per_table_weight_dtype``) and the new module is ``target.from_float(float_module)``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver

from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection
from tritonrec.modules.quant_embedding_modules import (
    _OUTPUT_DTYPES,
    _QCONFIG_DATA_TYPES,
    QuantEmbeddingBagCollection,
)


class QuantConfig(NamedTuple):
    """torchrec's ``QuantConfig``: observers whose ``()`` carries the output (``activation``) and weight dtypes,
    plus optional per-table weight dtypes ``{table name: dtype}``."""

    activation: type
    weight: type
    per_table_weight_dtype: dict[str, torch.dtype] | None = None


def _default_mapping() -> dict[type[nn.Module], type[nn.Module]]:
    return {EmbeddingBagCollection: QuantEmbeddingBagCollection, EmbeddingCollection: QuantEmbeddingCollection}


def _check_weight_dtype(dtype: object, name: str) -> torch.dtype:
    if dtype not in _QCONFIG_DATA_TYPES:
        raise ValueError(f"{name} must be one of {list(_QCONFIG_DATA_TYPES)}, got {name}={dtype!r}")
    return dtype  # type: ignore[return-value]


def _check_types(types: object, name: str) -> list[type]:
    if types is None:
        return []
    if isinstance(types, (str, bytes)) or not hasattr(types, "__iter__"):
        raise TypeError(f"{name} must be a list of nn.Module types, got {name}={types!r}")
    out = list(types)  # type: ignore[call-overload]
    for t in out:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"{name} must hold nn.Module types, got {t!r}")
    return out


def _check_mapping(mapping: object) -> dict[type[nn.Module], type[nn.Module]]:
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise TypeError(f"additional_mapping must be a dict of float type -> quantized type, got {mapping!r}")
    for source, target in mapping.items():
        _check_types([source], "additional_mapping")
        if not (isinstance(target, type) and callable(getattr(target, "from_float", None))):
            raise TypeError(f"additional_mapping[{source.__name__}] must be a type with from_float, got {target!r}")
    return dict(mapping)


def _table_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s tables (an EBC's ``embedding_bag_configs`` or an EC's ``embedding_configs``)."""
    configs = getattr(module, "embedding_bag_configs", None) or getattr(module, "embedding_configs", None)
    return [c.name for c in configs()] if callable(configs) else []


def _targets(root: nn.Module, swap: Mapping[type, type]) -> list[tuple[nn.Module | None, str, nn.Module]]:
    """``(parent, attribute, module)`` for every module to swap, outermost first (a swapped module's children are
    not visited, as ``quantize_dynamic``); ``parent`` is None when the root itself is swapped."""
    if type(root) in swap:
        return [(None, "", root)]
    found: list[tuple[nn.Module | None, str, nn.Module]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(child) in swap:
                found.append((parent, name, child))
            else:
                visit(child)

    visit(root)
    return found


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool,
    additional_qconfig_spec_keys: list[type[nn.Module]] | None = None,
    additional_mapping: dict[type[nn.Module], type[nn.Module]] | None = None,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: dict[str, torch.dtype] | None = None,
) -> nn.Module:
    """Swap every embedding collection inside ``module`` for its quantized counterpart; returns the model.

    Args:
        module: the model (or a collection itself: then the quantized collection is returned).
        dtype: table weight dtype: ``torch.quint8`` / ``torch.qint8`` / ``torch.int8`` (INT8), ``torch.quint4x2``
            (INT4), ``torch.quint2x4`` (INT2), ``torch.float16`` (FP16) or ``torch.float32`` (FP32).
        inplace: swap inside ``module`` itself; otherwise a deep copy is swapped and ``module`` is left as it was.
        additional_qconfig_spec_keys: more float module types to quantize (each needs an ``additional_mapping``).
        additional_mapping: ``{float type: quantized type}`` added to (or overriding) the default mapping.
        output_dtype: the quantized modules' output dtype (float32, float16 or bfloat16).
        per_table_weight_dtype: ``{table name: dtype}`` overriding ``dtype`` for those tables; every name must be a
            table of a module being swapped.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    _check_weight_dtype(dtype, "dtype")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got inplace={inplace!r}")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {_OUTPUT_DTYPES}, got output_dtype={output_dtype!r}")
    if per_table_weight_dtype is not None and not isinstance(per_table_weight_dtype, Mapping):
        raise TypeError(f"per_table_weight_dtype must be a dict of table name -> dtype, got {per_table_weight_dtype!r}")
    per_table = dict(per_table_weight_dtype or {})
    for name, table_dtype in per_table.items():
        _check_weight_dtype(table_dtype, f"per_table_weight_dtype[{name!r}]")
    mapping = {**_default_mapping(), **_check_mapping(additional_mapping)}
    extra_keys = _check_types(additional_qconfig_spec_keys, "additional_qconfig_spec_keys")
    spec_keys = [EmbeddingBagCollection, EmbeddingCollection, *extra_keys]
    swap = {t: mapping[t] for t in spec_keys if t in mapping}  # torch's rule: a type needs a qconfig and a mapping

    targets = list(_targets(module, swap))
    known = {name for _, _, m in targets for name in _table_names(m)}
    unknown = sorted(set(per_table) - known)
    if unknown:
        raise ValueError(
            f"per_table_weight_dtype names tables no swapped module has: {unknown} (tables: {sorted(known)})"
        )
    if not inplace:
        module = copy.deepcopy(module)
        targets = list(_targets(module, swap))
    qconfig = QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=output_dtype),
        weight=PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=per_table or None,
    )
    swapped: dict[int, nn.Module] = {}  # a collection reachable twice becomes one quantized module
    for parent, name, float_module in targets:
        if id(float_module) not in swapped:
            float_module.qconfig = qconfig  # type: ignore[assignment]
            try:
                swapped[id(float_module)] = swap[type(float_module)].from_float(float_module)  # type: ignore[attr-defined]
            finally:
                del float_module.qconfig  # in place, a module that failed to convert keeps no qconfig
        if parent is None:
            return swapped[id(float_module)]
        setattr(parent, name, swapped[id(float_module)])
    return module


__all__ = ["QuantConfig", "quantize_embeddings"]
