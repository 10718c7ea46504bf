"""``TritonQuantizedCommCodec``: the :class:`~tritonrec.dist.qcomm_protocol.QuantizedCommCodec` over tritonrec's
codec kernels (torchrec's ``FbgemmQuantizedCommCodec`` counterpart), and the ``CommType`` precisions.

Wire formats (byte layouts in each kernel module of :mod:`tritonrec.kernels.codecs`):

=========  ============  ==============================================  ====================
CommType   wire dtype    payload                                         bytes per 32 values
=========  ============  ==============================================  ====================
FP32       float32       as is                                           128
FP16/BF16  float16/bf16  ``x * loss_scale`` rounded                      64
FP8        uint8         rows of ``row_dim``: E4M3 (fwd) / E5M2 codes,   36 (row_dim 32)
                         fp32 power-of-two scale
INT8       uint8         rows of ``row_dim``: codes, fp32 scale, bias     40 (row_dim 32)
MX4        uint8         groups: packed E2M1 pairs, E8M0 exponent         17 (group 32)
=========  ============  ==============================================  ====================

Stochastic rounding is deterministic: call ``k`` of a codec (counted from 0, recorded in ``ctx.call_index``) uses
the stream ``derive_seed(seed, k)``, so a rerun with the same seed and call order reproduces every byte.
"""

from __future__ import annotations

from enum import Enum, unique

import torch

from tritonrec.dist.qcomm_protocol import MX_GROUP_SIZE_DEFAULT, ROW_DIM_DEFAULT, QuantizationContext, RoundingMode
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.checks import check_int, check_tensor
from tritonrec.kernels.codecs.formats import (
    check_nonfinite_policy,
    check_row_dim,
    check_seed,
    derive_seed,
    fp8_row_bytes,
    int8_row_bytes,
    mx4_group_bytes,
)
from tritonrec.kernels.codecs.fp8_rowwise import dequantize_fp8_rowwise, quantize_fp8_rowwise
from tritonrec.kernels.codecs.half import check_loss_scale, dequantize_half, quantize_half
from tritonrec.kernels.codecs.int8_rowwise import dequantize_int8_rowwise, quantize_int8_rowwise
from tritonrec.kernels.codecs.mx4 import dequantize_mx4, quantize_mx4


@unique
class CommType(Enum):
    """Wire precision of a comm direction (torchrec's names and values)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    MX4 = "mx4"

    def __str__(self) -> str:
        return self.value


ROWWISE_COMM_TYPES = (CommType.FP8, CommType.INT8, CommType.MX4)
_HALF_NAMES = {CommType.FP16: "fp16", CommType.BF16: "bf16"}
_WIRE_DTYPES = {CommType.FP32: torch.float32, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}
OUTPUT_COMM_TYPES = {CommType.FP32: torch.float32, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


def resolve_output_dtype(output_dtype: CommType | torch.dtype | None, name: str = "output_dtype") -> torch.dtype:
    """``None`` -> fp32; a ``CommType`` FP32/FP16/BF16 or the matching ``torch.dtype``."""
    if output_dtype is None:
        return torch.float32
    if isinstance(output_dtype, CommType):
        if output_dtype not in OUTPUT_COMM_TYPES:
            raise ValueError(f"{name} must be FP32, FP16 or BF16, got {name}={output_dtype!r}")
        return OUTPUT_COMM_TYPES[output_dtype]
    if isinstance(output_dtype, torch.dtype) and output_dtype in OUTPUT_COMM_TYPES.values():
        return output_dtype
    raise TypeError(
        f"{name} must be a CommType (FP32, FP16, BF16), one of their torch dtypes or None, got {output_dtype!r}"
    )


class TritonQuantizedCommCodec:
    """Encode/decode one comm direction in ``comm_precision``.

    Args:
        comm_precision: wire format.
        loss_scale: FP16/BF16 only: multiply before encoding, divide after decoding.
        row_dim: values per row (FP8, INT8; default 32) or per MX4 group (even, default 32). A context's
            ``row_dim`` / ``mx_group_size`` overrides it for that call.
        is_fwd: FP8 uses E4M3 when True, E5M2 (wider range for gradients) when False.
        rounding_mode: MX4 only: ``even``/``nearest`` (default) or ``stochastic``.
        output_dtype: dtype of ``decode``'s result (CommType FP32/FP16/BF16 or torch dtype; default fp32).
        stochastic_rounding: unbiased stochastic rounding for every lossy format.
        seed: base seed of the stochastic-rounding streams.
        nonfinite: ``"propagate"`` (NaN/Inf stay non-finite, see each format) or ``"raise"`` (checks the input,
            one device sync per encode).
        backend: kernel dispatch, as for every tritonrec op.
    """

    def __init__(
        self,
        comm_precision: CommType,
        loss_scale: float | None = None,
        row_dim: int | None = None,
        is_fwd: bool = True,
        rounding_mode: RoundingMode | int | None = None,
        output_dtype: CommType | torch.dtype | None = None,
        *,
        stochastic_rounding: bool = False,
        seed: int = 0,
        nonfinite: str = "propagate",
        backend: Backend = "auto",
    ) -> None:
        if not isinstance(comm_precision, CommType):
            raise TypeError(f"comm_precision must be a CommType, got {comm_precision!r}")
        if loss_scale is not None and comm_precision not in _HALF_NAMES:
            raise ValueError(f"loss_scale applies to FP16/BF16 only, got loss_scale={loss_scale} with {comm_precision}")
        if rounding_mode is not None:
            rounding_mode = RoundingMode(rounding_mode)
            if comm_precision != CommType.MX4:
                raise ValueError(f"rounding_mode applies to MX4 only, got rounding_mode={rounding_mode.name}")
            if rounding_mode not in (RoundingMode.even, RoundingMode.nearest, RoundingMode.stochastic):
                raise ValueError(
                    f"rounding_mode must be even, nearest or stochastic, got rounding_mode={rounding_mode.name} "
                    "(tritonrec always picks the smallest shared exponent that does not saturate)"
                )
        if row_dim is not None:
            check_row_dim(row_dim, "row_dim", even=comm_precision == CommType.MX4)
        self._precision = comm_precision
        self._loss_scale = check_loss_scale(loss_scale)
        default_rows = MX_GROUP_SIZE_DEFAULT if comm_precision == CommType.MX4 else ROW_DIM_DEFAULT
        self._row_dim = default_rows if row_dim is None else row_dim
        self._fp8_format = "e4m3" if is_fwd else "e5m2"
        self._rounding_mode = rounding_mode
        self._stochastic = bool(stochastic_rounding) or rounding_mode == RoundingMode.stochastic
        self._output_dtype = resolve_output_dtype(output_dtype)
        self._seed = check_seed(seed)
        self._nonfinite = check_nonfinite_policy(nonfinite)
        self._backend = backend
        self._calls = 0

    @property
    def comm_precision(self) -> CommType:
        return self._precision

    @property
    def row_dim(self) -> int:
        return self._row_dim

    @property
    def stochastic_rounding(self) -> bool:
        return self._stochastic

    @property
    def quantized_dtype(self) -> torch.dtype:
        return _WIRE_DTYPES.get(self._precision, torch.uint8)

    def __repr__(self) -> str:
        fp8 = f", fp8={self._fp8_format}" if self._precision == CommType.FP8 else ""
        return (
            f"TritonQuantizedCommCodec({self._precision}, row_dim={self._row_dim}{fp8}, loss_scale={self._loss_scale}, "
            f"stochastic_rounding={self._stochastic}, output_dtype={self._output_dtype})"
        )

    def create_context(self) -> QuantizationContext:
        return QuantizationContext(
            row_dim=self._row_dim,
            mx_group_size=self._row_dim if self._precision == CommType.MX4 else MX_GROUP_SIZE_DEFAULT,
            rounding_mode=self._rounding_mode if self._rounding_mode is not None else RoundingMode.even,
        )

    def rows_of(self, ctx: QuantizationContext | None) -> int:
        """Values per quantization row for this call (the context's setting wins over the codec's)."""
        if ctx is None:
            return self._row_dim
        if self._precision == CommType.MX4:
            return check_row_dim(ctx.mx_group_size, "ctx.mx_group_size", even=True)
        return check_row_dim(ctx.row_dim, "ctx.row_dim")

    def unit_bytes(self, rows: int) -> int:
        """Encoded bytes per row of ``rows`` values."""
        return {CommType.FP8: fp8_row_bytes, CommType.INT8: int8_row_bytes, CommType.MX4: mx4_group_bytes}[
            self._precision
        ](rows)

    def encode(self, input: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        """fp32 -> wire tensor: flat uint8 for row-wise formats (a 2-D input's rows zero-padded to whole rows),
        same-shape fp16/bf16 for the half formats."""
        check_tensor(input, "input", dtypes=(torch.float32,))
        call_index = self._calls
        self._calls += 1
        if ctx is not None:
            ctx.call_index = call_index
        if self._precision == CommType.FP32:
            return input
        seed = derive_seed(self._seed, call_index)
        options = {
            "stochastic_rounding": self._stochastic,
            "seed": seed,
            "nonfinite": self._nonfinite,
            "backend": self._backend,
        }
        if self._precision in _HALF_NAMES:
            return quantize_half(input, _HALF_NAMES[self._precision], loss_scale=self._loss_scale, **options)
        rows = self.rows_of(ctx)
        check_tensor(input, "input", ndim=(1, 2))
        if self._precision == CommType.FP8:
            encoded = quantize_fp8_rowwise(input, rows, self._fp8_format, **options)
        elif self._precision == CommType.INT8:
            encoded = quantize_int8_rowwise(input, rows, **options)
        else:
            encoded = quantize_mx4(input, rows, **options)
        if ctx is not None:
            ctx.row_dim_quant = self.unit_bytes(rows)
        return encoded.reshape(-1)

    def decode(self, input: torch.Tensor, ctx: QuantizationContext | None = None) -> torch.Tensor:
        """Wire tensor -> ``output_dtype`` values: flat for row-wise formats, padding columns included."""
        options = {"output_dtype": self._output_dtype, "backend": self._backend}
        if self._precision == CommType.FP32:
            check_tensor(input, "input", dtypes=(torch.float32,))
            return input.to(self._output_dtype)
        if self._precision in _HALF_NAMES:
            check_tensor(input, "input", dtypes=(_WIRE_DTYPES[self._precision],))
            return dequantize_half(input, loss_scale=self._loss_scale, **options)
        check_tensor(input, "input", ndim=(1, 2), dtypes=(torch.uint8,))
        flat = input.reshape(-1)
        rows = self.rows_of(ctx)
        if self._precision == CommType.FP8:
            return dequantize_fp8_rowwise(flat, rows, self._fp8_format, **options)
        if self._precision == CommType.INT8:
            return dequantize_int8_rowwise(flat, rows, **options)
        return dequantize_mx4(flat, rows, **options)

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        """Wire length of ``input_len`` values; row-wise formats need whole rows (pad with :meth:`padded_size`)."""
        input_len = check_int(input_len, "input_len", 0)
        if self._precision not in ROWWISE_COMM_TYPES:
            return input_len
        rows = self.rows_of(ctx)
        if input_len % rows:
            raise ValueError(
                f"input_len={input_len} is not a multiple of the {self._precision} row size {rows}: pad each "
                "rank's slice to whole rows (padded_size gives the widths) before sizing the splits"
            )
        if ctx is not None:
            ctx.row_dim_quant = self.unit_bytes(rows)
        return input_len // rows * self.unit_bytes(rows)

    def padded_size(
        self, input: torch.Tensor, dim_per_rank: list[int], my_rank: int, ctx: QuantizationContext | None
    ) -> tuple[int, int]:
        """``(padded_dim_sum, padding_size)`` for this rank's ``[B, dim_per_rank[my_rank]]`` input; row-wise formats
        round every rank's width up to whole rows and record the widths in ``ctx.padded_dim_sum_per_rank``."""
        check_tensor(input, "input", ndim=(1, 2))
        if not isinstance(dim_per_rank, (list, tuple)):
            raise ValueError(f"dim_per_rank must be a list of non-negative ints, got dim_per_rank={dim_per_rank!r}")
        dim_per_rank = [check_int(d, f"dim_per_rank[{i}]", 0) for i, d in enumerate(dim_per_rank)]
        ranks = len(dim_per_rank)
        my_rank = check_int(my_rank, "my_rank", 0, ranks - 1, what=f"an int in [0, {ranks})")
        if input.dim() == 1:
            return input.shape[0], 0
        if input.shape[1] != dim_per_rank[my_rank]:
            raise ValueError(
                f"input has {input.shape[1]} columns but dim_per_rank[{my_rank}] = {dim_per_rank[my_rank]}"
            )
        if self._precision not in ROWWISE_COMM_TYPES:
            return input.shape[1], 0
        rows = self.rows_of(ctx)
        padded = [-(-d // rows) * rows for d in dim_per_rank]
        if ctx is not None:
            ctx.padded_dim_sum_per_rank = padded
        return padded[my_rank], padded[my_rank] - dim_per_rank[my_rank]

    def unpad(
        self, decoded: torch.Tensor, shape: torch.Size | tuple[int, ...], ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """``decode(encode(x))`` reshaped back to ``shape = x.shape`` (drops a 2-D input's row padding)."""
        if self._precision not in ROWWISE_COMM_TYPES or len(shape) != 2:
            return decoded.reshape(shape)
        rows = self.rows_of(ctx)
        batch, cols = shape
        return decoded.reshape(batch, -(-cols // rows) * rows)[:, :cols]


__all__ = ["ROWWISE_COMM_TYPES", "CommType", "TritonQuantizedCommCodec", "resolve_output_dtype"]
