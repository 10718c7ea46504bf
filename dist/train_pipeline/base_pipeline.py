"""The pipeline interface and the base pipeline (torchrec's names and semantics): :class:`TrainPipeline` (one step
per ``progress`` call) and :class:`TrainPipelineBase`, which only overlaps the device copy of the next batch with the
current one's step; ``backward``, shared with the sparse-dist pipeline and the training loops.

Separate from :mod:`.pipelines` (the sparse-dist and eval pipelines) to keep each module small; every name here is
also importable from there.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.agreement import StepAgreement
from tritonrec.dist.train_pipeline.checks import check_model_fwd, check_parts, split_model_output
from tritonrec.dist.train_pipeline.fetch import NEXT_BATCH, BatchFetcher
from tritonrec.dist.train_pipeline.utils import new_stream, stream_context, to_device, wait_for_batch

In = TypeVar("In")
Out = TypeVar("Out")


def _forward(model: nn.Module, custom_model_fwd: Callable[[Any], Any] | None, batch: Any, training: bool) -> Any:
    """``(losses, output)`` of ``custom_model_fwd(batch)`` or else ``model(batch)``, checked against the contract."""
    if custom_model_fwd is None:
        return split_model_output(model(batch), "model(batch)", training)
    return split_model_output(custom_model_fwd(batch), "custom_model_fwd(batch)", training)


def backward(losses: torch.Tensor) -> None:
    """Backward of the step's loss (summed first when the model returns one per task, as torchrec)."""
    with record("## backward ##"):
        (losses if losses.dim() == 0 else torch.sum(losses, dim=0)).backward()


class TrainPipeline(abc.ABC, Generic[In, Out]):
    """One step per :meth:`progress` call; ``StopIteration`` when the data is over."""

    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out: ...

    def close(self) -> None:
        """Release what the pipeline holds between steps (background threads); the pipeline can run again.

        Going on with the same iterator loses no batch: the ones the background thread already read are handed out
        first, in order. A read in flight when ``close`` returns finishes on that thread, which still owns the
        iterator until then: the next ``progress`` waits for it, so two threads never read the iterator (the
        caller, reading it itself right after ``close``, could still meet that read)."""


class TrainPipelineBase(TrainPipeline[In, Out]):
    """Two stages: the copy of batch ``i+1`` (memcpy stream on CUDA) overlaps forward/backward of batch ``i``.

    Args:
        model: called as ``losses, output = model(batch)``.
        optimizer: stepped after each backward (``zero_grad`` before each forward).
        device: where batches are copied and the model runs.
        custom_model_fwd: called as ``losses, output = custom_model_fwd(batch)`` instead of the model (torchrec's
            argument); it runs the model itself.
        host_prefetch: host batches a background thread reads ahead (0: none; keyword-only).
        group: the ranks that agree on each step (default: the world; keyword-only).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        *,
        host_prefetch: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._device = check_parts(model, optimizer, device)
        self._model = model
        self._optimizer = optimizer
        self._custom_model_fwd = check_model_fwd(custom_model_fwd)
        self._memcpy_stream = new_stream(self._device)
        self._fetcher = BatchFetcher(StepAgreement(group, [NEXT_BATCH]), host_prefetch)
        self._cur_batch: Any = None
        self._connected = False

    def _copy(self, batch: Any) -> Any:
        with record("## copy_batch_to_device ##"), stream_context(self._memcpy_stream):
            return to_device(batch, self._device, non_blocking=True)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        if not self._connected:
            first = self._fetcher.next(dataloader_iter)
            self._cur_batch = None if first is None else self._copy(first)
            self._connected = True
        if self._cur_batch is None:
            raise StopIteration
        cur_batch = self._cur_batch
        next_batch = self._fetcher.next(dataloader_iter)
        if self._model.training:
            self._optimizer.zero_grad()
        wait_for_batch(cur_batch, self._memcpy_stream)
        training = self._model.training
        with record("## forward ##"):
            losses, output = _forward(self._model, self._custom_model_fwd, cur_batch, training)
        if training:
            backward(losses)
        self._cur_batch = None if next_batch is None else self._copy(next_batch)
        if self._model.training:
            with record("## optimizer ##"):
                self._optimizer.step()
        return output

    def reset(self) -> None:
        """Forget the iterator (the next ``progress`` starts from a fresh one)."""
        self._fetcher.close()
        self._cur_batch, self._connected = None, False

    def close(self) -> None:
        self._fetcher.close_thread()


__all__ = ["TrainPipeline", "TrainPipelineBase", "backward"]
