"""What every train pipeline shares: side streams (CUDA) or none (CPU), the device copy of a batch, telling the
caching allocator which stream uses a tensor, and a background thread that produces host batches ahead.

On CUDA the copy of batch ``i+2`` runs on a memcpy stream and the input dist of batch ``i+1`` on a data-dist
stream while the default stream computes batch ``i``; a consumer waits the producer's stream (``wait_stream``) and
marks the tensors it received (``record_stream``) so their memory is not reused while it still reads them. On the
CPU there are no streams: the overlap comes from gloo running collectives on its own threads and from
:class:`DataLoadingThread` producing batches while the main thread computes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch

from tritonrec.kernels.checks import check_int

T = TypeVar("T")


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority side stream on a CUDA ``device``; None on the CPU (no streams there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device, priority=-1)


def stream_context(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Run the block on ``stream`` (a no-op for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def record_stream(obj: Any, stream: torch.cuda.Stream | None) -> None:
    """Tell the caching allocator that ``stream`` reads every tensor in ``obj`` (tensors, objects with a
    ``record_stream`` method such as Batch, KJT and sharded-module contexts, and lists / tuples / dicts of them)."""
    if stream is None or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            record_stream(item, stream)
    elif isinstance(obj, dict):
        for item in obj.values():
            record_stream(item, stream)
    elif hasattr(obj, "record_stream"):
        obj.record_stream(stream)


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` on ``device`` (``batch.to``); the batch itself when it already lives there (the CPU path)."""
    if not hasattr(batch, "to"):
        raise TypeError(f"a pipeline batch must have a .to(device, non_blocking) method, got {type(batch).__name__}")
    if device.type == "cpu" and _on_cpu(batch):
        return batch
    return batch.to(device, non_blocking=non_blocking)


def _on_cpu(batch: Any) -> bool:
    tensor = getattr(batch, "labels", batch if isinstance(batch, torch.Tensor) else None)
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"


def wait_for_batch(batch: Any, stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for ``stream`` (which produced ``batch``) and mark ``batch`` as used here."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    record_stream(batch, current)


class _Stop:
    """Queue marker: the producer's iterator is exhausted."""


class _Failure:
    """Queue marker: the producer's iterator raised ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_NOTHING: Any = object()  # no item (the producer holds none; nothing peeked)


class DataLoadingThread(Generic[T]):
    """Pulls items from ``iterator`` on a daemon thread, up to ``depth`` ahead of the consumer.

    ``get()`` returns the next item in order, None once the iterator is exhausted, and re-raises (in the consumer's
    thread) an exception the iterator raised. ``stop()`` ends the thread; it is idempotent. Nothing the thread took
    from the iterator is lost: after ``stop()``, ``get()`` still hands out, in order, the items it had queued and the
    one it was reading or holding when stopped, while :meth:`has_leftover` says there is one.
    """

    def __init__(self, iterator: Iterator[T], depth: int = 2, name: str = "tritonrec-batches") -> None:
        depth = check_int(depth, "depth", 1)
        self._iterator = iterator
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._done = False
        self._held: Any = _NOTHING  # the item the producer took but could not queue before stop(); read after join
        self._peeked: Any = _NOTHING  # a leftover has_leftover() took out, for the next get()
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        while not self._stopping.is_set():
            try:
                item: Any = next(self._iterator)
            except StopIteration:
                item = _Stop()
            except BaseException as error:  # handed to the consumer, who raises it where it can be reported
                item = _Failure(error)
            if not self._put(item):
                self._held = item  # stopped while it waited for room: a leftover, after the queued ones
                return
            if isinstance(item, (_Stop, _Failure)):
                return

    def _unwrap(self, item: Any) -> T | None:
        if isinstance(item, _Stop):
            self._done = True
            return None
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item  # type: ignore[no-any-return]

    def get(self) -> T | None:
        if self._done:
            return None
        if not self._stopping.is_set():
            return self._unwrap(self._queue.get())
        if not self.has_leftover():
            raise RuntimeError("DataLoadingThread.get() after stop() with no leftover (see has_leftover())")
        item, self._peeked = self._peeked, _NOTHING
        return self._unwrap(item)

    def _take_leftover(self) -> Any:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            pass
        # the producer may still be inside next(): wait for it (however long: its item comes next), after which
        # neither the queue nor the item it holds changes
        self._thread.join()
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            item, self._held = self._held, _NOTHING
            return item

    def has_leftover(self) -> bool:
        """After :meth:`stop`: whether :meth:`get` has more to hand out (an item the thread took from the iterator,
        or its end or error, which then stays). Waits for the thread's read in flight, if any, to return (however
        long it takes): once this is False the thread has ended and the iterator is free to be read again."""
        if not self._stopping.is_set():
            raise RuntimeError("DataLoadingThread.has_leftover() before stop()")
        if self._done:
            return True
        if self._peeked is _NOTHING:
            self._peeked = self._take_leftover()
        return self._peeked is not _NOTHING

    stop_timeout_s = 5.0  # how long stop() waits for the thread to end

    def stop(self) -> None:
        """Read no more from the iterator: the thread ends after the read in flight (if any). Waits up to
        :attr:`stop_timeout_s` for it to end; it may still be inside the iterator's ``next()`` when this returns,
        and is then the iterator's reader until it ends (:meth:`has_leftover` and :meth:`join` wait for that)."""
        self._stopping.set()
        self._thread.join(timeout=self.stop_timeout_s)

    def join(self) -> None:
        """Wait for the thread to end (after :meth:`stop`: for its read in flight, however long it takes)."""
        self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the thread is still running (possibly inside the iterator's ``next()``)."""
        return self._thread.is_alive()

    @property
    def iterator(self) -> Iterator[T]:
        return self._iterator


__all__ = [
    "DataLoadingThread",
    "current_stream",
    "new_stream",
    "record_stream",
    "stream_context",
    "to_device",
    "wait_for_batch",
]
