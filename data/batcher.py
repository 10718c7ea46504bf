"""``Batcher``: groups :class:`RecElement` samples into :class:`Batch` es (datarax's batcher semantics).

``process(elements, batch_size, drop_remainder=False)`` (also ``batcher(elements, batch_size)``) yields one Batch per
``batch_size`` elements. Without ``drop_remainder`` a short last batch is padded up to ``batch_size`` (zero dense
rows, empty bags, zero labels) and its ``valid_mask`` marks the real rows, so every step sees one shape; with it the
short batch is dropped, as in datarax. Sources that stream :class:`ElementChunk` s (``iter_chunks``: the built-in
synthetic and Criteo sources) are collated chunk-wise, without one Python object per sample; the batches are the same.

The Batcher remembers where its stream stands: ``get_state()`` returns ``{"epoch", "position", "batches"}`` (the
number of completed passes, the elements consumed by the batches yielded so far in this pass, and those batches).
``set_state(state)`` makes the next ``process`` call start at that element, so a job restored from a checkpoint sees
exactly the batches it would have seen. Sources with ``iter_from`` (:class:`ElementSource`) jump there directly; any
other iterable is replayed from its start and the consumed elements are skipped. A pass that runs to its end bumps
``epoch`` and resets ``position``, so ``while True: for batch in batcher.process(source, B)`` walks epochs.

Statistics (datarax's module statistics): a :class:`BatcherConfig` may carry a ``batch_stats_fn`` (``data ->
mapping``, run by :meth:`Batcher.compute_statistics`) or fixed ``precomputed_stats``; ``get_statistics`` returns
them (``None`` after ``reset_statistics`` until new ones are set or computed). ``copy(config=...)`` builds the same
Batcher under another config (same spec and stream position, statistics of the new config); ``clone()`` is an
independent duplicate, statistics included.
"""

from __future__ import annotations

import copy as copy_module
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tritonrec.data.batch import Batch
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import BatchSpec, ElementSource, ElementSpec, RecElement, TensorSpec
from tritonrec.data.key_major import KeyMajorRows
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.data.sharding import ChunkReader

_STATE_KEYS = ("epoch", "position", "batches")


def _check_batch_size(batch_size: object) -> int:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got batch_size={batch_size!r}")
    return batch_size


@dataclass(frozen=True)
class BatcherConfig:
    """datarax's module config: statistics computed by ``batch_stats_fn`` or given as ``precomputed_stats`` (not
    both)."""

    batch_stats_fn: Callable[[Any], Mapping[str, Any]] | None = None
    precomputed_stats: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.batch_stats_fn is not None and not callable(self.batch_stats_fn):
            raise TypeError(f"batch_stats_fn must be callable or None, got {type(self.batch_stats_fn).__name__}")
        if self.precomputed_stats is not None and not isinstance(self.precomputed_stats, Mapping):
            raise TypeError(f"precomputed_stats must be a mapping or None, got {type(self.precomputed_stats).__name__}")
        if self.batch_stats_fn is not None and self.precomputed_stats is not None:
            raise ValueError("batch_stats_fn and precomputed_stats are exclusive: give one or neither")


class Batcher:
    """Collates elements described by ``element_spec`` into padded, masked batches (see module docstring)."""

    def __init__(self, element_spec: ElementSpec, config: BatcherConfig | None = None) -> None:
        if not isinstance(element_spec, ElementSpec):
            raise TypeError(f"element_spec must be an ElementSpec, got {type(element_spec).__name__}")
        if config is not None and not isinstance(config, BatcherConfig):
            raise TypeError(f"config must be a BatcherConfig or None, got {type(config).__name__}")
        self.element_spec = element_spec
        self.config = config if config is not None else BatcherConfig()
        self._state = {"epoch": 0, "position": 0, "batches": 0}
        self._computed_stats: dict[str, Any] | None = None
        self._stats_reset = False

    # ------------------------------------------------------------------------------------------------------ state
    def get_state(self) -> dict[str, int]:
        """A copy of ``{"epoch", "position", "batches"}`` (plain ints: JSON- and torch.save-friendly)."""
        return dict(self._state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`get_state` result; the next :meth:`process` call resumes from it."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from get_state(), got {type(state).__name__}")
        if set(state) != set(_STATE_KEYS):
            raise ValueError(f"state must have exactly the keys {list(_STATE_KEYS)}, got {sorted(state)}")
        for key in _STATE_KEYS:
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state[{key!r}] must be a non-negative int, got {value!r}")
        self._state = {key: int(state[key]) for key in _STATE_KEYS}

    # ------------------------------------------------------------------------------------------------- statistics
    def compute_statistics(self, data: Any) -> dict[str, Any] | None:
        """Run ``config.batch_stats_fn(data)``, keep and return its result (``None`` without a batch_stats_fn)."""
        if self.config.batch_stats_fn is None:
            return None
        stats = self.config.batch_stats_fn(data)
        if not isinstance(stats, Mapping):
            raise TypeError(f"batch_stats_fn must return a mapping, got {type(stats).__name__}")
        self._computed_stats, self._stats_reset = dict(stats), False
        return dict(stats)

    def get_statistics(self) -> dict[str, Any] | None:
        """The last computed or set statistics, else the config's precomputed ones; ``None`` after a reset."""
        if self._stats_reset:
            return None
        if self._computed_stats is not None:  # set statistics win over the config's fixed ones
            return dict(self._computed_stats)
        precomputed = self.config.precomputed_stats
        return None if precomputed is None else dict(precomputed)

    def set_statistics(self, stats: Mapping[str, Any]) -> None:
        """Replace the statistics (also over precomputed ones) and clear a reset. The config stays as it was (it
        was replaced by one without the precomputed statistics before, so ``copy()`` lost them)."""
        if not isinstance(stats, Mapping):
            raise TypeError(f"stats must be a mapping, got {type(stats).__name__}")
        self._computed_stats, self._stats_reset = dict(stats), False

    def reset_statistics(self) -> None:
        """Forget every statistic: :meth:`get_statistics` returns ``None`` until new ones are computed or set."""
        self._computed_stats, self._stats_reset = None, True

    # ----------------------------------------------------------------------------------------------- duplication
    def copy(self, config: BatcherConfig | None = None) -> Batcher:
        """The same Batcher (spec, stream position) under ``config`` (default: this one's), with that config's
        statistics: computed or set statistics stay behind."""
        duplicate = Batcher(self.element_spec, self.config if config is None else config)
        duplicate.set_state(self.get_state())
        return duplicate

    def clone(self) -> Batcher:
        """An independent duplicate: same spec, stream position and statistics, and a config whose precomputed
        statistics are a deep copy (shared, an in-place change to a clone's statistic tensor changed the original's)."""
        config = self.config
        if config.precomputed_stats is not None:
            config = BatcherConfig(precomputed_stats=copy_module.deepcopy(dict(config.precomputed_stats)))
        duplicate = self.copy(config)
        duplicate._computed_stats = copy_module.deepcopy(self._computed_stats)
        duplicate._stats_reset = self._stats_reset
        return duplicate

    # ---------------------------------------------------------------------------------------------------- batching
    def batch_spec(self, element_spec: ElementSpec, batch_size: int) -> BatchSpec:
        """The shape of every batch ``process`` yields from elements like ``element_spec`` (padding included)."""
        if not isinstance(element_spec, ElementSpec):
            raise TypeError(f"element_spec must be an ElementSpec, got {type(element_spec).__name__}")
        batch_size = _check_batch_size(batch_size)
        return BatchSpec(
            batch_size=batch_size,
            dense_features=TensorSpec((batch_size, element_spec.dense_dim), torch.float32),
            sparse_keys=element_spec.sparse_keys,
            sparse_values_dtype=torch.int64,
            sparse_lengths_dtype=torch.int32,
            labels=TensorSpec((batch_size,), torch.float32),
            valid_mask=TensorSpec((batch_size,), torch.bool),
        )

    def __call__(
        self, elements: Iterable[RecElement] | ElementSource, batch_size: int, drop_remainder: bool = False
    ) -> Iterator[Batch]:
        """Same as :meth:`process` (datarax modules are called)."""
        return self.process(elements, batch_size, drop_remainder)

    def process(
        self, elements: Iterable[RecElement] | ElementSource, batch_size: int, drop_remainder: bool = False
    ) -> Iterator[Batch]:
        """Yield Batches of ``batch_size`` from ``elements``, starting where the Batcher's state says."""
        batch_size = _check_batch_size(batch_size)
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"drop_remainder must be a bool, got drop_remainder={drop_remainder!r}")
        if not isinstance(elements, (Iterable, ElementSource)):
            raise TypeError(f"elements must be an iterable of RecElement or an ElementSource, got {type(elements)}")
        return self._generate(elements, batch_size, drop_remainder)

    def _generate(
        self, elements: Iterable[RecElement] | ElementSource, batch_size: int, drop_remainder: bool
    ) -> Iterator[Batch]:
        epoch, position, batches = self._state["epoch"], self._state["position"], self._state["batches"]
        for chunk in self._chunks_from(elements, epoch, position, batch_size):
            if len(chunk) < batch_size and drop_remainder:
                break
            batch = collate_chunk(chunk, self.element_spec, batch_size)
            position += len(chunk)
            batches += 1
            self._state = {"epoch": epoch, "position": position, "batches": batches}
            yield batch
            if len(chunk) < batch_size:
                break
        self._state = {"epoch": epoch + 1, "position": 0, "batches": 0}

    def _chunks_from(
        self, elements: Iterable[RecElement] | ElementSource, epoch: int, position: int, batch_size: int
    ) -> Iterator[ElementChunk]:
        """The stream as chunks of ``batch_size`` elements (the last may be short), starting at ``position``."""
        iter_chunks = getattr(elements, "iter_chunks", None)
        if isinstance(elements, ElementSource) and callable(iter_chunks):
            reader = ChunkReader(iter(iter_chunks(position, epoch)))
            while (rows := reader.take(batch_size)) is not None:
                yield rows
            return
        samples = self._stream_from(elements, epoch, position)
        while True:
            chunk = list(itertools.islice(samples, batch_size))
            if not chunk:
                return
            yield chunk_from_elements(chunk, self.element_spec, first_index=position)
            position += len(chunk)

    @staticmethod
    def _stream_from(elements: Iterable[RecElement] | ElementSource, epoch: int, position: int) -> Iterator[RecElement]:
        if isinstance(elements, ElementSource):
            return iter(elements.iter_from(position, epoch))
        stream = iter(elements)
        skipped = sum(1 for _ in itertools.islice(stream, position))
        if skipped < position:
            raise ValueError(
                f"the Batcher state says {position} elements were consumed, but elements holds only {skipped}"
            )
        return stream


def collate(elements: list[RecElement], spec: ElementSpec, batch_size: int, first_index: int = 0) -> Batch:
    """``n <= batch_size`` elements -> one Batch of ``batch_size`` rows, the last ``batch_size - n`` padding."""
    return collate_chunk(chunk_from_elements(elements, spec, first_index), spec, batch_size)


def chunk_from_elements(elements: list[RecElement], spec: ElementSpec, first_index: int = 0) -> ElementChunk:
    """Stack elements into one :class:`ElementChunk`, naming the first bad element (its index in the stream)."""
    n = len(elements)
    for i, element in enumerate(elements):
        if not isinstance(element, RecElement):
            raise TypeError(f"element {first_index + i} must be a RecElement, got {type(element).__name__}")
    try:
        dense = np.stack([e.dense for e in elements]).astype(np.float32, copy=False)
        lengths = np.stack([e.sparse_lengths for e in elements]).astype(np.int64, copy=False)
    except ValueError:
        _raise_shape_mismatch(elements, spec, first_index)
        raise
    if dense.shape[1:] != (spec.dense_dim,) or lengths.shape[1:] != (len(spec.sparse_keys),):
        _raise_shape_mismatch(elements, spec, first_index)
    labels = np.fromiter((e.label for e in elements), dtype=np.float32, count=n)
    ids = np.concatenate([e.sparse_ids for e in elements])
    if not np.issubdtype(ids.dtype, np.integer):
        i = next(i for i, e in enumerate(elements) if not np.issubdtype(np.asarray(e.sparse_ids).dtype, np.integer))
        dtype = np.asarray(elements[i].sparse_ids).dtype
        raise TypeError(f"element {first_index + i} has sparse_ids of dtype {dtype}, not an integer dtype")
    id_counts = np.fromiter((e.sparse_ids.shape[0] for e in elements), dtype=np.int64, count=n)
    mismatch = np.flatnonzero(id_counts != lengths.sum(1))
    if mismatch.size:
        i = int(mismatch[0])
        raise ValueError(
            f"element {first_index + i} has {id_counts[i]} sparse_ids but its sparse_lengths "
            f"{elements[i].sparse_lengths.tolist()} sum to {int(lengths[i].sum())}"
        )
    if (lengths < 0).any():
        i = int(np.flatnonzero((lengths < 0).any(1))[0])
        raise ValueError(f"element {first_index + i} has negative sparse_lengths {elements[i].sparse_lengths.tolist()}")
    return ElementChunk(dense, ids.astype(np.int64, copy=False), lengths, labels)


def collate_chunk(chunk: ElementChunk, spec: ElementSpec, batch_size: int) -> Batch:
    """``n <= batch_size`` stacked samples -> one Batch of ``batch_size`` rows, the last ``batch_size - n`` padding.

    Each chunk layout has its own way to the KJT's key-major values: key-major chunks concatenate per-feature
    slices, id-matrix chunks transpose and drop the empty bags, jagged chunks gather (bag ``(f, b)`` starts at its
    sample-major offset).
    """
    n, num_keys = len(chunk), len(spec.sparse_keys)
    if n > batch_size:
        raise ValueError(f"a chunk of {n} samples does not fit batch_size={batch_size}")
    if chunk.key_major is not None:
        sparse_shape = (n, chunk.key_major.store.lengths.shape[0])
    else:
        sparse_shape = (chunk.id_matrix if chunk.id_matrix is not None else chunk.lengths).shape
    if chunk.dense.shape != (n, spec.dense_dim) or sparse_shape != (n, num_keys):
        raise ValueError(
            f"chunk arrays dense {chunk.dense.shape} and lengths/id matrix {sparse_shape} do not fit the element "
            f"spec (dense_dim={spec.dense_dim}, {num_keys} sparse keys)"
        )
    allocate = np.empty if n == batch_size else np.zeros  # padding rows are zero; a full batch has none
    dense = allocate((batch_size, spec.dense_dim), np.float32)
    labels = allocate(batch_size, np.float32)
    dense[:n] = chunk.dense
    labels[:n] = chunk.labels
    valid = torch.ones(batch_size, dtype=torch.bool)
    if n < batch_size:
        valid[n:] = False
    if chunk.key_major is not None:
        sparse = _kjt_from_key_major(chunk.key_major, spec.sparse_keys, batch_size)
    elif chunk.id_matrix is not None:
        sparse = _kjt_from_id_matrix(chunk.id_matrix, spec.sparse_keys, batch_size)
    else:
        sparse = _kjt_from_jagged(chunk, spec.sparse_keys, batch_size)
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels), valid)


def _kjt_from_jagged(chunk: ElementChunk, keys: tuple[str, ...], batch_size: int) -> KeyedJaggedTensor:
    if not np.issubdtype(chunk.ids.dtype, np.integer):
        raise TypeError(f"chunk ids must have an integer dtype, got {chunk.ids.dtype}")
    n, num_keys = len(chunk), len(keys)
    lengths = np.zeros((batch_size, num_keys), dtype=np.int64)
    lengths[:n] = chunk.lengths
    ids = chunk.ids.astype(np.int64, copy=False)
    if ids.shape[0] != int(lengths.sum()) or (lengths < 0).any():
        raise ValueError(f"chunk holds {ids.shape[0]} ids but its lengths (some negative?) sum to {int(lengths.sum())}")
    starts = np.cumsum(lengths.reshape(-1)) - lengths.reshape(-1)  # sample-major start of bag (b, f)
    lengths_key_major = lengths.T.reshape(-1)
    starts_key_major = starts.reshape(batch_size, num_keys).T.reshape(-1)
    out_starts = np.cumsum(lengths_key_major) - lengths_key_major
    gather = np.repeat(starts_key_major - out_starts, lengths_key_major) + np.arange(ids.shape[0])
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(ids[gather]),
        lengths=torch.from_numpy(lengths_key_major.astype(np.int32)),
        stride=batch_size,
        length_per_key=lengths.sum(0).tolist(),
    )


def kjt_from_id_matrix(keys: Sequence[str], ids: torch.Tensor | np.ndarray) -> KeyedJaggedTensor:
    """``ids [B, F]`` (one id per sample and feature, negative: an empty bag) -> a KJT of ``F`` keys and stride ``B``
    whose bags hold 0 or 1 id: the form of hashed Criteo-like ids kept in a batch cache. One transposing copy and,
    when some bag is empty, one compaction (vectorised numpy, no loop over rows)."""
    if not isinstance(ids, (torch.Tensor, np.ndarray)) or ids.ndim != 2:
        raise ValueError(f"ids must be a 2-D [batch, features] tensor, got {getattr(ids, 'shape', type(ids))}")
    matrix = ids.numpy(force=True) if isinstance(ids, torch.Tensor) else ids
    if not np.issubdtype(matrix.dtype, np.integer):
        raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
    keys = tuple(keys)
    if len(keys) != matrix.shape[1] or len(set(keys)) != len(keys):
        raise ValueError(f"keys must name the {matrix.shape[1]} columns of ids once each, got {list(keys)}")
    return _kjt_from_id_matrix(matrix, keys, matrix.shape[0])


def _kjt_from_id_matrix(id_matrix: np.ndarray, keys: tuple[str, ...], batch_size: int) -> KeyedJaggedTensor:
    """``[n, F]`` ids (negative: empty bag), ``n <= batch_size`` -> a KJT of stride ``batch_size`` (padding rows
    empty): key-major is one transposing copy, and the present ids are one mask away. Without an empty bag the
    transpose is the values and every length is 1.

    The parts are consistent by construction (one id per present bag, lengths 0 or 1), so the KJT is built without
    re-checking them."""
    if not np.issubdtype(id_matrix.dtype, np.integer):
        raise TypeError(f"chunk id_matrix must have an integer dtype, got {id_matrix.dtype}")
    n, num_keys = id_matrix.shape[0], len(keys)
    if n == batch_size:
        key_major = np.ascontiguousarray(id_matrix.T, dtype=np.int64)
    else:  # a short last batch: its padding rows are empty bags
        key_major = np.full((num_keys, batch_size), -1, dtype=np.int64)
        key_major[:, :n] = id_matrix.T
    present = key_major >= 0
    if np.count_nonzero(present) == present.size:
        values, lengths = key_major.reshape(-1), np.ones(present.size, np.int32)
        length_per_key = [batch_size] * num_keys
    else:
        values, lengths = np.compress(present.reshape(-1), key_major), present.reshape(-1).astype(np.int32)
        length_per_key = present.sum(1, dtype=np.int32).tolist()
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(values), None, torch.from_numpy(lengths), batch_size, None, length_per_key
    )


def _kjt_from_key_major(rows: KeyMajorRows, keys: tuple[str, ...], batch_size: int) -> KeyedJaggedTensor:
    """Key-major rows -> a KJT of stride ``batch_size``: the values are the rows' per-feature slices concatenated,
    the lengths their bag lengths (padding rows empty). The store was validated when opened (lengths consistent with
    the ids), so the KJT is built without re-checking."""
    values, bag_lengths, length_per_key = rows.arrays()
    if len(rows) == batch_size:
        lengths = bag_lengths.astype(np.int32, order="C")  # key-major whatever the file's memory order
    else:
        lengths = np.zeros((len(keys), batch_size), np.int32)
        lengths[:, : len(rows)] = bag_lengths
    return KeyedJaggedTensor._trusted(
        list(keys), torch.from_numpy(values), None, torch.from_numpy(lengths.reshape(-1)), batch_size, None,
        length_per_key.tolist(),
    )  # fmt: skip


def _raise_shape_mismatch(elements: list[RecElement], spec: ElementSpec, first_index: int) -> None:
    """Name the first element whose dense or sparse_lengths shape differs from ``spec``."""
    expected_dense, expected_lengths = (spec.dense_dim,), (len(spec.sparse_keys),)
    for i, e in enumerate(elements):
        if np.shape(e.dense) != expected_dense or np.shape(e.sparse_lengths) != expected_lengths:
            raise ValueError(
                f"element {first_index + i} has dense shape {np.shape(e.dense)} and sparse_lengths shape "
                f"{np.shape(e.sparse_lengths)}; the element spec expects {expected_dense} and {expected_lengths}"
            )
