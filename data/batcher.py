"""``Batcher``: groups :class:`RecElement` samples into :class:`Batch` es (datarax's batcher semantics).

``process(elements, batch_size, drop_remainder=False)`` (also ``batcher(elements, batch_size)``) yields one Batch per
``batch_size`` elements. Without ``drop_remainder`` a short last batch is padded up to ``batch_size`` (zero dense
rows, empty bags, zero labels) and its ``valid_mask`` marks the real rows, so every step sees one shape; with it the
short batch is dropped, as in datarax. Sources that stream :class:`ElementChunk` s (``iter_chunks``: the built-in
synthetic and Criteo sources) are collated chunk-wise, without one Python object per sample; the batches are the same.

The Batcher remembers where its stream stands: ``get_state()`` returns ``{"epoch", "position", "batches"}`` (the
number of completed passes, the elements consumed by the batches yielded so far in this pass, and those batches) and,
as datarax's module state does, the statistics: ``"computed_statistics"`` (those computed or set, deep-copied;
``None`` if none) and ``"statistics_reset"`` (whether ``reset_statistics`` came last). The config's
``precomputed_stats`` stay in the config, outside the state. ``set_state(state)`` restores the statistics and makes
the next ``process`` call start at that element, so a job restored from a checkpoint sees exactly the batches and
statistics it would have seen; a state saved before the statistics were kept (the three int keys only) is accepted and
leaves the statistics as they are. Sources with ``iter_from`` (:class:`ElementSource`) jump there directly; any
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tritonrec.data.batch import Batch
from tritonrec.data.collate import chunk_from_elements, collate, collate_chunk, kjt_from_id_matrix
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import BatchSpec, ElementSource, ElementSpec, RecElement, TensorSpec
from tritonrec.data.sharding import ChunkReader
from tritonrec.kernels.checks import check_int

_STREAM_KEYS = ("epoch", "position", "batches")
_STATE_KEYS = (*_STREAM_KEYS, "computed_statistics", "statistics_reset")


def _check_batch_size(batch_size: object) -> int:
    return check_int(batch_size, "batch_size", 1)


def _copied(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Statistics copied deeply, so that the caller and the Batcher never share a mutable value; a value that cannot
    be deep-copied (a non-leaf autograd tensor, a generator) is shared, as it always was."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        try:
            out[key] = copy_module.deepcopy(value)
        except (TypeError, RuntimeError):
            out[key] = value
    return out


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
    def get_state(self) -> dict[str, Any]:
        """``{"epoch", "position", "batches"}`` (plain ints), ``"computed_statistics"`` (a deep copy, or ``None``) and
        ``"statistics_reset"`` (a bool): JSON-friendly when the statistics are plain numbers, torch.save-friendly
        when they are numbers and tensors."""
        return {
            **self._state,
            "computed_statistics": copy_module.deepcopy(self._computed_stats),
            "statistics_reset": self._stats_reset,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`get_state` result; the next :meth:`process` call resumes from it. A state of only the
        three int keys (saved before the statistics were kept) restores the position and leaves the statistics."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from get_state(), got {type(state).__name__}")
        if set(state) not in (set(_STATE_KEYS), set(_STREAM_KEYS)):
            raise ValueError(
                f"state must have exactly the keys {list(_STATE_KEYS)} (or {list(_STREAM_KEYS)}, from before the "
                f"statistics were kept), got {sorted(state)}"
            )
        for key in _STREAM_KEYS:
            check_int(state[key], f"state[{key!r}]", 0)
        if "computed_statistics" in state:
            stats, reset = state["computed_statistics"], state["statistics_reset"]
            if stats is not None and not isinstance(stats, Mapping):
                raise TypeError(f"state['computed_statistics'] must be a mapping or None, got {stats!r}")
            if not isinstance(reset, bool):
                raise TypeError(f"state['statistics_reset'] must be a bool, got {reset!r}")
            if reset and stats is not None:  # a reset clears the statistics, and setting them clears the reset
                raise ValueError(
                    f"state['statistics_reset'] is True but state['computed_statistics'] is {stats!r}, not None"
                )
            self._computed_stats = None if stats is None else copy_module.deepcopy(dict(stats))
            self._stats_reset = reset
        self._state = {key: int(state[key]) for key in _STREAM_KEYS}

    # ------------------------------------------------------------------------------------------------- statistics
    def compute_statistics(self, data: Any) -> dict[str, Any] | None:
        """Run ``config.batch_stats_fn(data)``, keep and return its result (``None`` without a batch_stats_fn)."""
        if self.config.batch_stats_fn is None:
            return None
        stats = self.config.batch_stats_fn(data)
        if not isinstance(stats, Mapping):
            raise TypeError(f"batch_stats_fn must return a mapping, got {type(stats).__name__}")
        # kept apart from what the caller gets back (a deep copy, as get_state / clone make)
        self._computed_stats, self._stats_reset = _copied(stats), False
        return dict(stats)

    def get_statistics(self) -> dict[str, Any] | None:
        """The last computed or set statistics, else the config's precomputed ones; ``None`` after a reset."""
        if self._stats_reset:
            return None
        if self._computed_stats is not None:  # set statistics win over the config's fixed ones
            return _copied(self._computed_stats)  # the caller may change it in place
        precomputed = self.config.precomputed_stats
        return None if precomputed is None else _copied(precomputed)

    def set_statistics(self, stats: Mapping[str, Any]) -> None:
        """Replace the statistics (also over precomputed ones) and clear a reset. The config stays as it was (it
        was replaced by one without the precomputed statistics before, so ``copy()`` lost them)."""
        if not isinstance(stats, Mapping):
            raise TypeError(f"stats must be a mapping, got {type(stats).__name__}")
        self._computed_stats, self._stats_reset = _copied(stats), False

    def reset_statistics(self) -> None:
        """Forget every statistic: :meth:`get_statistics` returns ``None`` until new ones are computed or set."""
        self._computed_stats, self._stats_reset = None, True

    # ----------------------------------------------------------------------------------------------- duplication
    def copy(self, config: BatcherConfig | None = None) -> Batcher:
        """The same Batcher (spec, stream position) under ``config`` (default: this one's), with that config's
        statistics: computed or set statistics stay behind."""
        duplicate = Batcher(self.element_spec, self.config if config is None else config)
        duplicate.set_state(dict(self._state))  # the stream keys only: the statistics stay as the new Batcher's
        return duplicate

    def clone(self) -> Batcher:
        """An independent duplicate: same spec, stream position and statistics, and a config whose precomputed
        statistics are a deep copy (shared, an in-place change to a clone's statistic tensor changed the original's)."""
        config = self.config
        if config.precomputed_stats is not None:
            config = BatcherConfig(precomputed_stats=copy_module.deepcopy(dict(config.precomputed_stats)))
        duplicate = self.copy(config)
        duplicate.set_state(self.get_state())  # statistics included
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


__all__ = ["Batcher", "BatcherConfig", "chunk_from_elements", "collate", "collate_chunk", "kjt_from_id_matrix"]
