"""Model parallelism on torch.distributed: collectives with awaitables and autograd, quantized comm codecs,
process-group helpers (sharding, planner and train pipelines build on these)."""

from tritonrec.dist.error_feedback import ErrorFeedbackCodec
from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry
from tritonrec.dist.qcomm_protocol import (
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizationContext,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    RoundingMode,
)

__all__ = [
    "CommOp",
    "CommType",
    "ErrorFeedbackCodec",
    "NoOpQuantizedCommCodec",
    "QCommsConfig",
    "QuantizationContext",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "RoundingMode",
    "TritonQuantizedCommCodec",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
]
