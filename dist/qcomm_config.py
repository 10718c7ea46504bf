"""``QCommsConfig`` and the factories that turn it into codecs (torchrec's ``fbgemm_qcomm_codec`` API).

Fields and defaults follow torchrec; ours are ``output_dtype`` (decode dtype), ``stochastic_rounding``, ``seed``,
``error_feedback`` and ``nonfinite``. Differences from torchrec, on purpose:

* FP8 is always row-wise: ``fp8_quantize_dim=None`` means rows of 32 (torchrec then falls back to FBGEMM's
  unscaled FP8, which clips at 0.9375).
* A loss scale on a format other than FP16/BF16, or settings that contradict each other, raise instead of being
  dropped with a log line.
* No CPU fallback from BF16 to FP16: gloo carries bfloat16 in current torch (tested in tests/codecs).
* No reduce-scatter fallback from FP8/MX4 to FP16/BF16: tritonrec's quantized reduce-scatter sends the encoded
  blocks all-to-all and sums after decoding (``dist/comm_wire.py``), so every format works there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tritonrec.dist.error_feedback import ErrorFeedbackCodec
from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec, resolve_output_dtype
from tritonrec.dist.qcomm_protocol import (
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    RoundingMode,
)
from tritonrec.kernels.checks import check_int
from tritonrec.kernels.codecs.formats import check_nonfinite_policy, check_row_dim, check_seed, derive_seed
from tritonrec.kernels.codecs.half import check_loss_scale

logger = logging.getLogger(__name__)

DEFAULT_COMM_OPS = (
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
)


def _comm_type(value: object, name: str) -> CommType:
    """A CommType, or its string value (what a YAML config holds)."""
    if isinstance(value, CommType):
        return value
    if isinstance(value, str) and value.lower() in {t.value for t in CommType}:
        return CommType(value.lower())
    raise ValueError(f"{name} must be a CommType or one of {[t.value for t in CommType]}, got {name}={value!r}")


@dataclass
class QCommsConfig:
    """Quantization of the comm ops of sharded modules, per direction.

    Attributes:
        forward_precision / backward_precision: wire format of outputs / gradients.
        forward_loss_scale / backward_loss_scale: FP16/BF16 only: multiply on encode, divide on decode.
        fp8_quantize_dim / fp8_quantize_dim_bwd: FP8 row size (default 32; bwd defaults to the fwd value).
        fp8_bwd_uses_143: backward FP8 uses E4M3 instead of E5M2.
        mx4_quantize_dim / mx4_quantize_dim_bwd: MX4 group size (even, default 32; bwd defaults to fwd).
        mx4_rounding_mode: ``even`` (default), ``nearest`` (same as even) or ``stochastic``.
        output_dtype: dtype decode returns (FP32, FP16 or BF16; default FP32).
        stochastic_rounding: unbiased stochastic rounding for every lossy format, both directions.
        seed: base seed of the rounding streams (mixed with the rank, the comm op and the direction).
        error_feedback: wrap lossy codecs in :class:`ErrorFeedbackCodec`.
        nonfinite: ``"propagate"`` or ``"raise"`` (see each format).
    """

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False
    mx4_quantize_dim: int | None = None
    mx4_quantize_dim_bwd: int | None = None
    mx4_rounding_mode: RoundingMode | None = None
    output_dtype: CommType | None = None
    stochastic_rounding: bool = False
    seed: int = 0
    error_feedback: bool = False
    nonfinite: str = "propagate"

    def __post_init__(self) -> None:
        self.forward_precision = _comm_type(self.forward_precision, "forward_precision")
        self.backward_precision = _comm_type(self.backward_precision, "backward_precision")
        for direction, precision in (("forward", self.forward_precision), ("backward", self.backward_precision)):
            name = f"{direction}_loss_scale"
            if getattr(self, name) is not None and precision not in (CommType.FP16, CommType.BF16):
                raise ValueError(f"{name} applies to FP16/BF16 only, got {name}={getattr(self, name)} with {precision}")
            check_loss_scale(getattr(self, name))
        precisions = (self.forward_precision, self.backward_precision)
        for name, even, kind in (
            ("fp8_quantize_dim", False, CommType.FP8),
            ("fp8_quantize_dim_bwd", False, CommType.FP8),
            ("mx4_quantize_dim", True, CommType.MX4),
            ("mx4_quantize_dim_bwd", True, CommType.MX4),
        ):
            if getattr(self, name) is not None:
                check_row_dim(getattr(self, name), name, even=even)
                if kind not in precisions:
                    logger.warning(
                        "%s=%s has no effect: no %s precision is configured", name, getattr(self, name), kind
                    )
        if self.backward_precision == CommType.FP8 and self.fp8_quantize_dim_bwd is None:
            self.fp8_quantize_dim_bwd = self.fp8_quantize_dim
        if self.backward_precision == CommType.MX4 and self.mx4_quantize_dim_bwd is None:
            self.mx4_quantize_dim_bwd = self.mx4_quantize_dim
        if self.mx4_rounding_mode is not None:
            self.mx4_rounding_mode = RoundingMode(self.mx4_rounding_mode)
            if self.mx4_rounding_mode not in (RoundingMode.even, RoundingMode.nearest, RoundingMode.stochastic):
                raise ValueError(
                    f"mx4_rounding_mode must be even, nearest or stochastic, got {self.mx4_rounding_mode.name}"
                )
        if self.output_dtype is not None:
            self.output_dtype = _comm_type(self.output_dtype, "output_dtype")
            resolve_output_dtype(self.output_dtype)
        for name in ("stochastic_rounding", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        check_seed(self.seed)
        check_nonfinite_policy(self.nonfinite)


def _make_codec(config: QCommsConfig, forward: bool, seed: int) -> QuantizedCommCodec:
    precision = config.forward_precision if forward else config.backward_precision
    if precision == CommType.FP32:
        return NoOpQuantizedCommCodec()
    row_dim = None
    if precision == CommType.FP8:
        row_dim = config.fp8_quantize_dim if forward else config.fp8_quantize_dim_bwd
    elif precision == CommType.MX4:
        row_dim = config.mx4_quantize_dim if forward else config.mx4_quantize_dim_bwd
    codec = TritonQuantizedCommCodec(
        precision,
        loss_scale=config.forward_loss_scale if forward else config.backward_loss_scale,
        row_dim=row_dim,
        is_fwd=forward or bool(config.fp8_bwd_uses_143),
        rounding_mode=config.mx4_rounding_mode if precision == CommType.MX4 else None,
        output_dtype=config.output_dtype,
        stochastic_rounding=config.stochastic_rounding,
        seed=seed,
        nonfinite=config.nonfinite,
    )
    return ErrorFeedbackCodec(codec) if config.error_feedback else codec


def _default_rank(rank: int | None) -> int:
    if rank is not None:
        return check_int(rank, "rank", 0, what="a non-negative int or None")
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_qcomm_codecs(
    qcomms_config: QCommsConfig | None, *, rank: int | None = None, comm_op: CommOp | None = None
) -> QuantizedCommCodecs:
    """Fresh forward/backward codecs for one comm op (no-op codecs when ``qcomms_config`` is None).

    The stochastic-rounding seed of each codec mixes ``qcomms_config.seed`` with the rank (default: this process's
    rank when a process group is initialised), the comm op and the direction, so ranks round independently.
    """
    if qcomms_config is None:
        return QuantizedCommCodecs()
    if not isinstance(qcomms_config, QCommsConfig):
        raise TypeError(f"qcomms_config must be a QCommsConfig or None, got {type(qcomms_config).__name__}")
    rank = _default_rank(rank)
    op_index = 0 if comm_op is None else list(CommOp).index(comm_op) + 1
    return QuantizedCommCodecs(
        forward=_make_codec(qcomms_config, True, derive_seed(qcomms_config.seed, rank, op_index, 0)),
        backward=_make_codec(qcomms_config, False, derive_seed(qcomms_config.seed, rank, op_index, 1)),
    )


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig,
    comm_ops: list[CommOp] | None = None,
    device: torch.device | None = None,
    *,
    rank: int | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """``{comm_op.name: QuantizedCommCodecs}`` for ``comm_ops`` (default: torchrec's three), or None when both
    directions are FP32. Every comm op gets fresh codecs (their own call counters and error-feedback residuals).
    ``device`` is accepted for torchrec compatibility; every format runs on CPU/gloo and CUDA/NCCL alike."""
    if not isinstance(qcomms_config, QCommsConfig):
        raise TypeError(f"qcomms_config must be a QCommsConfig, got {type(qcomms_config).__name__}")
    if device is not None and not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or None, got {type(device).__name__}")
    if qcomms_config.forward_precision == CommType.FP32 and qcomms_config.backward_precision == CommType.FP32:
        return None
    ops = list(DEFAULT_COMM_OPS if comm_ops is None else comm_ops)
    for op in ops:
        if not isinstance(op, CommOp):
            raise TypeError(f"comm_ops must hold CommOp members, got {op!r}")
    return {op.name: get_qcomm_codecs(qcomms_config, rank=rank, comm_op=op) for op in ops}


__all__ = ["DEFAULT_COMM_OPS", "QCommsConfig", "get_qcomm_codecs", "get_qcomm_codecs_registry"]
