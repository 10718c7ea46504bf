"""Triton kernels with pure-torch twins. Each op lives in its own module (kernel, launcher, ``<op>_reference``,
public function); the public ops are re-exported here. See :mod:`tritonrec.kernels.backend` for dispatch."""

from tritonrec.kernels.backend import Backend, autotune_enabled, resolve_backend, set_autotune
from tritonrec.kernels.block_bucketize import block_bucketize_sparse_features, block_bucketize_sparse_features_reference
from tritonrec.kernels.checks import set_value_checks, value_checks_enabled
from tritonrec.kernels.codecs import (
    dequantize_fp8_rowwise,
    dequantize_fp8_rowwise_reference,
    dequantize_half,
    dequantize_half_reference,
    dequantize_int8_rowwise,
    dequantize_int8_rowwise_reference,
    dequantize_mx4,
    dequantize_mx4_reference,
    quantize_fp8_rowwise,
    quantize_fp8_rowwise_reference,
    quantize_half,
    quantize_half_reference,
    quantize_int8_rowwise,
    quantize_int8_rowwise_reference,
    quantize_mx4,
    quantize_mx4_reference,
)
from tritonrec.kernels.jagged_dense import (
    dense_to_jagged,
    dense_to_jagged_reference,
    jagged_to_padded_dense,
    jagged_to_padded_dense_reference,
)
from tritonrec.kernels.lengths_to_offsets import lengths_to_offsets, lengths_to_offsets_reference, offsets_to_lengths
from tritonrec.kernels.pack_sequences import (
    PackedSequences,
    pack_sequences,
    pack_sequences_reference,
    unpack_sequences,
    unpack_sequences_reference,
)
from tritonrec.kernels.packing_plan import PackingPlan, bin_assignment, make_packing_plan
from tritonrec.kernels.permute_sparse import (
    permute_1d_sparse_data,
    permute_2d_sparse_data,
    permute_2d_sparse_data_reference,
)

__all__ = [
    "Backend",
    "PackedSequences",
    "PackingPlan",
    "autotune_enabled",
    "bin_assignment",
    "block_bucketize_sparse_features",
    "block_bucketize_sparse_features_reference",
    "dense_to_jagged",
    "dense_to_jagged_reference",
    "dequantize_fp8_rowwise",
    "dequantize_fp8_rowwise_reference",
    "dequantize_half",
    "dequantize_half_reference",
    "dequantize_int8_rowwise",
    "dequantize_int8_rowwise_reference",
    "dequantize_mx4",
    "dequantize_mx4_reference",
    "jagged_to_padded_dense",
    "jagged_to_padded_dense_reference",
    "lengths_to_offsets",
    "lengths_to_offsets_reference",
    "make_packing_plan",
    "offsets_to_lengths",
    "pack_sequences",
    "pack_sequences_reference",
    "permute_1d_sparse_data",
    "permute_2d_sparse_data",
    "permute_2d_sparse_data_reference",
    "quantize_fp8_rowwise",
    "quantize_fp8_rowwise_reference",
    "quantize_half",
    "quantize_half_reference",
    "quantize_int8_rowwise",
    "quantize_int8_rowwise_reference",
    "quantize_mx4",
    "quantize_mx4_reference",
    "resolve_backend",
    "set_autotune",
    "set_value_checks",
    "unpack_sequences",
    "unpack_sequences_reference",
    "value_checks_enabled",
]
