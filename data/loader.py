"""Parallel loading of one rank's shard: Batches from DataLoader workers, with exact mid-epoch resume.

:class:`ShardedBatchDataset` is a ``torch.utils.data.IterableDataset`` that collates a source's elements into
:class:`~tritonrec.data.batch.Batch` es inside the loader's workers. Worker ``w`` of ``K`` reads part ``w`` of ``K``
of the rank's shard (``source.sub_shard(w, K)``), so the workers never read the same sample and together read the
rank's shard once per pass. The dataset's state is its :class:`~tritonrec.data.batcher.Batcher` state (epoch,
position, batches), exposed as ``state_dict`` / ``load_state_dict``: the Stateful protocol of torchdata's
``StatefulDataLoader``, which snapshots every worker's state with each batch and restores them, so a loader built by
:func:`make_rank_loader` resumes mid-epoch exactly, with or without workers. We use that library rather than
tracking which worker produced which prefetched batch ourselves.

The batch order depends on ``num_workers`` (the loader takes one batch from each worker in turn, each worker reading
its own part), so resume with the ``num_workers`` the state was taken with (``load_state_dict`` refuses another).
``num_passes`` passes over the shard make one iteration of the loader (``None``: endless, for training streams);
each pass after the first is the next epoch (reshuffled when the source shuffles). As with any torch loader, a new
iteration starts a new pass: the next epoch (an interrupted pass is abandoned), except right after
``load_state_dict``, which resumes the interrupted pass. Workers are persistent, so their epochs advance across
iterations as a single-process loader's do, with one difference: the workers start reading a pass ahead as soon as
the iteration is made, so an ``iter()`` left before its first batch has already started its pass, and the next
``iter()`` moves on to the following one (a single-process loader starts that pass again).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torch._C._autograd import _profiler_enabled
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful_dataloader import (  # private: RankLoader builds its own (see there)
    _StatefulSingleProcessDataLoaderIter,
)

from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.data.elements import ElementSource
from tritonrec.data.worker_transfer import UnpackingIterator, WorkerPacker
from tritonrec.kernels.checks import check_int, check_optional_int


def _check_count(value: object, name: str, allow_none: bool = False, minimum: int = 1) -> int | None:
    return check_optional_int(value, name, minimum) if allow_none else check_int(value, name, minimum)


class ShardedBatchDataset(IterableDataset):
    """Batches of ``batch_size`` from ``source`` (one rank's shard), split over loader workers (module docstring).

    Args:
        source: an :class:`~tritonrec.data.elements.ElementSource` with ``sub_shard(index, count)`` (every built-in
            source); without it, only ``num_workers=0`` works.
        batch_size: rows per batch (a short last batch of a pass is padded and masked, unless ``drop_remainder``).
        drop_remainder: drop a pass's short last batch instead.
        num_passes: passes over the shard per iteration of the loader; ``None`` streams forever.
    """

    def __init__(
        self, source: ElementSource, batch_size: int, drop_remainder: bool = False, num_passes: int | None = 1
    ) -> None:
        if not isinstance(source, ElementSource):
            raise TypeError(f"source must be an ElementSource (iter_from, element_spec), got {type(source).__name__}")
        self.source = source
        self.batch_size = _check_count(batch_size, "batch_size")
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"drop_remainder must be a bool, got drop_remainder={drop_remainder!r}")
        self.drop_remainder = drop_remainder
        self.num_passes = _check_count(num_passes, "num_passes", allow_none=True)
        self.batcher = Batcher(source.element_spec)
        self.pack_in_workers = False  # set by make_rank_loader, whose iterator unpacks (worker_transfer)
        self._packer = WorkerPacker()
        self._resuming = False  # load_state_dict was called: the next iteration continues that state
        self._first_epoch = 0  # the epoch of the current iteration's first pass (counts the passes on resume)

    def _worker_source(self) -> ElementSource:
        info = get_worker_info()
        if info is None or info.num_workers == 1:
            return self.source
        sub_shard = getattr(self.source, "sub_shard", None)
        if not callable(sub_shard):
            raise TypeError(
                f"{type(self.source).__name__} has no sub_shard(index, count), so it cannot be split over "
                f"{info.num_workers} loader workers: use num_workers=0"
            )
        return sub_shard(info.id, info.num_workers)

    def __iter__(self) -> Iterator[Batch]:
        batches = self._batches()
        if self.pack_in_workers and get_worker_info() is not None:
            self._packer.new_iteration()
            return map(self._packer.pack, batches)
        return batches

    def _batches(self) -> Iterator[Batch]:
        """Where this iteration starts is settled here, when the iteration is made, not at its first batch:
        torchdata's workers snapshot the dataset's state right after ``iter(dataset)``, and a ``state_dict()``
        taken before the next snapshot resumes from that one (a lazy start left it on the abandoned pass)."""
        source = self._worker_source()
        state = self.batcher.get_state()
        if self._resuming:
            self._resuming = False
            done = self.num_passes is not None and state["epoch"] - self._first_epoch >= self.num_passes
            # Saved after its iteration ended: this is the next iteration. Not in a loader worker: there it only
            # says this worker's share had ended (with uneven shares the others go on, and the restored worker made
            # a whole pass too many); a loader whose iteration had ended starts the next one itself (torchdata).
            if done and get_worker_info() is None:
                self._first_epoch = state["epoch"]
        else:
            if state["position"] > 0:  # a pass abandoned by the previous iteration: start the next epoch
                self.set_epoch(state["epoch"] + 1)
            self._first_epoch = self.batcher.get_state()["epoch"]
        return self._passes(source)

    def _passes(self, source: ElementSource) -> Iterator[Batch]:
        """The batches of this iteration's passes left (of ``num_passes``; counted at the first batch, so that a
        :meth:`set_epoch` between ``iter()`` and it starts the iteration there)."""
        passes = self.batcher.get_state()["epoch"] - self._first_epoch  # passes this iteration already made
        while self.num_passes is None or passes < self.num_passes:
            fresh, produced = self.batcher.get_state()["position"] == 0, False
            for batch in self.batcher.process(source, self.batch_size, self.drop_remainder):
                produced = True
                yield batch
            passes += 1
            if fresh and not produced:  # an empty shard (or one shorter than a dropped batch): nothing will come
                return

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration (or the one just made by ``iter()``, before its first batch) at the beginning of
        pass ``epoch``; it is that iteration's first pass. Without workers: with workers, call it before the loader
        starts them (their copies of the dataset do not see it)."""
        self.batcher.set_state({"epoch": _check_count(epoch, "epoch", minimum=0), "position": 0, "batches": 0})
        self._first_epoch, self._resuming = epoch, False

    def state_dict(self) -> dict[str, Any]:
        """The Batcher's state and ``first_epoch``, the epoch of the current iteration's first pass (so a resumed
        iteration of ``num_passes`` passes makes only the passes left)."""
        return {"batcher": self.batcher.get_state(), "first_epoch": self._first_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a state without ``first_epoch`` (saved before it was kept) resumes its
        pass as the iteration's first."""
        if not isinstance(state, Mapping) or set(state) not in ({"batcher"}, {"batcher", "first_epoch"}):
            raise ValueError(
                f"state must be a ShardedBatchDataset.state_dict() ({{'batcher': ..., 'first_epoch': ...}}), "
                f"got {state!r}"
            )
        before = self.batcher.get_state()
        self.batcher.set_state(state["batcher"])
        epoch = self.batcher.get_state()["epoch"]
        first = state.get("first_epoch", epoch)
        try:
            first = check_int(first, "state['first_epoch']", 0, epoch, what=f"an int in [0, batcher epoch={epoch}]")
        except ValueError:
            self.batcher.set_state(before)  # a refused state leaves the dataset as it was
            raise
        self._first_epoch = first
        self._resuming = True


class _InProcessIterator(_StatefulSingleProcessDataLoaderIter):
    """torchdata's single-process iterator without torch's per-batch profiler range while no profiler runs.

    torch's ``__next__`` wraps every batch in ``record_function``, whose entry and exit are two ``torch.ops`` calls
    dispatched through Python: ~11 us a batch, ~20 us with the batch built inside the range (measured on 2048-row
    key-major npy batches, ~100 us each without it). Everything else is torch's: under a profiler, before the first
    batch (its reset) and after ``len(loader)`` (its length warning) the batch goes through torch's ``__next__``."""

    def __next__(self) -> Any:
        if self._sampler_iter is None or self._IterableDataset_len_called is not None or _profiler_enabled():
            return super().__next__()
        try:
            data = self._next_data()
        except StopIteration:
            self._finished = True  # as torchdata's __next__: the loader then starts a new iterator
            raise
        self._num_yielded += 1
        return data


class RankLoader(StatefulDataLoader):
    """The ``StatefulDataLoader`` of :func:`make_rank_loader`: its workers send each batch as one shared buffer
    (:class:`~tritonrec.data.worker_transfer.PackedBatch`), and its iterators hand out the unpacked batches; without
    workers, batches skip torch's profiler range unless a profiler runs (:class:`_InProcessIterator`)."""

    def __iter__(self) -> Iterator[Batch]:
        iterator = super().__iter__()
        return UnpackingIterator(iterator) if self.num_workers > 0 else iterator

    def _get_iterator(self) -> Any:
        if self.num_workers > 0:
            return super()._get_iterator()
        iterator = _InProcessIterator(self, self.next_iter_state)  # as torchdata's _get_iterator without workers
        self.next_iter_state = None
        return iterator

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torchdata's, after checking that ``state_dict`` was taken with this loader's ``num_workers`` (torchdata
        itself only fails at the next ``iter()``, with a bare AssertionError about a missing key)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping from state_dict(), got {type(state_dict).__name__}")
        if state_dict:  # {} (the state of a loader never iterated) restores nothing, as in torchdata
            saved = _saved_num_workers(state_dict)
            if saved != self.num_workers:
                raise ValueError(
                    f"state_dict was taken with num_workers={saved}, but this loader has num_workers="
                    f"{self.num_workers}: the batch order depends on it, so resume with num_workers={saved}"
                )
        super().load_state_dict(dict(state_dict))


def _saved_num_workers(state: Mapping[str, Any]) -> int:
    """The ``num_workers`` a StatefulDataLoader state was taken with: a loader with workers keeps it in its
    snapshot; a single-process loader's state has ``_num_yielded`` at the top instead."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping) and isinstance(snapshot.get("_main_snapshot"), Mapping):
        saved = snapshot["_main_snapshot"].get("_num_workers")
        if isinstance(saved, int) and not isinstance(saved, bool):
            return saved
    elif "_num_yielded" in state:
        return 0
    raise ValueError(
        f"state_dict is not a StatefulDataLoader state_dict() (no worker count in it), got keys {sorted(state)}"
    )


def _no_collate(batch: Batch) -> Batch:
    """The dataset already yields whole batches."""
    return batch


def make_rank_loader(
    source: ElementSource,
    batch_size: int,
    num_workers: int = 0,
    drop_remainder: bool = False,
    num_passes: int | None = 1,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    snapshot_every_n_steps: int = 16,
) -> RankLoader:
    """A ``StatefulDataLoader`` (:class:`RankLoader`) over :class:`ShardedBatchDataset` (``state_dict`` /
    ``load_state_dict`` resume it exactly); ``num_workers`` processes collate in parallel, each on its part of
    ``source``'s shard, and send their batches through shared-memory rings (:mod:`.worker_transfer`).

    ``multiprocessing_context`` starts the workers (``"fork"``, ``"spawn"``, ...; ``None``: the process's default).
    A process that was itself spawned (a rank started by ``torch.multiprocessing.spawn``) defaults to ``"spawn"``,
    whose workers import torch anew: ``"fork"`` starts them in milliseconds where it is safe (CPU, no CUDA yet).

    ``snapshot_every_n_steps`` (workers only): how often the workers send their state with a batch (torchdata's
    option). ``state_dict()`` stays exact between snapshots: a loader restored from it replays the batches since the
    last snapshot and drops them, so a resume reads at most ``snapshot_every_n_steps - 1`` batches twice. A snapshot
    every batch (torchdata's default) cost ~150 us of the ~650 us each 2048-row npy batch took to arrive."""
    dataset = ShardedBatchDataset(source, batch_size, drop_remainder, num_passes)
    dataset.pack_in_workers = True
    _check_count(num_workers, "num_workers", minimum=0)
    _check_count(snapshot_every_n_steps, "snapshot_every_n_steps", minimum=1)
    _check_count(prefetch_factor, "prefetch_factor", allow_none=True)
    if prefetch_factor is not None and num_workers == 0:  # torch's DataLoader refuses it too (we dropped it silently)
        raise ValueError(f"prefetch_factor={prefetch_factor!r} needs loader workers, but num_workers=0")
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be a bool, got pin_memory={pin_memory!r}")
    options: dict[str, Any] = {"batch_size": None, "collate_fn": _no_collate, "pin_memory": pin_memory}
    if num_workers > 0:
        options.update(
            num_workers=num_workers,
            persistent_workers=True,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
    with warnings.catch_warnings():  # torchdata 0.11's constructor calls torch.set_vital, deprecated in torch 2.13
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return RankLoader(dataset, **options)
