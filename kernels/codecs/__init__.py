"""Quantized-communication codecs: Triton encode/decode kernels with torch twins.

One module per format, each with its byte layout in the docstring: :mod:`.half` (FP16/BF16), :mod:`.fp8_rowwise`
(E4M3/E5M2 rows with a power-of-two scale), :mod:`.int8_rowwise` (FBGEMM's fused 8-bit rows), :mod:`.mx4` (OCP
MXFP4). :mod:`.bits` / :mod:`.bits_reference` hold the shared integer rounding; :mod:`.formats` the format constants,
row sizes and checks. The comm-op protocol on top lives in :mod:`tritonrec.dist.qcomm_codec`.
"""

from tritonrec.kernels.codecs.formats import (
    BF16,
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    MiniFloat,
    NonFinitePolicy,
    derive_seed,
    fp8_row_bytes,
    int8_row_bytes,
    mx4_group_bytes,
)
from tritonrec.kernels.codecs.fp8_rowwise import (
    dequantize_fp8_rowwise,
    dequantize_fp8_rowwise_reference,
    quantize_fp8_rowwise,
    quantize_fp8_rowwise_reference,
)
from tritonrec.kernels.codecs.half import (
    dequantize_half,
    dequantize_half_reference,
    quantize_half,
    quantize_half_reference,
)
from tritonrec.kernels.codecs.int8_rowwise import (
    dequantize_int8_rowwise,
    dequantize_int8_rowwise_reference,
    quantize_int8_rowwise,
    quantize_int8_rowwise_reference,
)
from tritonrec.kernels.codecs.mx4 import dequantize_mx4, dequantize_mx4_reference, quantize_mx4, quantize_mx4_reference

__all__ = [
    "BF16",
    "FP4_E2M1",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP16",
    "MiniFloat",
    "NonFinitePolicy",
    "dequantize_fp8_rowwise",
    "dequantize_fp8_rowwise_reference",
    "dequantize_half",
    "dequantize_half_reference",
    "dequantize_int8_rowwise",
    "dequantize_int8_rowwise_reference",
    "dequantize_mx4",
    "dequantize_mx4_reference",
    "derive_seed",
    "fp8_row_bytes",
    "int8_row_bytes",
    "mx4_group_bytes",
    "quantize_fp8_rowwise",
    "quantize_fp8_rowwise_reference",
    "quantize_half",
    "quantize_half_reference",
    "quantize_int8_rowwise",
    "quantize_int8_rowwise_reference",
    "quantize_mx4",
    "quantize_mx4_reference",
]
