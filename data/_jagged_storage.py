"""Storage-level operations of the jagged types (torchrec's names): ``size_in_bytes``, ``clear_storage``, in-place
``copy_`` and ``empty_like`` onto a device.

Together they make torchrec's preallocated host-to-device copy: ``dst = empty_like(src, device)`` once (same shapes,
uninitialised), then ``dst.copy_(src, non_blocking=True)`` per batch; ``clear_storage`` releases a batch's memory
early while the Python object stays alive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tritonrec.data._jagged_parts import JaggedParts
    from tritonrec.data.jagged_tensor import JaggedTensor
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor

# torchrec stores a list-given ``stride_per_key_per_rank`` as an int32 tensor and counts its bytes
_STRIDE_ENTRY_BYTES = 4


def _stored(parts: JaggedParts) -> list[torch.Tensor]:
    """The tensors the object holds now: values, weights, lengths, offsets (a derived one once it is cached)."""
    return [t for t in (parts._values, parts._weights, parts._lengths, parts._offsets) if t is not None]


def _tensor_bytes(parts: JaggedParts) -> int:
    return sum(t.element_size() * t.numel() for t in _stored(parts))


def size_in_bytes(parts: JaggedParts) -> int:
    """Bytes of the stored tensors (``numel * element_size``, views counted by their own size, as torchrec does),
    plus, for a variable-stride KJT, its ``[T, W]`` stride table (int32 entries: torchrec's storage)."""
    strides = getattr(parts, "_stride_per_key_per_rank", None)
    return _tensor_bytes(parts) + (0 if strides is None else _STRIDE_ENTRY_BYTES * sum(len(row) for row in strides))


def clear_storage(kjt: KeyedJaggedTensor) -> int:
    """Resize the storage of values, lengths, offsets and weights to zero bytes; returns the bytes they spanned.

    The object stays alive but its tensors hold no memory any more (reading them afterwards is an error, as in
    torchrec): the point is to hand device memory back before the object itself goes away."""
    freed = _tensor_bytes(kjt)
    for t in _stored(kjt):
        t.untyped_storage().resize_(0)
    return freed


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str, non_blocking: bool) -> None:
    """``dst.copy_(src)`` for equal shapes only: ``copy_`` broadcasts, which would hide a batch of the wrong size."""
    if dst.shape != src.shape:
        raise ValueError(
            f"copy_: the source's {name} has shape {tuple(src.shape)} but this object's has {tuple(dst.shape)}; "
            "copy_ needs equal shapes (make the destination with empty_like(source, device))"
        )
    dst.copy_(src, non_blocking=non_blocking)


def _weighting(parts: JaggedParts) -> str:
    return "no weights" if parts._weights is None else "weights"


def copy_parts_(dst: JaggedParts, src: JaggedParts, non_blocking: bool) -> None:
    """Copy ``src``'s values, weights, lengths and offsets into ``dst``'s tensors, in place.

    Every tensor ``dst`` holds is filled (a lengths or offsets that ``src`` has not computed yet is derived from the
    other), so no stale part survives; the weighting must match."""
    if not isinstance(src, type(dst)):
        raise TypeError(f"copy_ takes a {type(dst).__name__} to copy from, got {type(src).__name__}")
    if (dst._weights is None) != (src._weights is None):
        raise ValueError(f"copy_: the source has {_weighting(src)} but this {type(dst).__name__} has {_weighting(dst)}")
    _copy_into(dst._values, src._values, "values", non_blocking)
    if dst._weights is not None:
        _copy_into(dst._weights, src._weights, "weights", non_blocking)
    if dst._lengths is not None:
        _copy_into(dst._lengths, src.lengths(), "lengths", non_blocking)
    if dst._offsets is not None:
        _copy_into(dst._offsets, src.offsets(), "offsets", non_blocking)


def kjt_copy_(dst: KeyedJaggedTensor, src: KeyedJaggedTensor, non_blocking: bool) -> KeyedJaggedTensor:
    """torchrec's ``KeyedJaggedTensor.copy_``: ``src``'s tensors copied into ``dst``'s (same keys and shapes), and
    ``src``'s host metadata (strides, per-key lengths and offsets) taken over."""
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor

    if not isinstance(src, KeyedJaggedTensor):
        raise TypeError(f"copy_ takes a KeyedJaggedTensor (kjt) to copy from, got {type(src).__name__}")
    if src.keys() != dst.keys():
        raise ValueError(f"copy_: kjt has keys {src.keys()} but this KeyedJaggedTensor has keys {dst.keys()}")
    inverse_dst, inverse_src = dst._inverse_indices, src._inverse_indices
    if inverse_dst is not None and inverse_src is not None and inverse_dst[1].shape != inverse_src[1].shape:
        raise ValueError(
            f"copy_: kjt's inverse_indices have shape {tuple(inverse_src[1].shape)} but this KeyedJaggedTensor's "
            f"have {tuple(inverse_dst[1].shape)}"
        )
    copy_parts_(dst, src, non_blocking)
    if inverse_dst is not None and inverse_src is not None:
        inverse_dst[1].copy_(inverse_src[1], non_blocking=non_blocking)
        dst._inverse_indices = (inverse_src[0], inverse_dst[1])
    dst._stride = src._stride
    strides = src._stride_per_key_per_rank
    dst._stride_per_key_per_rank = None if strides is None else [list(row) for row in strides]
    dst._stride_per_key = src._stride_per_key
    dst._length_per_key = src._length_per_key
    dst._offset_per_key = src._offset_per_key
    dst._index_per_key = src._index_per_key
    dst._jt_dict = None  # torchrec takes src's views over; ours are rebuilt from dst's own tensors on demand
    return dst


def _check_device(device: object) -> torch.device:
    try:
        return torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from error


def _like(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else torch.empty_like(t, device=device)


def jt_empty_like(jt: JaggedTensor, device: torch.device | str | None) -> JaggedTensor:
    """torchrec's ``JaggedTensor.empty_like``: without ``device``, no bags with ``jt``'s dtypes on its device; with
    ``device``, uninitialised tensors of ``jt``'s shapes there (the destination of a later :meth:`copy_`)."""
    from tritonrec.data.jagged_tensor import JaggedTensor

    if not isinstance(jt, JaggedTensor):
        raise TypeError(f"jt must be a JaggedTensor, got {type(jt).__name__}")
    weights = jt.weights_or_none()
    if device is None:
        return JaggedTensor.empty(
            is_weighted=weights is not None,
            device=jt.device(),
            values_dtype=jt.values().dtype,
            weights_dtype=None if weights is None else weights.dtype,
            lengths_dtype=jt.lengths().dtype,
        )
    device = _check_device(device)
    out = JaggedTensor.__new__(JaggedTensor)  # contents are uninitialised: nothing to validate
    out._values, out._weights = _like(jt._values, device), _like(jt._weights, device)
    out._lengths, out._offsets = _like(jt._lengths, device), _like(jt._offsets, device)
    return out


def kjt_empty_like_device(kjt: KeyedJaggedTensor, device: object) -> KeyedJaggedTensor:
    """``KeyedJaggedTensor.empty_like(kjt, device)``: ``kjt``'s keys, strides and per-key metadata with uninitialised
    tensors of its shapes on ``device``."""
    device = _check_device(device)
    inverse = kjt._inverse_indices
    out = type(kjt)._trusted(
        keys=kjt.keys(),
        values=_like(kjt._values, device),
        weights=_like(kjt._weights, device),
        lengths=_like(kjt._lengths, device),
        stride=kjt.stride(),
        strides=kjt._stride_per_key_per_rank,
        length_per_key=kjt._length_per_key,
        inverse_indices=None if inverse is None else (inverse[0], _like(inverse[1], device)),
    )
    out._offsets = _like(kjt._offsets, device)
    out._offset_per_key = kjt._offset_per_key
    out._stride_per_key = kjt._stride_per_key
    return out
