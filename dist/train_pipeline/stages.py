"""The stages of :class:`~tritonrec.dist.train_pipeline.StagedTrainPipeline` (torchrec's ``PipelineStage`` and
``SparseDataDistUtil``): a stage is a batch transform with its callbacks; the util makes the sparse input dist one,
whose launches the model's forward (its sharded modules' forwards swapped) consumes in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.checks import check_unsupported
from tritonrec.dist.train_pipeline.tracing import PipelinedModules, TrainPipelineContext, rewrite_model
from tritonrec.dist.train_pipeline.utils import stream_context
from tritonrec.kernels.checks import check_int


@dataclass
class PipelineStage:
    """One transform of a batch that needs no backward (device copy, feature processing, input dist).

    Args:
        name: shown in profiles and errors.
        runnable: ``batch -> batch``.
        stream: CUDA stream to run on (None on the CPU).
        fill_callback: run after the runnable while the pipeline fills (e.g. finish the first input dist).
        data_exhausted_callback: run when the stage gets no batch because the data is over.
    Keyword-only (tritonrec's):
        drop_callback: ``newer -> None``, run on every rank when a batch this stage ran on is dropped before the
            model (a later stage returned None for it on some rank), before any later stage runs on it. ``newer``:
            how many batches this stage ran on after that one are still in flight (0: the latest), so a stage
            that keeps a FIFO of per-batch state knows which entry to discard. Default: SparseDataDistUtil's
            :meth:`~SparseDataDistUtil.drop_callback` when ``runnable`` is its ``start_sparse_data_dist``.
    """

    name: str
    runnable: Callable[[Any], Any]
    stream: torch.cuda.Stream | None = None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None
    drop_callback: Callable[[int], None] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got name={self.name!r}")
        if not callable(self.runnable):
            raise TypeError(f"stage {self.name!r}: runnable must be callable, got {type(self.runnable).__name__}")
        if self.drop_callback is not None and not callable(self.drop_callback):
            raise TypeError(f"stage {self.name!r}: drop_callback must be callable or None, got {self.drop_callback!r}")
        if (
            self.drop_callback is None
            and getattr(self.runnable, "__func__", None) is SparseDataDistUtil.start_sparse_data_dist
        ):
            # a stage built by hand around the util's method: without this, a batch dropped after its input dist
            # started would leave its context queued, and the next forward would consume it
            self.drop_callback = self.runnable.__self__.drop_callback  # type: ignore[attr-defined]


class SparseDataDistUtil:
    """Sparse input dist as a pipeline stage: :meth:`start_sparse_data_dist` launches a batch's input dists, the
    model's forward (swapped on its sharded modules) consumes them, and a forward hook then finishes the next
    batch's split-size round so its tensors travel during the backward.

    Args (torchrec's, in its order):
        model: the model the caller runs (DMP / DDP wrappers are looked through when tracing).
        data_dist_stream: CUDA stream of the input dist (None on the CPU).
        apply_jit, pipeline_postproc: False (not implemented: True raises NotImplementedError).
        prefetch_stream, embedding_lookup_stream: None (prefetch and embedding-lookup stages are not implemented).
    """

    def __init__(
        self,
        model: nn.Module,
        data_dist_stream: torch.cuda.Stream | None = None,
        apply_jit: bool = False,
        prefetch_stream: torch.cuda.Stream | None = None,
        pipeline_postproc: bool = False,
        embedding_lookup_stream: torch.cuda.Stream | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_unsupported(apply_jit=apply_jit, pipeline_postproc=pipeline_postproc)
        streams = {"prefetch_stream": prefetch_stream, "embedding_lookup_stream": embedding_lookup_stream}
        for name, stream in streams.items():
            if stream is not None:
                raise NotImplementedError(f"{name} is not supported (no such stage here); got {name}={stream!r}")
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.data_exhausted = False  # set by data_exhausted_callback, cleared by the next batch's input dist
        self._waiting: deque[TrainPipelineContext] = deque()  # split sizes in flight
        self._ready: deque[TrainPipelineContext] = deque()  # tensors in flight, next forward consumes [0]
        self._next_index = 0
        self._pipelined: PipelinedModules | None = None
        self.fallback_reason: str | None = None
        self._hooks: list[Any] = []
        # set by StagedTrainPipeline when it defers its step agreement into the forward: reads it, and returns False
        # when some rank failed (then the next batch's input dist may be missing there and is not waited on)
        self.before_next_split_wait: Callable[[], bool] | None = None

    @property
    def pipelined_modules(self) -> list[str]:
        return list(self._pipelined.forwards) if self._pipelined is not None else []

    def _initialize(self, context: TrainPipelineContext) -> None:
        self._pipelined, self.fallback_reason = rewrite_model(self.model, context, self.data_dist_stream)
        self._hooks = [
            self.model.register_forward_pre_hook(self._before_forward),
            self.model.register_forward_hook(self._after_forward),
        ]

    def start_sparse_data_dist(self, batch: Any) -> Any:
        """Stage runnable: launch ``batch``'s input dists; returns ``batch``."""
        context = TrainPipelineContext(index=self._next_index)
        self._next_index += 1
        self.data_exhausted = False
        if self._pipelined is None:
            self._initialize(context)
        assert self._pipelined is not None
        if self._pipelined.forwards:
            with record(f"## start_sparse_data_dist {context.index} ##"):
                self._pipelined.start_input_dist(batch, context, self.data_dist_stream)
        self._waiting.append(context)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Finish the oldest started batch's split-size round (launching its tensors)."""
        if not self._waiting:
            return
        context = self._waiting.popleft()
        if self._pipelined is not None and self._pipelined.forwards:
            with record(f"## wait_sparse_data_dist {context.index} ##"):
                self._pipelined.wait_splits(context, self.data_dist_stream)
        self._ready.append(context)
        if self._pipelined is not None:
            self._pipelined.set_context(self._ready[0])

    def wait_sdd_fill_callback(self) -> None:
        """Fill callback of the input-dist stage (the model has not run yet, so no forward hook does it)."""
        self.wait_sparse_data_dist()

    def data_exhausted_callback(self) -> None:
        """Data-exhausted callback of the input-dist stage (torchrec's; StagedTrainPipeline calls it when the stage
        gets no batch: the data is over, or a flush empties the pipeline): no batch's input dist starts any more and
        the pipeline drains, the forwards of the batches still in flight consuming the input dists already started
        (each forward hook finishes the next one's split round while there is one). ``data_exhausted`` reads True
        until a batch (of a new iterator, or after the flush) starts again."""
        self.data_exhausted = True

    def drop_callback(self, newer: int = 0) -> None:
        """Drop callback of the input-dist stage (tritonrec's; StagedTrainPipeline calls it on every rank at the
        same agreement): a batch whose input dist started was dropped before its forward. Its context leaves the
        queue, so the next forward consumes the next batch's; its rounds are finished first, the same collectives
        on every rank (its state is the same everywhere). ``newer``: how many batches started after it are still
        in flight. A stage whose runnable wraps :meth:`start_sparse_data_dist` (a lambda) must pass
        ``drop_callback=sdd.drop_callback`` itself."""
        in_flight = len(self._ready) + len(self._waiting)
        newer = check_int(newer, "newer", 0, in_flight - 1, what=f"an int in [0, {in_flight}) (batches in flight)")
        position = in_flight - 1 - newer
        queue, index = (
            (self._ready, position) if position < len(self._ready) else (self._waiting, position - len(self._ready))
        )
        context = queue[index]
        del queue[index]
        with record(f"## drop_sparse_data_dist {context.index} ##"), stream_context(self.data_dist_stream):
            for request in context.input_dist_splits_requests.values():
                request.wait().wait()  # its split round, then the tensor round that launches
            for request in context.input_dist_tensors_requests.values():
                request.wait()
        context.input_dist_splits_requests.clear()
        context.input_dist_tensors_requests.clear()
        context.module_contexts.clear()
        context.input_sources.clear()
        if self._ready and self._pipelined is not None:
            self._pipelined.set_context(self._ready[0])

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The input-dist :class:`PipelineStage` (torchrec's helper): ``runnable`` (default
        :meth:`start_sparse_data_dist`, which a given one must call once per batch) on ``data_dist_stream``, with
        the fill, data-exhausted and drop callbacks."""
        if runnable is not None and not callable(runnable):
            raise TypeError(f"runnable must be callable or None, got runnable={runnable!r}")
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
            drop_callback=self.drop_callback,
        )

    def _before_forward(self, module: nn.Module, input: Any) -> None:
        # Normally the previous forward's hook (or the fill callback) finished this batch's split round. Not when the
        # batch before it was skipped (a stage returned None for it): that forward's hook found no input dist
        # started yet, so the round is finished here, before the pipelined modules consume it.
        if not self._ready and self._waiting:
            self.wait_sparse_data_dist()

    def _after_forward(self, module: nn.Module, input: Any, output: Any) -> None:
        agreed = self.before_next_split_wait is None or self.before_next_split_wait()
        if self._ready:
            self._ready.popleft()
        if agreed:
            self.wait_sparse_data_dist()
        if self._ready and self._pipelined is not None:
            self._pipelined.set_context(self._ready[0])

    def detach(self) -> nn.Module:
        """Give the model its own forwards back (e.g. to evaluate it); in-flight input dists stay for :meth:`attach`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._pipelined is not None:
            self._pipelined.detach()
            self._pipelined = None
        return self.model

    def attach(self) -> None:
        """Pipeline the model again after :meth:`detach`, continuing with the in-flight batches."""
        if self._pipelined is not None:
            return
        contexts = [*self._ready, *self._waiting]
        if contexts:
            self._initialize(contexts[0])
            if self._ready:
                self._pipelined.set_context(self._ready[0])  # type: ignore[union-attr]


__all__ = ["PipelineStage", "SparseDataDistUtil"]
