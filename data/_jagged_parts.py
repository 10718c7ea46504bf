"""Accessors shared by :class:`JaggedTensor` and :class:`KeyedJaggedTensor`: both hold ``values [N, *]``, optional
``weights [N]``, and ``lengths``/``offsets`` of which either may be absent and is derived (and cached) on first use."""

from __future__ import annotations

import torch

from tritonrec.data import _jagged_storage
from tritonrec.data._fx import SparseTypeMeta
from tritonrec.kernels import lengths_to_offsets, offsets_to_lengths


class JaggedParts(metaclass=SparseTypeMeta):
    """Base of the jagged types; its metaclass makes their construction traceable by plain fx (see
    :mod:`tritonrec.data._fx`)."""

    _values: torch.Tensor
    _weights: torch.Tensor | None
    _lengths: torch.Tensor | None
    _offsets: torch.Tensor | None

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        """Bag lengths; computed from offsets (and cached) if only offsets were given."""
        if self._lengths is None:
            self._lengths = offsets_to_lengths(self._offsets) if self._offsets.numel() else self._offsets
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Bag offsets into values (one more than lengths); computed from lengths (and cached) if absent."""
        if self._offsets is None:
            self._offsets = lengths_to_offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes of the tensors held now (values, weights, lengths, offsets; a derived one once cached) and, for a
        variable-stride KJT, of its stride table (int32 entries, as torchrec stores it)."""
        return _jagged_storage.size_in_bytes(self)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)
