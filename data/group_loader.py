"""``GroupLoader``: yields the batches of :class:`~tritonrec.data.batch_cache.DataGroup` s, at most ``depth`` alive.

A producer thread walks the schedule (every epoch: the training group's batches, shuffled per epoch when asked, then
the validation group's in order) and makes each batch: read from the cache when the group has stored it, otherwise
by calling ``loader_fn(item, arrays, seed)`` for each item, where ``arrays`` are that item's rows of freshly
allocated loader arrays (to fill in place) and ``seed`` is an int for training items (derived from ``seed``, the
epoch and the item; for augmentation) and ``None`` for validation items. ``loader_fn`` returns the item's
additional data (a mapping, or None).

At most ``depth`` batches exist at once, counting the ones waiting in the queue: before making a batch the producer
takes a slot, and a batch gives its slot back when released (``batch.release()``, a ``with`` block, or garbage
collection). A slow consumer therefore stalls the producer instead of letting batches pile up. The limit holds
across iterations of one loader: a batch the consumer still holds from an earlier iteration counts until released.
Errors in ``loader_fn`` reach the consumer, raised from ``next()``, and free the failed batch's slot. The producer
works up to ``depth - 1`` batches ahead, so a batch whose previous-epoch copy is cached only after its next copy was
made is loaded once more (with 2 batches an epoch and ``depth=3``, epoch 1 still loads; from epoch 2 on everything
comes from the cache); caching that copy keeps the stored one (a stored batch is never rewritten).

A segment (one group's pass in one epoch) whose batches are all stored when the producer reaches it is read by the
consumer itself, batch by batch as it asks: a cached read is a copy of mapped rows (~45 us for 2048 Criteo rows),
and handing each batch over from another thread would cost more than that (wake-ups and GIL hand-offs). The
producer waits until the consumer is through such a segment, so the depth limit and the order hold as before. When
every batch of the schedule is stored as iteration starts (the later epochs of a filled cache), no producer thread is
started at all.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from tritonrec.data.batch_cache import Batch, DataGroup
from tritonrec.kernels.checks import check_int

LoaderFn = Callable[[Any, dict[str, torch.Tensor], int | None], Mapping[str, Any] | None]
_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _StoredSegment:
    """A segment whose batches are all stored: the consumer reads them itself and sets ``done``."""

    def __init__(self, group: DataGroup, order: list[int], epoch: int, is_validation: bool) -> None:
        self.group, self.order, self.epoch, self.is_validation = group, order, epoch, is_validation
        self.done = threading.Event()


class GroupLoader:
    """Batches of ``training`` (and ``validation``) for ``epochs`` epochs with at most ``depth`` alive.

    Args:
        loader_fn: ``(item, arrays, seed) -> additional data or None``; fills ``arrays`` (one item's rows).
        training: the training group.
        validation: a validation group, iterated after the training batches of every epoch.
        epochs: passes over the schedule.
        depth: the most batches alive at once (at least 1; 2+ lets loading overlap the consumer's work).
        shuffle: visit the training batches in a new order every epoch (their items stay together, so stored
            batches remain valid).
        seed: seeds the batch order and the per-item seeds given to ``loader_fn``.
    """

    def __init__(
        self,
        loader_fn: LoaderFn,
        training: DataGroup,
        validation: DataGroup | None = None,
        epochs: int = 1,
        depth: int = 3,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if not callable(loader_fn):
            raise TypeError(f"loader_fn must be callable, got {type(loader_fn).__name__}")
        for name, group in (("training", training), ("validation", validation)):
            if group is not None and not isinstance(group, DataGroup):
                raise TypeError(f"{name} must be a DataGroup, got {type(group).__name__}")
        epochs = check_int(epochs, "epochs", 1, what="an int >= 1")
        depth = check_int(depth, "depth", 1, what="an int >= 1")
        seed = check_int(seed, "seed", 0, what="an int >= 0")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got shuffle={shuffle!r}")
        self.loader_fn, self.training, self.validation = loader_fn, training, validation
        self.epochs, self.depth, self.shuffle, self.seed = epochs, depth, shuffle, seed
        self._lock = threading.Lock()
        self.alive = 0  # batches made and not yet released
        self.max_alive = 0
        self.loaded_batches = 0  # batches made by loader_fn (the rest came from the cache)
        self._thread: threading.Thread | None = None
        self._iterating = False  # an iteration started and not finished or closed (either path)
        # One semaphore for the loader's lifetime: a batch of an earlier iteration (one the consumer still holds, or
        # one left in that iteration's queue) gives its slot back here, so it counts against ``depth`` until
        # released. A semaphore per iteration let such a batch release into the next iteration's, raising its limit.
        self._slots = threading.Semaphore(depth)
        self._queue: queue.Queue = queue.Queue()

    def segments(self) -> Iterator[tuple[DataGroup, list[int], int, bool]]:
        """``(group, batch indices in order, epoch, is_validation)``: one group's pass of one epoch at a time."""
        for epoch in range(self.epochs):
            order = np.arange(self.training.batch_count)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(order)
            yield self.training, order.tolist(), epoch, False
            if self.validation is not None:
                yield self.validation, list(range(self.validation.batch_count)), epoch, True

    def schedule(self) -> Iterator[tuple[DataGroup, int, int, bool]]:
        """``(group, batch index, epoch, is_validation)`` in the order batches are made."""
        for group, order, epoch, is_validation in self.segments():
            for index in order:
                yield group, index, epoch, is_validation

    def __iter__(self) -> Iterator[Batch]:
        if self._iterating or (self._thread is not None and self._thread.is_alive()):
            raise RuntimeError("this GroupLoader is already being iterated; finish or close() that iteration first")
        self._iterating = True
        self._queue = queue.Queue()
        self._stop = threading.Event()
        self._making = False  # the producer holds a slot for a batch it has not queued yet
        if self._everything_stored():
            self._thread = None  # later epochs of a filled cache: the consumer reads every segment itself
            return self._consume_stored()
        self._thread = threading.Thread(target=self._produce, name="GroupLoader", daemon=True)
        self._thread.start()
        return self._consume()

    def _everything_stored(self) -> bool:
        """Every batch of every group is stored now (and so stays: a stored batch is never unmarked)."""
        groups = [group for group in (self.training, self.validation) if group is not None]
        return all(group.store is not None and group.store.all_stored() for group in groups)

    def _consume_stored(self) -> Iterator[Batch]:
        """The schedule of a wholly stored cache, read in the consumer's thread: no producer thread to start, hand a
        segment over and join (~0.5 ms an epoch)."""
        try:
            for group, order, epoch, is_validation in self.segments():
                yield from self._read_segment(_StoredSegment(group, order, epoch, is_validation))
        finally:
            self._iterating = False

    def _consume(self) -> Iterator[Batch]:
        try:
            while (item := self._next_item()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                if isinstance(item, _StoredSegment):
                    yield from self._read_segment(item)
                else:
                    yield item
        finally:
            self.close()

    def _read_segment(self, segment: _StoredSegment) -> Iterator[Batch]:
        """A wholly stored segment, read here in the consumer's thread (a read is a copy of mapped rows, cheaper
        than handing a batch over from the producer thread); the producer waits until it is done."""
        group = segment.group
        try:
            for index in segment.order:
                while not self._slots.acquire(timeout=0.05):  # only this consumer's own batches hold slots now
                    self._raise_if_stalled()
                self._count_alive(making=False)
                stored = group.read_batch(index)
                assert stored is not None  # a stored batch stays stored
                arrays, additional = stored
                yield Batch(group, index, segment.epoch, segment.is_validation, arrays, additional, False,
                            self._release_slot)  # fmt: skip
        finally:
            segment.done.set()

    def _next_item(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=0.05)
            except queue.Empty:
                self._raise_if_stalled()

    def _raise_if_stalled(self) -> None:
        with self._lock:
            stalled = self._stalled()
        if stalled:  # every slot is held by a batch the consumer still has: nothing can ever arrive
            gc.collect()  # batches only reachable through reference cycles give their slots back here
            with self._lock:
                stalled = self._stalled()
            if stalled:
                raise RuntimeError(
                    f"all depth={self.depth} batches are still alive, so no next batch can be loaded: "
                    "release() batches (or use them in a with block) before asking for more"
                ) from None

    def _stalled(self) -> bool:
        """Every slot is held by a batch the consumer already has (none waiting in the queue, none being made: a
        batch the producer is still making holds a slot too, and a slow ``loader_fn`` is not a stall)."""
        return self.alive >= self.depth and self._queue.empty() and not self._making

    def close(self) -> None:
        """Stop the producer (a consumer that leaves early calls this through the generator's cleanup)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._drop_queued()
        self._iterating = False

    def _drop_queued(self) -> None:
        """Release the batches made but never handed out, so their slots are free for the next iteration."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Batch):
                item.release()

    def _count_alive(self, making: bool) -> None:
        """A slot was taken for a batch (``making``: by the producer, for a batch it has not queued yet)."""
        with self._lock:
            self.alive += 1
            self.max_alive = max(self.max_alive, self.alive)
            if making:
                self._making = True

    def _release_slot(self) -> None:
        with self._lock:
            self.alive -= 1
        self._slots.release()

    def _produce(self) -> None:
        try:
            for group, order, epoch, is_validation in self.segments():
                store = group.store
                if store is not None and all(store.is_stored(index) for index in order):
                    segment = _StoredSegment(group, order, epoch, is_validation)
                    self._queue.put(segment)  # the consumer reads it; wait, so no later batch takes a slot first
                    while not segment.done.wait(timeout=0.05):
                        if self._stop.is_set():
                            return
                    continue
                for index in order:
                    while not self._slots.acquire(timeout=0.05):
                        if self._stop.is_set():
                            return
                    if self._stop.is_set():
                        self._slots.release()
                        return
                    self._count_alive(making=True)
                    try:
                        batch = self._make(group, index, epoch, is_validation)
                    except BaseException:  # no batch holds the slot taken for it: give it back (it leaked before)
                        with self._lock:
                            self._making = False
                        self._release_slot()
                        raise
                    self._queue.put(batch)
                    with self._lock:
                        self._making = False
        except BaseException as error:  # handed to the consumer, raised from next()
            self._queue.put(_Failure(error))
        self._queue.put(_END)

    def _make(self, group: DataGroup, index: int, epoch: int, is_validation: bool) -> Batch:
        stored = group.read_batch(index)
        if stored is not None:
            arrays, additional = stored
            return Batch(group, index, epoch, is_validation, arrays, additional, False, self._release_slot)
        if not group.loader_layouts:
            where = str(group.cache_location)
            raise FileNotFoundError(f"batch {index} of a cache-only group is not stored in {where!r}")
        arrays = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in group.loader_layouts.items()}
        additional: dict[str, list[Any]] = {}
        start = index * group.batch_size
        for row in range(group.batch_size):
            item = start + row
            seed = None if is_validation else int(np.random.SeedSequence([self.seed, epoch, item]).generate_state(1)[0])
            extra = self.loader_fn(group[item], {name: array[row] for name, array in arrays.items()}, seed)
            if extra is not None:
                if not isinstance(extra, Mapping):
                    kind = type(extra).__name__
                    raise TypeError(f"loader_fn must return a mapping or None, got {kind} for item {item}")
                for key, value in extra.items():
                    additional.setdefault(key, [None] * group.batch_size)[row] = value
        with self._lock:
            self.loaded_batches += 1
        return Batch(group, index, epoch, is_validation, arrays, additional, True, self._release_slot)
