"""One recsys sample before batching, the specs that describe samples and batches, and the source protocol.

A :class:`RecElement` holds one sample's dense features ``[Dd]``, the ids of all its sparse features back to back
(feature after feature, in the spec's key order) with one bag length per feature ``[F]``, and its label. The flat
layout keeps a sample to three small arrays, so sources yield elements cheaply and the Batcher collates a batch with a
handful of vectorised numpy calls. An :class:`~tritonrec.data.element_chunk.ElementChunk` holds many samples
stacked: the built-in sources produce chunks (a vectorised parse or draw), and the Batcher collates straight from
them without one Python object per sample.

Sources (synthetic, Criteo TSV, Criteo npy) follow :class:`ElementSource`: ``iter_from(position, epoch)`` starts at
any element without replaying the ones before it where the format allows, which is what makes mid-epoch resume exact
and cheap. Those that also have ``iter_chunks(position, epoch)``
(:class:`~tritonrec.data.element_chunk.ChunkSource`) stream the same elements as chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tritonrec.kernels.checks import check_int


@dataclass(frozen=True, slots=True)
class RecElement:
    """One sample: ``dense [Dd]`` float32, ``sparse_ids [sum(sparse_lengths)]`` int64 (feature after feature),
    ``sparse_lengths [F]`` (ids per feature; 0 is an empty bag) and a float ``label``."""

    dense: np.ndarray
    sparse_ids: np.ndarray
    sparse_lengths: np.ndarray
    label: float


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (the role of ``jax.ShapeDtypeStruct`` in datarax's specs)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ElementSpec:
    """What every element of a source looks like: ``dense_dim`` dense features and one bag per ``sparse_keys``."""

    dense_dim: int
    sparse_keys: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_dim", check_int(self.dense_dim, "dense_dim", 0))  # frozen
        keys = self.sparse_keys
        if not isinstance(keys, (tuple, list)) or not all(isinstance(k, str) and k for k in keys):
            raise TypeError(f"sparse_keys must be a sequence of non-empty str, got sparse_keys={keys!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"sparse_keys must be unique, got sparse_keys={list(keys)!r}")
        object.__setattr__(self, "sparse_keys", tuple(keys))

    @property
    def dense(self) -> TensorSpec:
        return TensorSpec((self.dense_dim,), torch.float32)

    @property
    def label(self) -> TensorSpec:
        return TensorSpec((), torch.float32)


@dataclass(frozen=True)
class BatchSpec:
    """What every :class:`~tritonrec.data.batch.Batch` of one Batcher looks like (padded batches included)."""

    batch_size: int
    dense_features: TensorSpec
    sparse_keys: tuple[str, ...]
    sparse_values_dtype: torch.dtype
    sparse_lengths_dtype: torch.dtype
    labels: TensorSpec
    valid_mask: TensorSpec


@runtime_checkable
class ElementSource(Protocol):
    """A replayable stream of :class:`RecElement` with random access to its start position.

    ``iter_from(position, epoch)`` yields the elements of pass ``epoch`` starting at element ``position`` (a source
    without per-epoch shuffling ignores ``epoch``). ``num_embeddings`` maps each sparse key to its id range: every id
    a source yields for key ``k`` lies in ``[0, num_embeddings[k])``.
    """

    element_spec: ElementSpec

    @property
    def num_embeddings(self) -> Mapping[str, int]: ...

    def iter_from(self, position: int = 0, epoch: int = 0) -> Iterator[RecElement]: ...


def check_position(position: object, epoch: object) -> None:
    """``position`` and ``epoch`` of :meth:`ElementSource.iter_from` are non-negative ints."""
    check_int(position, "position", 0)
    check_int(epoch, "epoch", 0)
