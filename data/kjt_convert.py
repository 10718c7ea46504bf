"""Conversions of ``KeyedJaggedTensor`` (torchrec's names): the two small modules between a KJT and a dict of
JaggedTensors (``ComputeKJTToJTDict`` / ``ComputeJTDictToKJT``, each one node under ``torch.fx.symbolic_trace``), and
the flat tensor list of a list of KJTs (``flatten_kjt_list`` / ``unflatten_kjt_list``), torchrec's layout::

    per KJT, 6 entries: values, weights, lengths, offsets, stride_per_key_per_rank, inverse_indices[1]
    (absent ones are None; stride_per_key_per_rank is torchrec's int32 [T, W] CPU tensor), context: its keys
"""

from __future__ import annotations

import torch

from tritonrec.data.jagged_tensor import JaggedTensor
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor

# torchrec's ``KeyedJaggedTensor._fields``: the entries each KJT contributes to the flat list
_NUM_FIELDS = 6


class ComputeKJTToJTDict(torch.nn.Module):
    """``KeyedJaggedTensor`` -> ``{key: JaggedTensor}`` (key ``t``'s bags, views into the KJT's tensors)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return _kjt_to_jt_dict(keyed_jagged_tensor)


class ComputeJTDictToKJT(torch.nn.Module):
    """``{key: JaggedTensor}`` -> ``KeyedJaggedTensor`` (keys in dict order; different batch sizes give a VBE KJT)."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)


@torch.fx.wrap
def _kjt_to_jt_dict(keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    """One node under fx (the type check runs when the graph runs, on the real argument)."""
    if not isinstance(keyed_jagged_tensor, KeyedJaggedTensor):
        raise TypeError(f"keyed_jagged_tensor must be a KeyedJaggedTensor, got {type(keyed_jagged_tensor).__name__}")
    return keyed_jagged_tensor.to_dict()


def _strides_tensor(strides: list[list[int]]) -> torch.Tensor:
    """``stride_per_key_per_rank`` as torchrec holds it: an int32 ``[T, W]`` CPU tensor."""
    if not strides:
        return torch.empty((0, 0), dtype=torch.int32)
    return torch.tensor(strides, dtype=torch.int32)


def _flatten_one(kjt: KeyedJaggedTensor, where: str) -> list[torch.Tensor | None]:
    strides = kjt._stride_per_key_per_rank
    inverse = kjt.inverse_indices_or_none()
    if inverse is not None and list(inverse[0]) != kjt.keys():
        # the flat form keeps only the keys, which unflatten_kjt_list uses as the inverse indices' keys (torchrec's)
        raise ValueError(
            f"{where} has inverse_indices keyed {list(inverse[0])}, not by its keys {kjt.keys()}: the flat form "
            "cannot keep them"
        )
    return [
        kjt.values(),
        kjt.weights_or_none(),
        kjt.lengths_or_none(),
        kjt.offsets_or_none(),
        None if strides is None else _strides_tensor(strides),
        None if inverse is None else inverse[1],
    ]


def flatten_kjt_list(kjt_arr: list[KeyedJaggedTensor]) -> tuple[list[torch.Tensor | None], list[list[str]]]:
    """``6 * len(kjt_arr)`` tensors (or None), torchrec's field order (module docstring), and each KJT's keys."""
    if not isinstance(kjt_arr, (list, tuple)):
        raise TypeError(f"kjt_arr must be a list of KeyedJaggedTensor, got {type(kjt_arr).__name__}")
    flat: list[torch.Tensor | None] = []
    for i, kjt in enumerate(kjt_arr):
        if not isinstance(kjt, KeyedJaggedTensor):
            raise TypeError(f"kjt_arr[{i}] must be a KeyedJaggedTensor, got {type(kjt).__name__}")
        flat.extend(_flatten_one(kjt, f"kjt_arr[{i}]"))
    return flat, [list(kjt.keys()) for kjt in kjt_arr]


def unflatten_kjt_list(values: list[torch.Tensor | None], contexts: list[list[str]]) -> list[KeyedJaggedTensor]:
    """The inverse of :func:`flatten_kjt_list`: one KJT per context from each run of 6 entries (checked as a user-built
    KJT is)."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"values must be a list of tensors (or None), got {type(values).__name__}")
    if not isinstance(contexts, (list, tuple)) or not all(isinstance(keys, (list, tuple)) for keys in contexts):
        raise TypeError(f"contexts must be a list of key lists, got {contexts!r:.200}")
    if len(values) != _NUM_FIELDS * len(contexts):
        raise ValueError(
            f"values must hold {_NUM_FIELDS} entries per KeyedJaggedTensor: {len(contexts)} contexts need "
            f"{_NUM_FIELDS * len(contexts)}, got {len(values)}"
        )
    out = []
    for j, keys in enumerate(contexts):
        kjt_values, weights, lengths, offsets, strides, inverse = values[j * _NUM_FIELDS : (j + 1) * _NUM_FIELDS]
        if kjt_values is None:
            raise ValueError(f"values[{j * _NUM_FIELDS}] (the values of KeyedJaggedTensor {j}) is None")
        out.append(
            KeyedJaggedTensor(
                list(keys),
                kjt_values,
                weights,
                lengths,
                offsets,
                stride_per_key_per_rank=strides,
                inverse_indices=None if inverse is None else (list(keys), inverse),
            )
        )
    return out
