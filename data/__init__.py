"""Sparse batch types (torchrec names and semantics), datasets, batchers and packing, and loading across ranks
(rank-sharded sources, parallel workers, MultiHostDataLoadIterator, the hydrax-style batch cache).

``Batch`` is the model batch (:mod:`tritonrec.data.batch`); the batch cache's own batch class is exported as
``CacheBatch`` (its name in :mod:`tritonrec.data.batch_cache` is hydrax's ``Batch``)."""

from tritonrec.data import _pytree
from tritonrec.data._validation import UnknownKeyError
from tritonrec.data.batch import Batch
from tritonrec.data.batch_cache import Batch as CacheBatch
from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.batched_data_dict import (
    BatchedDataDict,
    DynamicBatchingArgs,
    SequencePackingArgs,
    SlicedDataDict,
)
from tritonrec.data.batcher import Batcher, BatcherConfig, kjt_from_id_matrix
from tritonrec.data.cache_layouts import KJTLayout
from tritonrec.data.criteo import CriteoTSVSource, MalformedLineError
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy
from tritonrec.data.element_chunk import ChunkSource, ElementChunk
from tritonrec.data.elements import BatchSpec, ElementSource, ElementSpec, RecElement, TensorSpec
from tritonrec.data.group_loader import GroupLoader
from tritonrec.data.jagged_tensor import JaggedTensor, jt_is_equal
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor, kjt_is_equal
from tritonrec.data.keyed_tensor import KeyedTensor, permute_multi_embedding, regroup_kts
from tritonrec.data.kjt_convert import ComputeJTDictToKJT, ComputeKJTToJTDict, flatten_kjt_list, unflatten_kjt_list
from tritonrec.data.loader import ShardedBatchDataset, make_rank_loader
from tritonrec.data.multihost import MultiHostDataLoadIterator
from tritonrec.data.random_dataset import RandomRecDataset
from tritonrec.data.sharding import Shard
from tritonrec.data.synthetic import SyntheticRecSource

_pytree.register()

__all__ = [
    "Batch",
    "BatchSpec",
    "BatchedDataDict",
    "Batcher",
    "BatcherConfig",
    "CacheBatch",
    "ChunkSource",
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "CriteoNPYSource",
    "CriteoTSVSource",
    "DataGroup",
    "DynamicBatchingArgs",
    "ElementChunk",
    "ElementSource",
    "ElementSpec",
    "GroupLoader",
    "JaggedTensor",
    "KJTLayout",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "MalformedLineError",
    "MultiHostDataLoadIterator",
    "RandomRecDataset",
    "RecElement",
    "SequencePackingArgs",
    "Shard",
    "ShardedBatchDataset",
    "SlicedDataDict",
    "SyntheticRecSource",
    "TensorSpec",
    "UnknownKeyError",
    "criteo_tsv_to_npy",
    "flatten_kjt_list",
    "jt_is_equal",
    "kjt_from_id_matrix",
    "kjt_is_equal",
    "make_rank_loader",
    "permute_multi_embedding",
    "regroup_kts",
    "unflatten_kjt_list",
]
