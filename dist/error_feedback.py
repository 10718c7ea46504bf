"""Error feedback for lossy comm codecs: each call site sends ``input + residual`` and keeps what that send lost.

With a deterministic codec, sending the same tensor ``x`` repeatedly loses the same error every time, so the sum of
``T`` decoded sends drifts from ``T * x`` by ``T`` times the error. Error feedback adds the previous call's residual
``r = (x + r_prev) - decode(encode(x + r_prev))`` before encoding, so the errors telescope: the sum of ``T`` decoded
sends is ``T * x + r_0 - r_T``, off by one residual however large ``T`` grows. This is the standard fix for biased
compressed gradients (1-bit SGD, EF-SGD) and works with every format.

Call sites: residuals are kept per ``ctx.feedback_key`` when the caller sets one (a comm op can use its module
path), else per (input shape, device). Two call sites that send same-shaped tensors through one codec must set
distinct keys or use distinct codecs (``get_qcomm_codecs`` builds fresh codecs per call). A residual whose shape
does not match the next input of its key (a smaller last batch) is dropped. Non-finite residual entries (from inputs
the codec propagated as NaN/Inf) are reset to zero so one bad step cannot poison every later send.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from tritonrec.dist.qcomm_codec import TritonQuantizedCommCodec
from tritonrec.dist.qcomm_protocol import QuantizationContext
from tritonrec.kernels.checks import check_tensor


class ErrorFeedbackCodec:
    """Wraps a :class:`TritonQuantizedCommCodec`; same protocol, ``encode`` adds and refreshes the residual."""

    def __init__(self, codec: TritonQuantizedCommCodec) -> None:
        if not isinstance(codec, TritonQuantizedCommCodec):
            raise TypeError(f"codec must be a TritonQuantizedCommCodec, got {type(codec).__name__}")
        self._codec = codec
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def codec(self) -> TritonQuantizedCommCodec:
        return self._codec

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._codec.quantized_dtype

    def __repr__(self) -> str:
        return f"ErrorFeedbackCodec({self._codec!r}, call_sites={len(self._residuals)})"

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual the next encode of call site ``key`` will add (``None`` before its first call)."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint or changing the model)."""
        self._residuals.clear()

    @staticmethod
    def call_site_key(input: torch.Tensor, ctx: QuantizationContext | None) -> Hashable:
        if ctx is not None and ctx.feedback_key is not None:
            return ctx.feedback_key
        return ("shape", tuple(input.shape), str(input.device))

    def encode(self, input: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        check_tensor(input, "input", dtypes=(torch.float32,))
        key = self.call_site_key(input, ctx)
        residual = self._residuals.get(key)
        corrected = input if residual is None or residual.shape != input.shape else input + residual
        encoded = self._codec.encode(corrected, ctx)
        decoded = self._codec.unpad(self._codec.decode(encoded, ctx), corrected.shape, ctx).to(torch.float32)
        lost = corrected - decoded
        self._residuals[key] = torch.where(torch.isfinite(lost), lost, 0.0)
        return encoded

    def decode(self, input: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        return self._codec.decode(input, ctx)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        return self._codec.calc_quantized_size(input_len, ctx)

    def create_context(self) -> QuantizationContext:
        return self._codec.create_context()

    def padded_size(
        self, input: torch.Tensor, dim_per_rank: list[int], my_rank: int, ctx: QuantizationContext | None
    ) -> tuple[int, int]:
        return self._codec.padded_size(input, dim_per_rank, my_rank, ctx)

    def unpad(
        self, decoded: torch.Tensor, shape: torch.Size | tuple[int, ...], ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        return self._codec.unpad(decoded, shape, ctx)


__all__ = ["ErrorFeedbackCodec"]
