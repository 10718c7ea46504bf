"""``close()`` mid-stream, in one process (toy sharded module): going on with the same iterator trains every batch,
bit for bit as a run never closed (the batches the background thread read ahead are handed out first, in order),
and the iterator is never read by two threads at once, even when close() returns while the thread is inside a slow
``next()``; ``reset()`` then the same iterator waits for that read too. Also the background thread's leftovers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.train_pipeline.toy import ToyModel, progress_losses, staged_losses, toy_batches
from tritonrec.data.batch import Batch
from tritonrec.dist.train_pipeline import (
    DataLoadingThread,
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)

CPU = torch.device("cpu")
COUNT = 12


class Guarded:
    """An iterator over ``batches`` that counts its reads and every time two threads were inside ``next()`` at once;
    read ``slow_at`` blocks until ``gate`` is set (``entered`` says it started)."""

    def __init__(self, batches: list[Any], slow_at: int | None = None) -> None:
        self.batches, self.slow_at = batches, slow_at
        self.read = 0
        self.overlaps = 0
        self.gate, self.entered = threading.Event(), threading.Event()
        self._inside = threading.Lock()

    def __iter__(self) -> Guarded:
        return self

    def __next__(self) -> Any:
        if not self._inside.acquire(blocking=False):
            self.overlaps += 1
            self._inside.acquire()
        try:
            k = self.read
            if k == self.slow_at:
                self.entered.set()
                assert self.gate.wait(timeout=30)
            if k >= len(self.batches):
                raise StopIteration
            self.read += 1
            return self.batches[k]
        finally:
            self._inside.release()


def _wait_until_reads_stop(data: Guarded) -> None:
    """Until the background thread stopped reading ahead (its queue is full and it holds one more batch)."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 0.3:
        if data.read != last:
            last, since = data.read, time.monotonic()
        time.sleep(0.02)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _progress(pipeline: Any) -> Callable[[Iterator[Any]], float | None]:
    def step(data: Iterator[Any]) -> float | None:
        try:
            return float(pipeline.progress(data)[0])
        except StopIteration:
            return None

    return step


class _Staged:
    """StagedTrainPipeline (copy + input dist, host_prefetch=2) with the caller's forward / backward / step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        sdd = SparseDataDistUtil(model)
        self.pipeline = StagedTrainPipeline(
            [PipelineStage("copy", lambda b: b), sdd.start_sparse_data_dist_stage()], host_prefetch=2
        )

    def step(self, data: Iterator[Any]) -> float | None:
        batch = self.pipeline.progress(data)
        if batch is None:
            return None
        self.optimizer.zero_grad()
        loss = self.model(batch)[0]
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def close(self) -> None:
        self.pipeline.close()


def _make(kind: str, model: torch.nn.Module) -> tuple[Any, Callable[[Iterator[Any]], float | None]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "staged":
        staged = _Staged(model, optimizer)
        return staged, staged.step
    pipeline = {
        "base_prefetch2": lambda: TrainPipelineBase(model, optimizer, CPU, host_prefetch=2),
        "sparse_dist": lambda: TrainPipelineSparseDist(model, optimizer, CPU),
        "sparse_dist_prefetch1": lambda: TrainPipelineSparseDist(model, optimizer, CPU, host_prefetch=1),
        "sparse_dist_no_thread": lambda: TrainPipelineSparseDist(model, optimizer, CPU, host_prefetch=0),
        "semi_sync": lambda: TrainPipelineSemiSync(model, optimizer, CPU, start_batch=0),
    }[kind]()
    return pipeline, _progress(pipeline)


def _run(kind: str, data: Guarded, close_after: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and weights of ``kind`` over ``data``; ``close()`` after ``close_after`` steps (once the thread has
    read as far ahead as it can), then on with the same iterator."""
    model = ToyModel()
    pipeline, step = _make(kind, model)
    losses: list[float] = []
    while (loss := step(data)) is not None:
        losses.append(loss)
        if len(losses) == close_after:
            _wait_until_reads_stop(data)
            pipeline.close()
    pipeline.close()
    return losses, _weights(model)


KINDS = ["base_prefetch2", "sparse_dist", "sparse_dist_prefetch1", "sparse_dist_no_thread", "semi_sync", "staged"]


@pytest.mark.parametrize("kind", KINDS)
def test_close_mid_stream_loses_no_batch(kind: str) -> None:
    batches = list(toy_batches(COUNT))
    expected_losses, expected_weights = _run(kind, Guarded(batches))
    data = Guarded(batches)
    losses, weights = _run(kind, data, close_after=3)
    assert len(losses) == COUNT and data.read == COUNT
    assert losses == expected_losses and _same(weights, expected_weights)
    assert data.overlaps == 0


@pytest.mark.parametrize("kind", ["sparse_dist", "staged"])
def test_close_during_a_slow_read_never_reads_the_iterator_twice_at_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() returns while the thread is still inside next() (its wait for the thread timed out): the pipeline
    goes on with that read's batch once it arrives, and reads the iterator only after it."""
    monkeypatch.setattr(DataLoadingThread, "stop_timeout_s", 0.2, raising=False)
    batches = list(toy_batches(COUNT))
    expected_losses, expected_weights = _run(kind, Guarded(batches))
    data = Guarded(batches, slow_at=6)
    model = ToyModel()
    pipeline, step = _make(kind, model)
    losses = [step(data), step(data)]
    assert data.entered.wait(timeout=30)  # the thread is inside the slow next()
    started = time.monotonic()
    pipeline.close()
    closing = time.monotonic() - started
    threading.Timer(0.5, data.gate.set).start()
    while (loss := step(data)) is not None:
        losses.append(loss)
    pipeline.close()
    assert data.overlaps == 0
    assert len(losses) == COUNT and losses == expected_losses and _same(_weights(model), expected_weights)
    assert closing < 3  # close did not wait for the read


def test_reset_during_a_slow_read_waits_for_it_before_reading_the_same_iterator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """reset() drops the batches in flight (as torchrec's) and forgets the iterator; given the same one again, the
    pipeline starts a new reader only once the old thread's read has returned."""
    monkeypatch.setattr(DataLoadingThread, "stop_timeout_s", 0.2, raising=False)
    data = Guarded(list(toy_batches(COUNT)), slow_at=4)
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    pipeline.progress(data)
    assert data.entered.wait(timeout=30)
    pipeline.reset()
    threading.Timer(0.5, data.gate.set).start()
    trained = progress_losses(pipeline, data)
    pipeline.close()
    assert data.overlaps == 0
    assert trained and data.read == COUNT


def test_staged_close_equals_uninterrupted_with_the_toy_helpers() -> None:
    """The caller's loop of the other suites (staged_losses), closing after every third step."""

    def run(close: bool) -> list[float]:
        model = ToyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sdd = SparseDataDistUtil(model)
        pipeline = StagedTrainPipeline(
            [PipelineStage("copy", lambda b: b), sdd.start_sparse_data_dist_stage()], host_prefetch=2
        )

        def after_step(batch: Batch, losses: list[float]) -> None:
            if close and len(losses) % 3 == 0:
                time.sleep(0.1)
                pipeline.close()

        losses = staged_losses(pipeline, model, optimizer, toy_batches(COUNT), after_step)
        pipeline.close()
        return losses

    closed = run(close=True)
    assert len(closed) == COUNT and closed == run(close=False)


# ----------------------------------------------------------------------------------------------- batch thread
def test_a_stopped_thread_hands_out_what_it_took_in_order() -> None:
    data = Guarded(list(range(10)))
    thread = DataLoadingThread(data, depth=2)
    assert thread.get() == 0
    _wait_until_reads_stop(data)  # 1 and 2 queued, 3 held
    thread.stop()
    assert not thread.alive
    got = []
    while thread.has_leftover():
        got.append(thread.get())
    assert got == [1, 2, 3] and data.read == 4
    with pytest.raises(RuntimeError, match="no leftover"):
        thread.get()


def test_a_stopped_thread_keeps_the_end_and_the_error_it_met() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise KeyError("bad row")

    thread = DataLoadingThread(failing(), depth=4)
    thread.join()  # read to its failure
    thread.stop()
    assert thread.has_leftover() and thread.get() == 1
    with pytest.raises(KeyError, match="bad row"):
        thread.get()
    assert thread.has_leftover() and thread.get() is None  # over: stays over

    thread = DataLoadingThread(iter([5]), depth=4)
    thread.join()
    thread.stop()
    assert thread.get() == 5 and thread.get() is None and thread.has_leftover()
