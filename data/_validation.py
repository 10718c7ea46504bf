"""Input checks for the sparse types. Metadata checks always run; value checks (which read tensor contents and sync a
GPU) follow :func:`tritonrec.kernels.checks.value_checks_enabled`."""

from __future__ import annotations

import torch

from tritonrec.kernels.checks import (
    check_lengths_total,
    check_offsets,
    check_same_device,
    check_tensor,
    value_checks_enabled,
)


class UnknownKeyError(KeyError, ValueError):
    """A key that the keyed tensor does not hold. A ``KeyError`` (mapping lookup, as in torchrec) and a
    ``ValueError`` (bad argument, as everywhere in tritonrec)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def normalise_index_tensor(t: torch.Tensor | None, name: str, flatten: bool = False) -> torch.Tensor | None:
    """``lengths``/``offsets`` as given, except that an empty tensor of any dtype becomes int32 (torchrec accepts
    ``torch.tensor([])``) and, with ``flatten``, a ``[T, B]`` tensor becomes ``[T * B]``."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.numel() == 0 and t.dtype not in (torch.int32, torch.int64):
        t = t.to(torch.int32)
    if flatten and t.dim() == 2:
        t = t.reshape(-1)
    check_tensor(t, name, ndim=1, integer=True)
    return t


def check_jagged_parts(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> None:
    """Values, weights, lengths and offsets describe the same jagged layout (``values [N, *]``).

    ``values`` may be longer than the bags need (torchrec and FBGEMM allow a slack tail, which every op ignores);
    shorter is an error.
    """
    check_tensor(values, "values")
    if values.dim() == 0:
        raise ValueError("values must have at least 1 dimension, got a scalar")
    if lengths is None and offsets is None:
        raise ValueError("lengths or offsets must be given (both are None)")
    if weights is not None:
        check_tensor(weights, "weights")
        if weights.dim() == 0 or weights.shape[0] != values.shape[0]:
            raise ValueError(
                f"weights must have one entry per value ({values.shape[0]}), got shape {tuple(weights.shape)}"
            )
    check_same_device(values=values, weights=weights, lengths=lengths, offsets=offsets)
    if lengths is not None and offsets is not None and offsets.numel() != lengths.numel() + 1 and lengths.numel():
        raise ValueError(f"offsets must have len(lengths) + 1 = {lengths.numel() + 1} entries, got {offsets.numel()}")
    if not value_checks_enabled():
        return
    num_values = values.shape[0]
    if lengths is not None:
        check_lengths_total(lengths, "lengths", num_values, allow_slack=True)
    if offsets is not None:
        if offsets.numel():
            check_offsets(offsets, "offsets", capacity=num_values)
        elif num_values:
            raise ValueError(f"offsets is empty (no bags) but values has {num_values} entries")
    if lengths is not None and offsets is not None and offsets.numel():
        derived = offsets[1:] - offsets[:-1]
        if not torch.equal(derived.to(torch.int64), lengths.to(torch.int64)):
            where = int((derived.to(torch.int64) != lengths.to(torch.int64)).nonzero()[0].item())
            raise ValueError(
                f"lengths and offsets disagree at bag {where}: lengths[{where}] = {lengths[where].item()} but "
                f"offsets[{where + 1}] - offsets[{where}] = {derived[where].item()}"
            )


def complete_empty_offsets(offsets: torch.Tensor | None) -> torch.Tensor | None:
    """Empty ``offsets`` describe no bags; store them as ``[0]`` (the complete cumsum of no lengths, which is what
    every consumer of offsets reads), so an empty batch behaves as one instead of failing on a missing leading 0."""
    if offsets is None or offsets.numel():
        return offsets
    return torch.zeros(1, dtype=offsets.dtype, device=offsets.device)
