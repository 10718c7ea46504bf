"""Reading the next batch: from the data iterator (directly, or through a background thread that produces host
batches ahead), then agreed across ranks so every rank stops at the same step (:mod:`.agreement`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tritonrec.dist.train_pipeline.agreement import PendingAgreement, Status, StepAgreement
from tritonrec.dist.train_pipeline.utils import DataLoadingThread
from tritonrec.kernels.checks import check_int

NEXT_BATCH = "next_batch"  # the stage name of reading the data iterator, in every pipeline's agreement


def check_host_prefetch(host_prefetch: object) -> int:
    return check_int(host_prefetch, "host_prefetch", 0, what="a non-negative int (0: no thread)")


class BatchFetcher:
    """Next batch of a data iterator, agreed by every rank.

    Args:
        agreement: the ranks' per-step agreement.
        host_prefetch: batches a background thread reads ahead of the pipeline (0: read in the caller's thread).

    A new iterator (another object than the last one) starts afresh; once the ranks agreed the data is over, the
    iterator is not read again.

    :meth:`close_thread` (a pipeline's ``close()``) loses no batch and never lets two threads read the iterator:
    the stopped thread keeps the iterator until the batches it took from it (the queued ones, and the one it was
    reading) are handed out, in order, by the next reads of the same iterator; only then is the iterator read again
    (by a new thread, or directly). ``close_thread`` itself waits at most a few seconds (a read in flight goes on
    after it returns); the wait for a read in flight, however long, falls on the next read, where the caller would
    have waited for that batch anyway: it cannot deadlock unless reading the iterator in the caller's thread would.
    """

    def __init__(self, agreement: StepAgreement, host_prefetch: int = 0) -> None:
        self.agreement = agreement
        self.host_prefetch = check_host_prefetch(host_prefetch)
        self._iterator: Iterator[Any] | None = None
        self._thread: DataLoadingThread[Any] | None = None
        # the stopped thread of the current iterator, until it handed out every batch it took (see close_thread)
        self._stopped: DataLoadingThread[Any] | None = None
        # stopped threads of forgotten iterators, which may still be inside their next() (see _connect)
        self._abandoned: list[DataLoadingThread[Any]] = []
        self.exhausted = False

    def _connect(self, iterator: Iterator[Any]) -> None:
        if iterator is self._iterator:
            return
        if not hasattr(iterator, "__next__"):
            raise TypeError(f"dataloader_iter must be an iterator (iter(loader)), got {type(iterator).__name__}")
        self.close()
        for thread in self._abandoned:  # an iterator used before (then reset): wait for its old reader's next()
            if thread.iterator is iterator:
                thread.join()
        self._abandoned = [t for t in self._abandoned if t.alive]
        self._iterator = iterator
        self.exhausted = False

    def _source(self) -> DataLoadingThread[Any] | None:
        """The thread to read the current iterator's next batch from (None: read it directly)."""
        if self._thread is None and self._stopped is not None:
            if self._stopped.has_leftover():  # waits for the stopped thread's read in flight, if any
                return self._stopped
            self._stopped = None  # it has ended: the iterator is free again
        if self._thread is None and self.host_prefetch:
            assert self._iterator is not None
            self._thread = DataLoadingThread(self._iterator, self.host_prefetch)
        return self._thread

    def _read(self) -> tuple[Any, BaseException | None]:
        """This rank's next batch (None at its end) and the error reading it raised, if any."""
        try:
            source = self._source()
            if source is not None:
                return source.get(), None
            assert self._iterator is not None
            return next(self._iterator, None), None
        except Exception as error:
            return None, error

    def next(self, iterator: Iterator[Any], error: BaseException | None = None, failed_stage: str | None = None) -> Any:
        """The next batch, or None when some rank has none (then every rank gets None from now on).

        ``error``: a failure of this rank earlier in the step (in ``failed_stage``), reported in the same agreement.
        Raises on every rank when a rank failed (see :class:`StepAgreement`). Every rank must call this the same
        number of times.
        """
        return self.start(iterator, error, failed_stage).result()

    def start(
        self,
        iterator: Iterator[Any],
        error: BaseException | None = None,
        failed_stage: str | None = None,
        dropped: Iterable[int] = (),
    ) -> PendingBatch:
        """:meth:`next` in two halves: read this rank's batch and launch the agreement now; ``.result()`` later
        gives the agreed batch (or None) and raises as :meth:`next` does. ``dropped``: this rank's dropped slots,
        carried by the same agreement (:meth:`StepAgreement.start`; ``.dropped()`` afterwards)."""
        self._connect(iterator)
        batch, read_error = (None, None) if self.exhausted else self._read()
        status = Status.OK if batch is not None else Status.EXHAUSTED
        if read_error is not None and error is None:
            error, failed_stage = read_error, NEXT_BATCH
        return PendingBatch(self, batch, self.agreement.start(status, error, failed_stage, dropped))

    def is_current(self, iterator: Iterator[Any]) -> bool:
        """Whether ``iterator`` is the one being read (another object starts afresh)."""
        return iterator is self._iterator

    def close_thread(self) -> None:
        """Stop the background thread (see the class docstring: no batch it took is lost; it keeps the iterator
        until they are handed out)."""
        if self._thread is not None:
            self._thread.stop()
            assert self._stopped is None  # a new thread starts only once the last stopped one is done
            self._stopped, self._thread = self._thread, None

    def close(self) -> None:
        """Stop the background thread and forget the iterator (and the batches its thread took, not handed out)."""
        self.close_thread()
        if self._stopped is not None:
            self._abandoned.append(self._stopped)
            self._stopped = None
        self._iterator = None


class PendingBatch:
    """This rank's next batch (``local``, None at its end) with its agreement in flight (:meth:`BatchFetcher.start`)."""

    def __init__(self, fetcher: BatchFetcher, local: Any, agreement: PendingAgreement) -> None:
        self.fetcher, self.local, self._agreement = fetcher, local, agreement

    def wait(self) -> None:
        """Wait for the agreement's all-reduce without deciding (:meth:`PendingAgreement.wait`)."""
        self._agreement.wait()

    def result(self) -> Any:
        """The batch when every rank has one, else None (and the fetcher is exhausted from now on)."""
        if not self._agreement.result():
            self.fetcher.exhausted = True
            self.fetcher.close_thread()
            return None
        return self.local

    def dropped(self) -> list[int]:
        """The slots any rank dropped (:meth:`PendingAgreement.dropped`), once :meth:`result` returned."""
        return self._agreement.dropped()


__all__ = ["NEXT_BATCH", "BatchFetcher", "PendingBatch", "check_host_prefetch"]
