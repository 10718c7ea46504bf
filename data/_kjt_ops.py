"""The reshaping operations of ``KeyedJaggedTensor`` (permute, split, per-key views, movement, printing).

Kept apart from the class so each file stays readable; every function takes the KJT first and builds results through
``type(kjt)._trusted`` (results of these ops are consistent by construction, so they skip re-validation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tritonrec.data.jagged_tensor import JaggedTensor
from tritonrec.kernels import permute_1d_sparse_data, permute_2d_sparse_data
from tritonrec.kernels.checks import check_int, value_checks_enabled

if TYPE_CHECKING:
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


def _check_key_indices(indices: object, num_keys: int) -> list[int]:
    if not isinstance(indices, (list, tuple)):
        raise TypeError(f"indices must be a list of ints, got {type(indices).__name__}")
    what = f"a key index in [0, {num_keys})"
    return [
        check_int(index, f"indices[{position}]", 0, num_keys - 1, what=what) for position, index in enumerate(indices)
    ]


def _check_indices_tensor(indices_tensor: object, indices: list[int]) -> None:
    """``indices_tensor [len(indices)]`` holds ``indices`` (compared when value checks are on: one host read)."""
    if not isinstance(indices_tensor, torch.Tensor) or indices_tensor.shape != (len(indices),):
        got = tuple(indices_tensor.shape) if isinstance(indices_tensor, torch.Tensor) else type(indices_tensor).__name__
        raise ValueError(f"indices_tensor must be a [{len(indices)}] tensor holding indices, got {got}")
    if value_checks_enabled() and indices_tensor.tolist() != indices:
        raise ValueError(f"indices_tensor {indices_tensor.tolist()} disagrees with indices {indices}")


def permute(
    kjt: KeyedJaggedTensor, indices: list[int], indices_tensor: torch.Tensor | None = None
) -> KeyedJaggedTensor:
    """Output key ``i`` is input key ``indices[i]``. Fixed stride: one ``permute_2d_sparse_data`` over ``[T, B]``
    lengths; VBE: segment permutes of values by ``length_per_key`` and of lengths by ``stride_per_key``."""
    keys = kjt.keys()
    indices = _check_key_indices(indices, len(keys))
    device = kjt.device()
    if indices_tensor is None:
        indices_tensor = torch.tensor(indices, dtype=torch.int32, device=device)
    else:
        _check_indices_tensor(indices_tensor, indices)
    length_per_key = kjt.length_per_key()
    out_length_per_key = [length_per_key[i] for i in indices]
    total = sum(out_length_per_key)
    strides = kjt._stride_per_key_per_rank
    if strides is None:
        lengths_2d = kjt.lengths().view(len(keys), kjt.stride()) if keys else kjt.lengths().view(0, 0)
        out_lengths, out_values, out_weights = permute_2d_sparse_data(
            indices_tensor, lengths_2d, kjt.values(), kjt.weights_or_none(), total
        )
        out_lengths = out_lengths.reshape(-1)
    else:
        stride_per_key = kjt.stride_per_key()
        _, out_values, out_weights = permute_1d_sparse_data(
            indices_tensor,
            torch.tensor(length_per_key, dtype=torch.int64, device=device),
            kjt.values(),
            kjt.weights_or_none(),
            total,
        )
        _, out_lengths, _ = permute_1d_sparse_data(
            indices_tensor,
            torch.tensor(stride_per_key, dtype=torch.int64, device=device),
            kjt.lengths(),
            None,
            sum(stride_per_key[i] for i in indices),
        )
    return type(kjt)._trusted(
        keys=[keys[i] for i in indices],
        values=out_values,
        weights=out_weights,
        lengths=out_lengths,
        stride=kjt.stride(),
        strides=None if strides is None else [list(strides[i]) for i in indices],
        length_per_key=out_length_per_key,
    )


def split(kjt: KeyedJaggedTensor, segments: list[int]) -> list[KeyedJaggedTensor]:
    """Consecutive key groups; each part keeps the stride (and, for VBE, its keys' rows of strides)."""
    keys = kjt.keys()
    if not isinstance(segments, (list, tuple)):
        raise ValueError(f"segments must be a list of non-negative ints, got {segments!r}")
    segments = [check_int(s, f"segments[{i}]", 0) for i, s in enumerate(segments)]
    if sum(segments) != len(keys):
        raise ValueError(f"segments must sum to the number of keys ({len(keys)}), got {list(segments)}")
    offset_per_key = kjt.offset_per_key()
    lengths_offset_per_key = kjt.lengths_offset_per_key()
    length_per_key = kjt.length_per_key()
    strides = kjt._stride_per_key_per_rank
    values, weights, lengths = kjt.values(), kjt.weights_or_none(), kjt.lengths()
    parts: list[KeyedJaggedTensor] = []
    start = 0
    for segment in segments:
        end = start + segment
        if segment == len(keys):
            parts.append(kjt)
        else:
            v0, v1 = offset_per_key[start], offset_per_key[end]
            l0, l1 = lengths_offset_per_key[start], lengths_offset_per_key[end]
            parts.append(
                type(kjt)._trusted(
                    keys=keys[start:end],
                    values=values[v0:v1],
                    weights=None if weights is None else weights[v0:v1],
                    lengths=lengths[l0:l1],
                    stride=kjt.stride(),
                    strides=None if strides is None else [list(r) for r in strides[start:end]],
                    length_per_key=length_per_key[start:end],
                )
            )
        start = end
    return parts


def getitem(kjt: KeyedJaggedTensor, key: str) -> JaggedTensor:
    index = kjt._key_index(key)
    v0, v1 = kjt.offset_per_key()[index], kjt.offset_per_key()[index + 1]
    l0, l1 = kjt.lengths_offset_per_key()[index], kjt.lengths_offset_per_key()[index + 1]
    weights = kjt.weights_or_none()
    return _trusted_jt(kjt.values()[v0:v1], None if weights is None else weights[v0:v1], kjt.lengths()[l0:l1])


def to_dict(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    length_per_key = kjt.length_per_key()
    used = kjt.offset_per_key()[-1]  # values may carry a slack tail past the last bag
    values = kjt.values()[:used].split(length_per_key)
    lengths = kjt.lengths().split(kjt.stride_per_key())
    weights = kjt.weights_or_none()
    weights_split = [None] * len(values) if weights is None else weights[:used].split(length_per_key)
    return {key: _trusted_jt(v, w, n) for key, v, w, n in zip(kjt.keys(), values, weights_split, lengths, strict=True)}


def _trusted_jt(values: torch.Tensor, weights: torch.Tensor | None, lengths: torch.Tensor) -> JaggedTensor:
    jt = JaggedTensor.__new__(JaggedTensor)
    jt._values, jt._weights, jt._lengths, jt._offsets = values, weights, lengths, None
    return jt


def apply_to_tensors(
    kjt: KeyedJaggedTensor, move: Callable[[torch.Tensor], torch.Tensor], weights_dtype: torch.dtype | None = None
) -> KeyedJaggedTensor:
    """The same KJT with ``move`` applied to every tensor (device copies, pinning); metadata caches carried over."""
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = move(weights)
        if weights_dtype is not None:
            weights = weights.to(weights_dtype)
    inverse = kjt.inverse_indices_or_none()
    out = type(kjt)._trusted(
        keys=kjt.keys(),
        values=move(kjt.values()),
        weights=weights,
        lengths=move(kjt.lengths()),
        stride=kjt.stride(),
        strides=kjt._stride_per_key_per_rank,
        length_per_key=kjt.length_per_key_or_none(),
        inverse_indices=None if inverse is None else (inverse[0], move(inverse[1])),
    )
    if kjt.offsets_or_none() is not None:
        out._offsets = move(kjt.offsets_or_none())
    out._offset_per_key = kjt.offset_per_key_or_none()
    return out


def describe(kjt: KeyedJaggedTensor) -> str:
    """torchrec-style printout: one line per key with its bags (and weights)."""
    if not kjt.keys():
        return "KeyedJaggedTensor()"
    lines = []
    for key, jt in kjt.to_dict().items():
        bags = [b.tolist() for b in jt.to_dense()]
        text = f'    "{key}": {bags}'
        if jt.weights_or_none() is not None:
            text += f" weights {[w.tolist() for w in jt.to_dense_weights()]}"
        lines.append(text)
    return "KeyedJaggedTensor({\n" + ",\n".join(lines) + "\n})"


def is_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    if a.keys() != b.keys() or a.stride_per_key() != b.stride_per_key():
        return False
    if (a.weights_or_none() is None) != (b.weights_or_none() is None):
        return False
    same = torch.equal(a.lengths().to(torch.int64), b.lengths().to(torch.int64)) and torch.equal(a.values(), b.values())
    return same and (a.weights_or_none() is None or torch.equal(a.weights(), b.weights()))
