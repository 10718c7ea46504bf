"""Table-batched embedding lookups (FBGEMM TBE's role): pooled and sequence forward, deterministic backward with
fused optimizers, fp16/bf16 storage with stochastic rounding, and inference lookups on row-wise INT8/INT4/INT2 or
FP16/FP32 byte tables (torchrec's quantized EBC storage).

Every op takes a :class:`TableBatchedLayout` (tables packed into one flat buffer, features mapped to tables) and a
KJT's flat tensors; each kernel module holds its Triton kernel(s), launcher and ``*_reference`` torch twin.
"""

from tritonrec.kernels.embedding.fused_update import fused_update_reference, fused_update_triton
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan, build_row_gradient_plan
from tritonrec.kernels.embedding.layout import BoundsCheckMode, PoolingMode, TableBatchedLayout, TableSpec
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState, OptimType, create_fused_optimizer_state
from tritonrec.kernels.embedding.pooled import pooled_embedding_lookup
from tritonrec.kernels.embedding.pooled_forward import pooled_forward_reference, pooled_forward_triton
from tritonrec.kernels.embedding.quantized import (
    QuantizedTables,
    dequantize_rowwise,
    quantize_rowwise,
    quantized_pooled_lookup,
    quantized_pooled_lookup_reference,
)
from tritonrec.kernels.embedding.rounding import round_fp32_to_storage_reference
from tritonrec.kernels.embedding.sequence import (
    sequence_embedding_lookup,
    sequence_forward_reference,
    sequence_forward_triton,
    split_sequence_output,
)

__all__ = [
    "BoundsCheckMode",
    "FusedOptimizerState",
    "OptimType",
    "PoolingMode",
    "QuantizedTables",
    "RowGradientPlan",
    "TableBatchedLayout",
    "TableSpec",
    "build_row_gradient_plan",
    "create_fused_optimizer_state",
    "dequantize_rowwise",
    "fused_update_reference",
    "fused_update_triton",
    "pooled_embedding_lookup",
    "pooled_forward_reference",
    "pooled_forward_triton",
    "quantize_rowwise",
    "quantized_pooled_lookup",
    "quantized_pooled_lookup_reference",
    "round_fp32_to_storage_reference",
    "sequence_embedding_lookup",
    "sequence_forward_reference",
    "sequence_forward_triton",
    "split_sequence_output",
]
