"""``JaggedTensor``: one feature's variable-length bags (torchrec semantics).

``values [N, *]`` holds the bags back to back; ``lengths [B]`` or ``offsets [B + 1]`` (either, derived lazily from the
other) say where each bag starts. Optional ``weights [N]`` travel with the values.

Example (torchrec's)::

    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    jt = JaggedTensor(values=values, offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    jt.to_dense()                       # [[1, 2], [], [3], [4], [5], [6, 7, 8]]
    jt.to_padded_dense(desired_length=2, padding_value=10.)   # [[1, 2], [10, 10], [3, 10], [4, 10], [5, 10], [6, 7]]
"""

from __future__ import annotations

import torch

from tritonrec.data import _jagged_storage
from tritonrec.data._jagged_parts import JaggedParts
from tritonrec.data._validation import check_jagged_parts, complete_empty_offsets, normalise_index_tensor
from tritonrec.kernels import jagged_to_padded_dense
from tritonrec.kernels.checks import check_int


class JaggedTensor(JaggedParts):
    """An (optionally weighted) jagged tensor: ``values [N, *]``, ``lengths [B]`` / ``offsets [B + 1]``."""

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        lengths = normalise_index_tensor(lengths, "lengths")
        offsets = normalise_index_tensor(offsets, "offsets")
        check_jagged_parts(values, weights, lengths, offsets)
        offsets = complete_empty_offsets(offsets)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    # ----------------------------------------------------------------------------------------------- constructors
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """No bags at all (B = 0)."""
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def empty_like(jt: JaggedTensor, device: torch.device | str | None = None) -> JaggedTensor:
        """Without ``device``: no bags, ``jt``'s dtypes and device. With ``device``: uninitialised tensors of
        ``jt``'s shapes there, to :meth:`copy_` into."""
        return _empty_like(jt, device)

    @staticmethod
    def from_dense(values: list[torch.Tensor], weights: list[torch.Tensor] | None = None) -> JaggedTensor:
        """One tensor per bag (``B`` = ``len(values)``); bag ``b`` is ``values[b]``."""
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"values must be a list of tensors, got {type(values).__name__}")
        if weights is not None and len(weights) != len(values):
            raise ValueError(f"weights must have one tensor per bag ({len(values)}), got {len(weights)}")
        if not values:
            return JaggedTensor.empty(is_weighted=weights is not None)
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int32, device=values[0].device)
        return JaggedTensor(
            values=torch.cat(list(values)),
            weights=None if weights is None else torch.cat(list(weights)),
            lengths=lengths,
        )

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> JaggedTensor:
        """``values [B, N, *]`` padded, ``lengths [B]``: keep the first ``lengths[b]`` entries of row ``b``."""
        return _from_dense_lengths(values, lengths, weights)

    # ------------------------------------------------------------------------------------------------ conversions
    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag (views into ``values``)."""
        sizes = self.lengths().tolist()
        return list(self._values[: sum(sizes)].split(sizes))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        if self._weights is None:
            return None
        sizes = self.lengths().tolist()
        return list(self._weights[: sum(sizes)].split(sizes))

    def _padded(self, source: torch.Tensor, desired_length: int | None, padding_value: float) -> torch.Tensor:
        lengths = self.lengths()
        if desired_length is None:
            desired_length = int(lengths.max().item()) if lengths.numel() else 0
        else:
            desired_length = check_int(desired_length, "desired_length", 0, what="a non-negative int or None")
        return jagged_to_padded_dense(source, self.offsets(), desired_length, padding_value)

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[B, L, *]`` with ``L`` = ``desired_length`` or the longest bag; longer bags keep their first ``L``."""
        return self._padded(self._values, desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        if self._weights is None:
            return None
        return self._padded(self._weights, desired_length, padding_value)

    # ---------------------------------------------------------------------------------------------------- movement
    def copy_(self, jt: JaggedTensor, non_blocking: bool = False) -> JaggedTensor:
        """Copy ``jt``'s values, weights, lengths and offsets into this one's tensors (equal shapes), in place."""
        _jagged_storage.copy_parts_(self, jt, non_blocking)
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        out = JaggedTensor.__new__(JaggedTensor)
        out._values, out._weights = move(self._values), move(self._weights)
        out._lengths, out._offsets = move(self._lengths), move(self._offsets)
        return out

    def pin_memory(self) -> JaggedTensor:
        pin = lambda t: None if t is None else t.pin_memory()
        out = JaggedTensor.__new__(JaggedTensor)
        out._values, out._weights = pin(self._values), pin(self._weights)
        out._lengths, out._offsets = pin(self._lengths), pin(self._offsets)
        return out

    def __repr__(self) -> str:
        bags = [b.tolist() for b in self.to_dense()]
        weights = "" if self._weights is None else f", weights={[w.tolist() for w in self.to_dense_weights()]}"
        return f"JaggedTensor({bags}{weights})"


def jt_is_equal(a: JaggedTensor, b: JaggedTensor) -> bool:
    """Same bags, same values and weights (exact)."""
    return _jt_is_equal(a, b)


# Module-level and registered with ``torch.fx.wrap``: under a symbolic trace each is one ``call_function`` node whose
# checks run when the graph runs (tracing through them would branch on Proxies).
@torch.fx.wrap
def _from_dense_lengths(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> JaggedTensor:
    if values.dim() < 2:
        raise ValueError(f"values must be [B, N, *] (at least 2-D), got shape {tuple(values.shape)}")
    lengths = normalise_index_tensor(lengths, "lengths")
    if lengths.shape != values.shape[:1]:
        raise ValueError(f"lengths must have shape [{values.shape[0]}], got {tuple(lengths.shape)}")
    if weights is not None and weights.shape != values.shape[:2]:
        raise ValueError(f"weights must have shape {tuple(values.shape[:2])} ([B, N]), got {tuple(weights.shape)}")
    keep = torch.arange(values.shape[1], device=values.device) < lengths[:, None]
    if bool((lengths > values.shape[1]).any()):
        bad = int(lengths.max().item())
        raise ValueError(f"lengths may not exceed the padded length {values.shape[1]}, got {bad}")
    return JaggedTensor(values=values[keep], weights=None if weights is None else weights[keep], lengths=lengths)


@torch.fx.wrap
def _empty_like(jt: JaggedTensor, device: torch.device | str | None) -> JaggedTensor:
    return _jagged_storage.jt_empty_like(jt, device)


@torch.fx.wrap
def _jt_is_equal(a: JaggedTensor, b: JaggedTensor) -> bool:
    if (a.weights_or_none() is None) != (b.weights_or_none() is None):
        return False
    same = torch.equal(a.lengths().to(torch.int64), b.lengths().to(torch.int64)) and torch.equal(a.values(), b.values())
    return same and (a.weights_or_none() is None or torch.equal(a.weights(), b.weights()))
