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
step, as in the other pipelines, and nothing that may wait on a peer (the next batch's input dist, the next stage)
runs before it is read. With a :class:`SparseDataDistUtil` stage whose modules' input dists run on groups of their
own (:attr:`StagedTrainPipeline.defers_agreement`), it is read during the caller's forward, as
``TrainPipelineSparseDist`` does: the all-reduce travels while the forward computes, and the util's forward hook reads
it before waiting on the next batch's input dist. A failure it reports is then raised by the next ``progress`` on
every rank, after the caller trained the batch every rank had (the hook does not wait on an input dist the failed
rank may not have launched). Otherwise ``progress`` reads it before returning.

A stage that raises on one rank loses only its own batch: the step's later stages still run there, each
on another batch, so their collectives pair with their peers'; then the agreement makes every rank raise instead of
one of them hanging. While the pipeline fills, the ranks agree after every stage instead, since a fill callback
waits on its peers. A failure inside a stage after it entered a collective its peers are in is left to the
collective timeout.

The same agreement carries the batches each rank dropped (a stage returned None for them): a batch any rank dropped is
dropped on every rank, right after the agreement of the step (or, while filling, of the stage) that dropped it, so
no later stage runs on it anywhere and the ranks' later stages, input dists and forwards stay paired. A stage that
keeps per-batch state (the input dist's in-flight contexts) hears of such a drop through its ``drop_callback``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.agreement import PendingAgreement, Status, StepAgreement, renew_input_dist_groups
from tritonrec.dist.train_pipeline.checks import check_bool
from tritonrec.dist.train_pipeline.fetch import NEXT_BATCH, BatchFetcher, PendingBatch
from tritonrec.dist.train_pipeline.pipelines import TrainPipeline
from tritonrec.dist.train_pipeline.stages import PipelineStage, SparseDataDistUtil
from tritonrec.dist.train_pipeline.utils import current_stream, record_stream, stream_context

logger = logging.getLogger(__name__)

StageResult = tuple[Any, Any]  # (output, CUDA event or None)


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

    A stage that returns None for a batch drops it, on every rank: the ranks may drop different batches (a filter
    on each rank's own data), and the step's agreement drops the union everywhere (see the module docstring).
    Every rank must request a flush at the same step.
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
        # the agreement also carries one drop flag per in-flight batch: still one all-reduce per step, no new one
        agreement = StepAgreement(group, [NEXT_BATCH, *names], slots=len(pipeline_stages))
        self._fetcher = BatchFetcher(agreement, host_prefetch)
        self._fetcher.agreement.on_failure.append(renew_input_dist_groups)
        self._error: BaseException | None = None  # this rank's stage failure, not yet reported to the others
        self._failed_stage = ""
        self._read_ahead: Any = None  # the next step's first batch, read and agreed at the end of this step
        # the step's agreement while it is in flight during the caller's forward (see _end_step), and a failure it
        # reported, raised by the next progress()
        self._pending: PendingBatch | None = None
        self._deferred_error: BaseException | None = None
        self._sdd = _sparse_data_dist_of(pipeline_stages)
        if self._sdd is not None:
            self._sdd.before_next_split_wait = self._finish_deferred_agreement
        self._dropped: set[int] = set()  # slots of _outputs this rank dropped since its last agreement
        # per slot of _outputs, the stages with a drop_callback that ran on its batch (told if it is dropped)
        self._ran: list[list[int]] = [[] for _ in pipeline_stages]
        streams = [s.stream for s in pipeline_stages if s.stream is not None]
        self._compute_stream = compute_stream or (current_stream(streams[0].device) if streams else None)

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    # -------------------------------------------------------------------------------------------------- running
    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any:
        if self._flushing:
            return None  # every rank flushes at the same step: nothing to agree on
        return self._agree(dataloader_iter)

    def _take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _settle(self) -> None:
        """Report this rank's failure (if any) and drops to every rank; raises on all of them when one failed."""
        self._agree(None)

    def _agree(self, dataloader_iter: Iterator[Any] | None) -> Any:
        """The ranks' agreement on this rank's failure and drops since the last one, and, given ``dataloader_iter``,
        on the next batch (returned; None when some rank has none). The batches any rank dropped become holes here
        before the caller runs another stage."""
        failed_stage, error = self._failed_stage, self._take_error()
        dropped, self._dropped = sorted(self._dropped), set()
        batch = None
        if dataloader_iter is None:
            pending: PendingAgreement | PendingBatch = self._fetcher.agreement.start(
                Status.OK, error, failed_stage, dropped
            )
            pending.result()
        else:
            pending = self._fetcher.start(dataloader_iter, error, failed_stage, dropped)
            batch = pending.result()
        self._drop(pending.dropped())
        return batch

    @property
    def defers_agreement(self) -> bool:
        """Whether the step's agreement is read during the caller's forward instead of before ``progress`` returns:
        when the input-dist stage's forward hook can read it before waiting on the next batch's input dist (the
        one wait a failed rank's missing launch could hang), and no other sharded module runs an input dist in the
        forward (:attr:`PipelinedModules.can_defer_agreement`, as for ``TrainPipelineSparseDist``)."""
        pipelined = None if self._sdd is None else self._sdd._pipelined
        return pipelined is not None and pipelined.can_defer_agreement and not self._flushing

    def _finish_deferred_agreement(self) -> bool:
        """The input-dist stage's forward hook: read the step's deferred agreement (:meth:`_read_deferred`), keeping
        a failure on any rank for the next ``progress`` to raise (the forward that reads it trains a batch every
        rank has, and its backward pairs everywhere). Returns whether the hook may wait on the next batch's input
        dist (no rank failed: a failed rank may never have launched it)."""
        if self._pending is not None:
            self._pending.wait()  # a rank that never comes raises here, from the forward: nothing more to wait on
        try:
            self._read_deferred()
        except Exception as error:  # a stage failed on some rank: every rank raises it at the next progress
            self._deferred_error = error
        return self._deferred_error is None

    def _read_deferred(self) -> None:
        """Read the step's deferred agreement, if one is in flight: the next batch, the drops (raises on every rank
        when one failed). Called before anything uses them: the forward hook, or the next ``progress``."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read_ahead = pending.result()
            self._drop(pending.dropped())

    def _drop(self, slots: list[int]) -> None:
        """Make ``slots`` holes (a rank dropped their batches), newest first: each stage that ran on such a batch gets
        its drop_callback with the number of newer batches it ran on still in flight (the newer ones dropped now no
        longer count)."""
        for slot in reversed(slots):
            self._outputs[slot] = (None, None)
            for stage_idx in reversed(self._ran[slot]):
                newer = sum(stage_idx in ran for ran in self._ran[slot + 1 :])
                callback = self._stages[stage_idx].drop_callback
                assert callback is not None
                callback(newer)
            self._ran[slot] = []

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
        self._ran[batch_offset] = []  # a new batch enters this slot
        self._read_deferred()  # no forward ran since the last step's agreement (filling, or after a hole)
        batch, self._read_ahead = self._read_ahead, None
        if batch is None and fill:
            batch = self._next_batch(dataloader_iter)
        return batch, None

    def _run_stage(self, batch_offset: int, stage_idx: int, dataloader_iter: Iterator[Any], fill: bool) -> None:
        stage = self._stages[stage_idx]
        slot = self._outputs[batch_offset]
        hole = stage_idx != 0 and slot is not None and slot[0] is None  # a dropped batch: the data goes on
        batch, event = self._stage_input(batch_offset, stage_idx, dataloader_iter, fill)
        # None: no batch came (the data is over, or a flush empties the pipeline); (None, _): a hole (the batch was
        # dropped or its stage failed), which later stages skip without taking it for the end of the data
        result: StageResult | None = (None, None) if batch is not None or hole else None
        with record(f"## pipeline stage {stage_idx}: {stage.name} ##"):
            if batch is not None:
                if self._debug_mode:
                    logger.info("stage %d (%s), batch %d", stage_idx, stage.name, batch_offset + self._num_steps)
                try:
                    result = self._run_with_event(stage, event, batch)
                    if result[0] is None:  # dropped: on every rank after the next agreement
                        self._dropped.add(batch_offset)
                    if stage.drop_callback is not None:
                        self._ran[batch_offset].append(stage_idx)
                except Exception as error:  # reported at the step's agreement (or before a fill callback)
                    if self._error is None:
                        self._error, self._failed_stage = error, stage.name
                    else:
                        self._error.add_note(f"then stage {stage.name!r} failed too: {type(error).__name__}: {error}")
            elif stage.data_exhausted_callback is not None and not hole:
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
        elif self.defers_agreement:  # launched now, read by the input-dist stage's forward hook (or next progress)
            failed_stage, error = self._failed_stage, self._take_error()
            dropped, self._dropped = sorted(self._dropped), set()
            self._pending = self._fetcher.start(dataloader_iter, error, failed_stage, dropped)
        else:
            self._read_ahead = self._next_batch(dataloader_iter)

    def _fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Batch ``k`` (``k < N``) runs stages ``0 .. N-1-k``: after filling, batch 0 is ready for the model (and
        the first stage's next batch is read ahead). A batch that a rank drops here becomes a hole on every rank
        at the agreement right after that stage (before the next stage, and before its fill callback)."""
        for batch_offset in range(self.num_stages):
            for stage_idx in range(self.num_stages - batch_offset):
                self._run_stage(batch_offset, stage_idx, dataloader_iter, fill=True)
        self._end_step(dataloader_iter)
        self._initialized = True

    def _advance(self) -> StageResult | None:
        self._read_deferred()  # its drops name the slots before this shift
        out = self._outputs[0]
        self._outputs = [*self._outputs[1:], None]
        self._ran = [*self._ran[1:], []]
        return out

    def _drained(self) -> bool:
        """No batch left in any stage, and none read ahead."""
        self._read_deferred()
        return self._read_ahead is None and all(out is None or out[0] is None for out in self._outputs)

    def _step(self, dataloader_iter: Iterator[Any]) -> None:
        """Every stage once, each on its batch (stage ``s`` on the one ``N - 1 - s`` calls behind the newest), then
        the step's agreement."""
        for stage_idx in range(self.num_stages):
            self._run_stage(self.num_stages - 1 - stage_idx, stage_idx, dataloader_iter, fill=False)
        self._end_step(dataloader_iter)  # before the caller's forward, which may wait on peers

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """The next batch through every stage (for the model's forward), or None when the data is over.

        A batch a stage returned None for, on any rank, is skipped on every rank (the later stages do not run on
        it, as in torchrec): the batches behind it still move on one stage per step, so each reaches the model with
        every stage run on it, and every rank returns the same number of batches.
        After the end, a new iterator (another object) refills the pipeline and trains on; the same one gives None.
        """
        if self._deferred_error is not None:  # read by the last forward's hook
            error, self._deferred_error = self._deferred_error, None
            raise error
        self._read_deferred()  # when no forward read it (the caller ran none since the last call)
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


def _sparse_data_dist_of(stages: list[PipelineStage]) -> SparseDataDistUtil | None:
    """The :class:`SparseDataDistUtil` of the last stage whose drop callback is one's (its input-dist stage)."""
    for stage in reversed(stages):
        owner = getattr(stage.drop_callback, "__self__", None)
        if isinstance(owner, SparseDataDistUtil):
            return owner
    return None


__all__ = ["PipelineStage", "SparseDataDistUtil", "StagedTrainPipeline"]
