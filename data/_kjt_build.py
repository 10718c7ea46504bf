"""Constructors of ``KeyedJaggedTensor`` from other KJTs or JaggedTensors: ``from_jt_dict``, ``concat`` and
``empty_like`` (the bodies; the class's static methods reach them through ``torch.fx.wrap``-registered functions in
:mod:`tritonrec.data.keyed_jagged_tensor`, so each traces to one node)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tritonrec.data import keyed_jagged_tensor as _kjt_module  # call-time use: that module imports this one
from tritonrec.data._kjt_checks import check_members
from tritonrec.data.jagged_tensor import JaggedTensor

if TYPE_CHECKING:
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
    jts = check_members(jt_dict, "jt_dict", JaggedTensor, dict)
    weighted = {jt.weights_or_none() is not None for jt in jts}
    if len(weighted) > 1:
        raise ValueError("jt_dict mixes weighted and unweighted JaggedTensors")
    if not jts:
        return _kjt_module.KeyedJaggedTensor.empty()
    strides = [jt.lengths().numel() for jt in jts]
    uniform = all(s == strides[0] for s in strides)
    used = [int(jt.offsets()[-1].item()) if jt.offsets().numel() else 0 for jt in jts]  # drop slack tails
    return _kjt_module.KeyedJaggedTensor(
        keys=list(jt_dict.keys()),
        values=torch.cat([jt.values()[:n] for jt, n in zip(jts, used, strict=True)]),
        weights=(
            torch.cat([jt.weights()[:n] for jt, n in zip(jts, used, strict=True)]) if weighted == {True} else None
        ),
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=strides[0] if uniform else None,
        stride_per_key_per_rank=None if uniform else [[s] for s in strides],
    ).sync()


def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    weights = kjt.weights_or_none()
    empty = _kjt_module.KeyedJaggedTensor.empty(
        is_weighted=weights is not None,
        device=kjt.device(),
        values_dtype=kjt.values().dtype,
        weights_dtype=None if weights is None else weights.dtype,
        lengths_dtype=kjt.lengths().dtype,
    )
    empty._stride = kjt.stride()
    return empty


def concat(kjt_list: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    kjt_list = check_members(kjt_list, "kjt_list", _kjt_module.KeyedJaggedTensor)
    if not kjt_list:
        raise ValueError("kjt_list must hold at least one KeyedJaggedTensor, got an empty list")
    weighted = {k.weights_or_none() is not None for k in kjt_list}
    if len(weighted) > 1:
        raise ValueError("kjt_list mixes weighted and unweighted KeyedJaggedTensors")
    vbe = {k.variable_stride_per_key() for k in kjt_list}
    if len(vbe) > 1:
        raise ValueError("kjt_list mixes variable-stride (VBE) and fixed-stride KeyedJaggedTensors")
    strides = {k.stride() for k in kjt_list if k.keys()}
    if vbe == {False} and len(strides) > 1:
        raise ValueError(f"kjt_list members must share one stride, got strides {sorted(strides)}")
    used = [k.offset_per_key()[-1] if k.keys() else 0 for k in kjt_list]  # drop any slack tail of values
    return _kjt_module.KeyedJaggedTensor._trusted(
        keys=[key for k in kjt_list for key in k.keys()],
        values=torch.cat([k.values()[:n] for k, n in zip(kjt_list, used, strict=True)]),
        weights=(
            torch.cat([k.weights()[:n] for k, n in zip(kjt_list, used, strict=True)]) if weighted == {True} else None
        ),
        lengths=torch.cat([k.lengths() for k in kjt_list]),
        stride=max(k.stride() for k in kjt_list)
        if vbe == {True}
        else (strides.pop() if strides else kjt_list[0].stride()),
        strides=[row for k in kjt_list for row in k.stride_per_key_per_rank()] if vbe == {True} else None,
        length_per_key=[n for k in kjt_list for n in k.length_per_key()],
    )
