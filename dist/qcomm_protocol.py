"""The seam between comm ops and quantization: torchrec's ``QuantizedCommCodec`` protocol and its companions.

A comm op that receives ``codecs: QuantizedCommCodecs | None`` does, per direction (``codecs.forward`` on the way
out, ``codecs.backward`` for gradients)::

    ctx = codec.create_context()
    padded_dim, padding = codec.padded_size(input_2d, dim_sum_per_rank, my_rank, ctx)   # pooled a2a only
    wire = codec.encode(input_2d if padding else input_2d.view(-1), ctx)                # dtype codec.quantized_dtype
    splits = [codec.calc_quantized_size(n, ctx) for n in values_per_peer]               # wire split sizes
    received = collective(wire, splits)
    values = codec.decode(received, ctx)                                                # flat, padded rows

Contract (tested for every codec and format):

* ``encode`` of a 2-D ``[B, D]`` tensor zero-pads each row to ``ctx.padded_dim_sum_per_rank``-style widths
  (a multiple of the codec's row size) so quantization rows never straddle a rank boundary; a 1-D tensor must hold
  whole rows. Row-wise encodings are flat; FP16/BF16 keep the input's shape.
* With nearest-even rounding, ``encode(cat(per-rank padded slices)) == cat(encode(per-rank slices))`` byte for byte,
  and ``calc_quantized_size(n)`` is the encoded length of ``n`` values, so splits computed independently by sender
  and receiver agree. (Stochastic rounding draws per position, so its bytes depend on where a slice sits.)
* ``decode`` returns ``calc``-consistent flat values, padding columns included: the caller reshapes rank ``r``'s
  part to ``[B_r, padded_dim_sum_per_rank[r]]`` and keeps the first ``dim_sum_per_rank[r]`` columns.
  ``padded_size`` records those widths in ``ctx.padded_dim_sum_per_rank``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, IntEnum, unique
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

ROW_DIM_DEFAULT = 32
MX_GROUP_SIZE_DEFAULT = 32


@unique
class CommOp(Enum):
    """Comm ops that can carry quantized payloads; their ``name`` keys a codecs registry (as in torchrec)."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"
    ALL_GATHER = "all_gather"


class RoundingMode(IntEnum):
    """FBGEMM's MX4 rounding modes (same names and values, so torchrec configs carry over). tritonrec supports
    ``even`` / ``nearest`` (nearest-even elements, smallest non-saturating shared exponent) and ``stochastic``."""

    nearest = 0
    floor = 1
    even = 2
    stochastic = 3
    ceil = 4


@dataclass
class QuantizationContext:
    """Per-call state shared by one encode and its matching decode (create one per collective call).

    ``row_dim`` / ``mx_group_size``: values per quantization row (FP8, INT8) or MX4 group; ``row_dim_quant``: bytes
    per encoded row, set by ``encode``/``calc_quantized_size``; ``padded_dim_sum_per_rank``: set by ``padded_size``.
    Ours: ``call_index`` is the stochastic-rounding counter value the last ``encode`` used (its bytes are a pure
    function of the codec's seed, this index and the input); ``feedback_key`` names the call site whose residual an
    :class:`~tritonrec.dist.error_feedback.ErrorFeedbackCodec` carries (default: keyed by input shape).
    """

    row_dim: int = ROW_DIM_DEFAULT
    row_dim_quant: int = -1
    mx_group_size: int = MX_GROUP_SIZE_DEFAULT
    rounding_mode: RoundingMode | None = RoundingMode.even
    padded_dim_sum_per_rank: list[int] | None = None
    call_index: int | None = None
    feedback_key: Hashable | None = field(default=None)


QuantizationContextT = TypeVar("QuantizationContextT")


@runtime_checkable
class QuantizedCommCodec(Protocol[QuantizationContextT]):
    """Quantizes (or casts) the tensors of collective calls; see the module docstring for the contract."""

    def encode(self, input: torch.Tensor, ctx: QuantizationContextT | None = None) -> torch.Tensor: ...

    def decode(self, input: torch.Tensor, ctx: QuantizationContextT | None = None) -> torch.Tensor: ...

    @property
    def quantized_dtype(self) -> torch.dtype:
        """dtype of ``encode``'s result."""
        ...

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContextT | None = None) -> int:
        """Encoded length of ``input_len`` input values."""
        ...

    def create_context(self) -> QuantizationContextT | None: ...

    def padded_size(
        self, input: torch.Tensor, dim_per_rank: list[int], my_rank: int, ctx: QuantizationContextT | None
    ) -> tuple[int, int]:
        """``(padded_dim_sum, padding_size)`` of this rank's ``[B, dim_per_rank[my_rank]]`` input."""
        ...


class NoOpQuantizedCommCodec(Generic[QuantizationContextT]):
    """Sends fp32 as is (torchrec's default codec)."""

    def encode(self, input: torch.Tensor, ctx: QuantizationContextT | None = None) -> torch.Tensor:
        return input

    def decode(self, input: torch.Tensor, ctx: QuantizationContextT | None = None) -> torch.Tensor:
        return input

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float32

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContextT | None = None) -> int:
        return input_len

    def create_context(self) -> QuantizationContextT | None:
        return None

    def padded_size(
        self, input: torch.Tensor, dim_per_rank: list[int], my_rank: int, ctx: QuantizationContextT | None
    ) -> tuple[int, int]:
        return (input.shape[0] if input.dim() == 1 else input.shape[1]), 0


@dataclass
class QuantizedCommCodecs:
    """The codecs of one comm op: ``forward`` for its output, ``backward`` for the gradients."""

    forward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)


__all__ = [
    "MX_GROUP_SIZE_DEFAULT",
    "ROW_DIM_DEFAULT",
    "CommOp",
    "NoOpQuantizedCommCodec",
    "QuantizationContext",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "RoundingMode",
]
