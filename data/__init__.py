"""Sparse batch types (torchrec names and semantics), datasets, batchers and packing."""

from tritonrec.data import _pytree
from tritonrec.data._validation import UnknownKeyError
from tritonrec.data.batch import Batch
from tritonrec.data.batched_data_dict import (
    BatchedDataDict,
    DynamicBatchingArgs,
    SequencePackingArgs,
    SlicedDataDict,
)
from tritonrec.data.batcher import Batcher
from tritonrec.data.criteo import CriteoTSVSource, MalformedLineError
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy
from tritonrec.data.elements import BatchSpec, ElementSource, ElementSpec, RecElement, TensorSpec
from tritonrec.data.jagged_tensor import JaggedTensor, jt_is_equal
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor, kjt_is_equal
from tritonrec.data.keyed_tensor import KeyedTensor
from tritonrec.data.synthetic import SyntheticRecSource

_pytree.register()

__all__ = [
    "Batch",
    "BatchSpec",
    "BatchedDataDict",
    "Batcher",
    "CriteoNPYSource",
    "CriteoTSVSource",
    "DynamicBatchingArgs",
    "ElementSource",
    "ElementSpec",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "MalformedLineError",
    "RecElement",
    "SequencePackingArgs",
    "SlicedDataDict",
    "SyntheticRecSource",
    "TensorSpec",
    "UnknownKeyError",
    "criteo_tsv_to_npy",
    "jt_is_equal",
    "kjt_is_equal",
]
