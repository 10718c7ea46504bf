"""The staged pipeline (torchrec's ``StagedTrainPipeline``, ``PipelineStage``, ``SparseDataDistUtil``): the same
overlap as :class:`~tritonrec.dist.train_pipeline.TrainPipelineSparseDist`, as an explicit list of stages a user
extends (a feature-processing stage, a second copy).

``progress(dataloader_iter)`` returns the batch that went through every stage, ready for the model, or None when
the data is over; the caller runs forward, backward and the optimizer. With ``N`` stages, ``N`` batches are in
flight: in each call stage ``s`` runs on the batch ``N - 1 - s`` calls behind the newest, so the newest batch is
copied while an older one has its input dist started and the oldest one trains.

Example (every rank; the input-dist stage last, as the model's forward consumes it)::

    sdd = SparseDataDistUtil(model, data_dist_stream=None)      # CUDA: torch.cuda.Stream()
    pipeline = StagedTrainPipeline([
        PipelineStage("data_copy", lambda batch: batch.to(device, non_blocking=True)),
        sdd.start_sparse_data_dist_stage(),    # runnable, stream, fill and data-exhausted callbacks
    ])
    while (batch := pipeline.progress(batches)) is not None:
        optimizer.zero_grad()
        loss, _ = model(batch)          # a forward hook waits the next batch's split sizes afterwards
        loss.backward()
        optimizer.step()

Once per step, after the stages, the ranks agree (:mod:`.agreement`) on whether a stage failed on any of them and
whether every one has a next batch, which each reads then for the next step's first stage: one tiny all-reduce a
step, as in the other pipelines, and nothing that may wait on a peer (the model's forward, the next stage) runs
before it. A stage that raises on one rank loses only its own batch: the step's later stages still run there, each
on another batch, so their collectives pair with their peers'; then the agreement makes every rank raise instead of
one of them hanging. While the pipeline fills, the ranks agree after every stage instead, since a fill callback
waits on its peers. A failure inside a stage after it entered a collective its peers are in is left to the
collective timeout.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.agreement import Status, StepAgreement, renew_input_dist_groups
from tritonrec.dist.train_pipeline.checks import check_bool, check_unsupported
from tritonrec.dist.train_pipeline.fetch import NEXT_BATCH, BatchFetcher
from tritonrec.dist.train_pipeline.pipelines import TrainPipeline
from tritonrec.dist.train_pipeline.tracing import PipelinedModules, TrainPipelineContext, rewrite_model
from tritonrec.dist.train_pipeline.utils import current_stream, record_stream, stream_context

logger = logging.getLogger(__name__)

StageResult = tuple[Any, Any]  # (output, CUDA event or None)


@dataclass
class PipelineStage:
    """One transform of a batch that needs no backward (device copy, feature processing, input dist).

    Args:
        name: shown in profiles and errors.
        runnable: ``batch -> batch``.
        stream: CUDA stream to run on (None on the CPU).
        fill_callback: run after the runnable while the pipeline fills (e.g. finish the first input dist).
        data_exhausted_callback: run when the stage gets no batch because the data is over.
    """

    name: str
    runnable: Callable[[Any], Any]
    stream: torch.cuda.Stream | None = None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got name={self.name!r}")
        if not callable(self.runnable):
            raise TypeError(f"stage {self.name!r}: runnable must be callable, got {type(self.runnable).__name__}")


class StagedTrainPipeline(TrainPipeline[Any, Any]):
    """Runs ``pipeline_stages`` on consecutive batches, overlapped (see module docstring).

    Args:
        pipeline_stages: the stages, first (reads the data iterator's batch) to last (its output goes to the model).
        debug_mode: log every stage run.
        compute_stream: the stream the model runs on (CUDA; default the current one).
        on_flush_end: called after a flush (:meth:`set_flush`) emptied the pipeline.
    Keyword-only (tritonrec's):
        host_prefetch: host batches a background thread reads ahead (0: none).
        group: the ranks that agree on each step (default: the world).

    A stage that returns None for a batch drops it; every rank must drop the same batches (their input dists pair
    up across ranks), as every rank must request a flush at the same step.
    """

    def __init__(
        self,
        pipeline_stages: list[PipelineStage],
        debug_mode: bool = False,
        compute_stream: torch.cuda.Stream | None = None,
        on_flush_end: Callable[[], None] | None = None,
        *,
        host_prefetch: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(pipeline_stages, list) or not pipeline_stages:
            raise ValueError(f"pipeline_stages must be a non-empty list of PipelineStage, got {pipeline_stages!r}")
        for stage in pipeline_stages:
            if not isinstance(stage, PipelineStage):
                raise TypeError(f"pipeline_stages must hold PipelineStage objects, got {type(stage).__name__}")
        check_bool(debug_mode, "debug_mode")
        if on_flush_end is not None and not callable(on_flush_end):
            raise TypeError(f"on_flush_end must be a callable or None, got on_flush_end={on_flush_end!r}")
        self._stages = pipeline_stages
        self._debug_mode = debug_mode
        self._outputs: list[StageResult | None] = [None] * len(pipeline_stages)
        self._initialized = False
        self._num_steps = 0
        self._flushing = False
        self.on_flush_end = on_flush_end
        names = [s.name for s in pipeline_stages]
        if len(set(names)) != len(names) or NEXT_BATCH in names:
            raise ValueError(f"stage names must be distinct and not {NEXT_BATCH!r}, got {names}")
        self._fetcher = BatchFetcher(StepAgreement(group, [NEXT_BATCH, *names]), host_prefetch)
        self._fetcher.agreement.on_failure.append(renew_input_dist_groups)
        self._error: BaseException | None = None  # this rank's stage failure, not yet reported to the others
        self._failed_stage = ""
        self._read_ahead: Any = None  # the next step's first batch, read and agreed at the end of this step
        streams = [s.stream for s in pipeline_stages if s.stream is not None]
        self._compute_stream = compute_stream or (current_stream(streams[0].device) if streams else None)

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    # -------------------------------------------------------------------------------------------------- running
    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any:
        if self._flushing:
            return None  # every rank flushes at the same step: nothing to agree on
        failed_stage = self._failed_stage
        return self._fetcher.next(dataloader_iter, self._take_error(), failed_stage)

    def _take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _settle(self) -> None:
        """Report this rank's failure (if any) to every rank; raises on all of them when one failed."""
        failed_stage = self._failed_stage
        self._fetcher.agreement.agree(Status.OK, self._take_error(), failed_stage)

    def _run_with_event(self, stage: PipelineStage, event: Any, batch: Any) -> StageResult:
        with stream_context(stage.stream):
            if event is not None and stage.stream is not None:
                event.wait(stage.stream)
                record_stream(batch, stage.stream)
            output = stage.runnable(batch)
            new_event = None
            if stage.stream is not None:
                new_event = torch.cuda.Event()
                new_event.record(stage.stream)
            return output, new_event

    def _stage_input(
        self, batch_offset: int, stage_idx: int, dataloader_iter: Iterator[Any], fill: bool
    ) -> StageResult:
        """``(batch, event)`` for stage ``stage_idx``: the first stage takes the batch read ahead (agreed at the end of
        the last step), or reads and agrees on one while filling; the others take the previous stage's output."""
        if stage_idx != 0:
            return self._outputs[batch_offset] or (None, None)
        batch, self._read_ahead = self._read_ahead, None
        if batch is None and fill:
            batch = self._next_batch(dataloader_iter)
        return batch, None

    def _run_stage(self, batch_offset: int, stage_idx: int, dataloader_iter: Iterator[Any], fill: bool) -> None:
        stage = self._stages[stage_idx]
        batch, event = self._stage_input(batch_offset, stage_idx, dataloader_iter, fill)
        result: StageResult = (None, None)
        with record(f"## pipeline stage {stage_idx}: {stage.name} ##"):
            if batch is not None:
                if self._debug_mode:
                    logger.info("stage %d (%s), batch %d", stage_idx, stage.name, batch_offset + self._num_steps)
                try:
                    result = self._run_with_event(stage, event, batch)
                except Exception as error:  # reported at the step's agreement (or before a fill callback)
                    if self._error is None:
                        self._error, self._failed_stage = error, stage.name
                    else:
                        self._error.add_note(f"then stage {stage.name!r} failed too: {type(error).__name__}: {error}")
            elif stage.data_exhausted_callback is not None:
                stage.data_exhausted_callback()
        self._outputs[batch_offset] = result  # a failed stage's batch is dropped here: no later stage gets it
        if fill:
            self._settle()  # the fill callback may wait on this stage's peers
            if stage.fill_callback is not None:
                stage.fill_callback()

    def _end_step(self, dataloader_iter: Iterator[Any]) -> None:
        """The step's one agreement: any rank's stage failure (raised on every rank), and whether every rank has the
        next step's first batch, read now (none while flushing: only the failures are agreed)."""
        if self._flushing:
            self._settle()
        else:
            self._read_ahead = self._next_batch(dataloader_iter)

    def _fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Batch ``k`` (``k < N``) runs stages ``0 .. N-1-k``: after filling, batch 0 is ready for the model (and
        the first stage's next batch is read ahead)."""
        for batch_offset in range(self.num_stages):
            for stage_idx in range(self.num_stages - batch_offset):
                self._run_stage(batch_offset, stage_idx, dataloader_iter, fill=True)
        self._end_step(dataloader_iter)
        self._initialized = True

    def _advance(self) -> StageResult | None:
        out = self._outputs[0]
        self._outputs = [*self._outputs[1:], None]
        return out

    def _drained(self) -> bool:
        """No batch left in any stage, and none read ahead."""
        return self._read_ahead is None and all(out is None or out[0] is None for out in self._outputs)

    def _step(self, dataloader_iter: Iterator[Any]) -> None:
        """Every stage once, each on its batch (stage ``s`` on the one ``N - 1 - s`` calls behind the newest), then
        the step's agreement."""
        for stage_idx in range(self.num_stages):
            self._run_stage(self.num_stages - 1 - stage_idx, stage_idx, dataloader_iter, fill=False)
        self._end_step(dataloader_iter)  # before the caller's forward, which may wait on peers

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """The next batch through every stage (for the model's forward), or None when the data is over.

        A batch a stage returned None for is skipped (the later stages do not run on it, as in torchrec): the
        batches behind it still move on one stage per step, so each reaches the model with every stage run on it.
        After the end, a new iterator (another object) refills the pipeline and trains on; the same one gives None.
        """
        if self._initialized and self._drained() and not self._fetcher.is_current(dataloader_iter):
            self._initialized = False  # the data was over: start afresh on the new iterator, as after a flush
        if not self._initialized:
            self._fill_pipeline(dataloader_iter)
        while True:
            ready = self._advance()
            if ready is not None and ready[0] is not None:
                break
            if self._drained():
                if self._flushing:
                    self.flush_end()
                    return self.progress(dataloader_iter)
                return None
            # a hole (a stage returned None for this batch, or a flush was cancelled before the pipeline emptied):
            # returning None here would end the caller's loop, and returning the next batch now would skip its last
            # stage, so the step runs without a forward and the next batch comes next
            self._step(dataloader_iter)
        self._num_steps += 1
        self._step(dataloader_iter)
        out, event = ready
        if event is not None and self._compute_stream is not None:
            event.wait(self._compute_stream)
            record_stream(out, self._compute_stream)
        return out

    # ---------------------------------------------------------------------------------------------------- flush
    def set_flush(self, flush: bool) -> None:
        """Stop reading new batches until the pipeline is empty (every rank at the same step), then refill;
        ``set_flush(False)`` before then cancels it (the batches in flight still train, in order)."""
        self._flushing = check_bool(flush, "flush")

    def flush_end(self) -> None:
        self.set_flush(False)
        self._initialized = False
        if self.on_flush_end is not None:
            self.on_flush_end()

    def close(self) -> None:
        self._fetcher.close_thread()


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

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: Callable[[Any], Any] | None = None
    ) -> PipelineStage:
        """The input-dist :class:`PipelineStage` (torchrec's helper): ``runnable`` (default
        :meth:`start_sparse_data_dist`) on ``data_dist_stream``, with the fill and data-exhausted callbacks."""
        if runnable is not None and not callable(runnable):
            raise TypeError(f"runnable must be callable or None, got runnable={runnable!r}")
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )

    def _before_forward(self, module: nn.Module, input: Any) -> None:
        # Normally the previous forward's hook (or the fill callback) finished this batch's split round. Not when the
        # batch before it was skipped (a stage returned None for it): that forward's hook found no input dist
        # started yet, so the round is finished here, before the pipelined modules consume it.
        if not self._ready and self._waiting:
            self.wait_sparse_data_dist()

    def _after_forward(self, module: nn.Module, input: Any, output: Any) -> None:
        if self._ready:
            self._ready.popleft()
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


__all__ = ["PipelineStage", "SparseDataDistUtil", "StagedTrainPipeline"]
