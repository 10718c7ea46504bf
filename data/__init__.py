"""Sparse batch types (torchrec names and semantics), datasets, batchers and packing."""

from tritonrec.data import _pytree
from tritonrec.data._validation import UnknownKeyError
from tritonrec.data.batched_data_dict import (
    BatchedDataDict,
    DynamicBatchingArgs,
    SequencePackingArgs,
    SlicedDataDict,
)
from tritonrec.data.jagged_tensor import JaggedTensor, jt_is_equal
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor, kjt_is_equal
from tritonrec.data.keyed_tensor import KeyedTensor

_pytree.register()

__all__ = [
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "SequencePackingArgs",
    "SlicedDataDict",
    "UnknownKeyError",
    "jt_is_equal",
    "kjt_is_equal",
]
