"""Train pipelines (torchrec's names and semantics): ``TrainPipeline.progress(dataloader_iter) -> output`` runs one
training step on the next batch and raises ``StopIteration`` when the data is over.

* :class:`TrainPipelineBase` (:mod:`.base_pipeline`, with :class:`TrainPipeline`): copy batch ``i+1`` to the device
  (memcpy stream on CUDA) while batch ``i`` trains.
* :class:`TrainPipelineSparseDist`: while batch ``i`` runs forward and backward, batch ``i+1``'s sparse input dist is
  in flight and batch ``i+2`` is copied. Sharded modules' inputs are found by tracing the model
  (:mod:`.tracing`); their ``forward`` is swapped for one that consumes the prefetched input dist. On CPU the overlap
  comes from gloo's collectives running on gloo's threads while the main thread computes, and from the host batches
  produced ahead by a background thread (``host_prefetch``).
* :class:`EvalPipelineSparseDist`: the same overlap for forward-only passes (no backward, no optimizer).

The model is called as ``losses, output = model(batch)`` (``DLRMTrain``'s contract), or ``custom_model_fwd(batch)``
when given; ``progress`` returns ``output``. The constructors take torchrec's arguments in torchrec's order
(``apply_jit`` and ``pipeline_postproc`` only at False); tritonrec's own (``host_prefetch``, ``group``) are
keyword-only after them.
The order of every operation that changes weights is the base pipeline's, so pipelined training equals base
training bit for bit. Every step the ranks agree on whether each has a batch and whether any failed
(:mod:`.agreement`): they stop at the same step and fail together instead of hanging.

Example (every rank)::

    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    batches = iter(loader)
    while True:
        try:
            loss, logits, labels = pipeline.progress(batches)
        except StopIteration:
            break
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.agreement import StepAgreement, renew_input_dist_groups
from tritonrec.dist.train_pipeline.base_pipeline import In, Out, TrainPipeline, TrainPipelineBase, backward
from tritonrec.dist.train_pipeline.checks import (
    check_bool,
    check_context_type,
    check_model_fwd,
    check_parts,
    check_unsupported,
    split_model_output,
)
from tritonrec.dist.train_pipeline.fetch import NEXT_BATCH, BatchFetcher, PendingBatch
from tritonrec.dist.train_pipeline.tracing import PipelinedModules, TrainPipelineContext, rewrite_model
from tritonrec.dist.train_pipeline.utils import new_stream, stream_context, to_device, wait_for_batch

logger = logging.getLogger(__name__)

START_SPARSE_DATA_DIST = "start_sparse_data_dist"


class TrainPipelineSparseDist(TrainPipeline[In, Out]):
    """Three overlapping stages: copy of batch ``i+2``, sparse input dist of batch ``i+1``, forward/backward and
    optimizer step of batch ``i`` (see the module docstring).

    Args (torchrec's, in its order):
        model: called as ``losses, output = model(batch)``; traced with torch.fx (sharded modules as leaves).
        optimizer: stepped after each backward.
        device: where batches are copied and the model runs.
        execute_all_batches: at the end of the data, train the batches still in the pipeline (True), or raise
            ``StopIteration`` before training them (False: the 2 batches in flight stay queued, so a new iterator
            trains them first).
        apply_jit: False (TorchScript of the dense modules is not implemented: True raises NotImplementedError).
        context_type: the per-batch context class (a :class:`TrainPipelineContext` subclass).
        pipeline_postproc: False (postproc modules are not pipelined: True raises NotImplementedError).
        custom_model_fwd: called as ``losses, output = custom_model_fwd(batch)`` instead of the model; it must run
            the model (whose sharded modules consume the prefetched input dists, as with ``model(batch)``).
    Keyword-only (tritonrec's):
        host_prefetch: host batches a background thread reads ahead (default 2; 0: none).
        group: the ranks that agree on each step (default: the world).

    ``pipelined_modules`` names the sharded modules whose input dist is prefetched; ``fallback_reason`` says why
    none is (the model then runs its own forward, still with the device copy ahead).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        *,
        host_prefetch: int = 2,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._device = check_parts(model, optimizer, device, optimizer_required=self._trains)
        self._model = model
        self._optimizer = optimizer
        self._execute_all_batches = check_bool(execute_all_batches, "execute_all_batches")
        check_unsupported(apply_jit=apply_jit, pipeline_postproc=pipeline_postproc)
        self._context_type = check_context_type(context_type)
        self._custom_model_fwd = check_model_fwd(custom_model_fwd)
        self._memcpy_stream = new_stream(self._device)
        self._data_dist_stream = new_stream(self._device)
        self._fetcher = BatchFetcher(StepAgreement(group, [NEXT_BATCH, START_SPARSE_DATA_DIST]), host_prefetch)
        self._fetcher.agreement.on_failure.append(renew_input_dist_groups)
        self.batches: deque[Any] = deque()
        self.contexts: deque[TrainPipelineContext] = deque()
        self._next_index = 0
        self._pipelined: PipelinedModules | None = None
        self.fallback_reason: str | None = None
        self._model_attached = True

    _trains = True  # EvalPipelineSparseDist: forward only

    # ----------------------------------------------------------------------------------------------- the model
    @property
    def pipelined_modules(self) -> list[str]:
        return list(self._pipelined.forwards) if self._pipelined is not None else []

    @property
    def defers_agreement(self) -> bool:
        """Whether the ranks' agreement on a step is read after its forward instead of before (see :meth:`progress`):
        only when a failed launch ahead cannot mispair the forward's collectives, and when the agreement cannot
        stop the step (with ``execute_all_batches=False`` the end of the data stops it before its forward)."""
        return self._execute_all_batches and self._pipelined is not None and self._pipelined.can_defer_agreement

    def _rewrite(self, context: TrainPipelineContext) -> None:
        self._pipelined, self.fallback_reason = rewrite_model(self._model, context, self._data_dist_stream)
        if self._pipelined.unpipelined and self._pipelined.input_dists_on_own_groups:
            logger.info(
                "train pipeline: the ranks agree before each forward, as sharded module(s) %s run their own input "
                "dist in it (on the input-dist group a failed launch ahead would leave unpaired)",
                self._pipelined.unpipelined,
            )

    def _init_pipelined_modules(self, context: TrainPipelineContext) -> None:
        if self._pipelined is None:
            self._rewrite(context)
        assert self._pipelined is not None
        self._pipelined.set_context(context)

    def detach(self) -> nn.Module:
        """Give the model its own forwards back (in-flight batches stay; :meth:`attach` resumes the pipeline)."""
        if self._pipelined is not None:
            self._pipelined.detach()
            self._pipelined = None
        self._model_attached = False
        return self._model

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """Pipeline ``model`` (or the detached one) again (torchrec's signature).

        ``sparse_dist=True``: the batch next in line gets its input dist now if it has none in flight (every rank
        must attach at the same step). False: only the forwards are swapped again; the batch's input dist must still
        be in flight from before :meth:`detach` (else its forward raises that it has none)."""
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        check_bool(sparse_dist, "sparse_dist")
        if self._pipelined is not None:  # attached already: swap back first, so the originals stay the model's own
            self._pipelined.detach()
            self._pipelined = None
        if model is not None:
            self._model = model
        self._model_attached = True
        if not self.contexts:
            return  # the next fill traces the model
        first = self.contexts[0]
        self._rewrite(first)
        if sparse_dist and not first.input_dist_started:
            self._start_sparse_data_dist(self.batches[0], first)
            self._wait_sparse_data_dist(first)

    # ------------------------------------------------------------------------------------------------ the stages
    def _enqueue_batch(self, dataloader_iter: Iterator[In], error: BaseException | None = None) -> bool:
        """Stage 1: read the next batch (agreed across ranks, with this rank's ``error`` so far) and start its copy."""
        return self._finish_enqueue(self._start_enqueue(dataloader_iter, error))

    def _start_enqueue(self, dataloader_iter: Iterator[In], error: BaseException | None = None) -> PendingBatch:
        """Stage 1, first half: read this rank's next batch, start its copy, launch the ranks' agreement on it."""
        pending = self._fetcher.start(dataloader_iter, error, START_SPARSE_DATA_DIST)
        if pending.local is not None:  # copied now, to overlap what runs until the agreement is read (dropped if
            with record("## copy_batch_to_device ##"), stream_context(self._memcpy_stream):  # ranks stop)
                pending.local = to_device(pending.local, self._device, non_blocking=True)
        return pending

    def _finish_enqueue(self, pending: PendingBatch) -> bool:
        """Stage 1, second half: read the agreement (raising a rank's failure on every rank) and queue the batch."""
        batch = pending.result()
        if batch is None:
            if not self._execute_all_batches:
                raise StopIteration
            return False
        self.batches.append(batch)
        self.contexts.append(self._context_type(index=self._next_index))
        self._next_index += 1
        return True

    def _start_sparse_data_dist(self, batch: Any, context: TrainPipelineContext) -> None:
        """Stage 2a: once ``batch`` is on the device, launch its input dists (split sizes first)."""
        if self._pipelined is None or not self._pipelined.forwards:
            return
        with record(f"## start_sparse_data_dist {context.index} ##"):
            with stream_context(self._data_dist_stream):
                wait_for_batch(batch, self._memcpy_stream)
            self._pipelined.start_input_dist(batch, context, self._data_dist_stream)

    def _wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        """Stage 2b: split sizes arrived -> launch the tensors' all-to-alls."""
        if self._pipelined is None or not self._pipelined.forwards:
            return
        with record(f"## wait_sparse_data_dist {context.index} ##"):
            self._pipelined.wait_splits(context, self._data_dist_stream)

    def _fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        if len(self.batches) >= 2 or (self.batches and self._execute_all_batches):
            return
        if self.batches or not self._enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(self.contexts[0])
        error = None
        try:
            self._start_sparse_data_dist(self.batches[0], self.contexts[0])
        except Exception as failure:  # reported to every rank by the next agreement
            error = failure
        self._enqueue_batch(dataloader_iter, error)
        self._wait_sparse_data_dist(self.contexts[0])

    def _dequeue_batch(self) -> None:
        self.batches.popleft()
        self.contexts.popleft()
        if self.contexts and self._pipelined is not None:
            self._pipelined.set_context(self.contexts[0])

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        if not self._model_attached:
            self.attach()
        self._fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        if self._pipelined is not None:
            self._pipelined.set_context(self.contexts[0])
        training = self._trains and self._model.training
        if training:
            assert self._optimizer is not None
            self._optimizer.zero_grad()
        wait_for_batch(self.batches[0], self._memcpy_stream)
        wait_for_batch(self.batches[0], self._data_dist_stream)
        error = None
        # a call that raised StopIteration (execute_all_batches=False) launched the next batch's input dist already:
        # launching it again would run a second input dist for the batch and drop the first one's awaitables
        if len(self.batches) >= 2 and not self.contexts[1].input_dist_started:
            try:
                self._start_sparse_data_dist(self.batches[1], self.contexts[1])
            except Exception as failure:  # reported to every rank by the agreement inside _enqueue_batch
                error = failure
        # When no collective of the forward can use the groups a failed launch leaves unpaired (defers_agreement),
        # the ranks' agreement on this step (the batch after next, the failures so far) runs during the forward:
        # everyone learns of a failure before waiting on the next batch's input dist. Otherwise the ranks agree
        # before the forward: a sharded module running its own input dist in the forward shares the input-dist
        # group with the launch ahead, and an end of data that stops the step must stop it before its forward.
        deferred = self.defers_agreement
        pending = self._start_enqueue(dataloader_iter, error)
        if not deferred:
            self._finish_enqueue(pending)
        grad_mode = contextlib.nullcontext() if training else torch.no_grad()
        with record(f"## forward {self.contexts[0].index} ##"), grad_mode:
            result = self._model_fwd(self.batches[0])
        if deferred:
            self._finish_enqueue(pending)
        losses, output = split_model_output(result, self._fwd_name, training)
        if len(self.batches) >= 2:
            self._wait_sparse_data_dist(self.contexts[1])
        if training:
            backward(losses)
            with record(f"## optimizer {self.contexts[0].index} ##"):
                self._optimizer.step()  # type: ignore[union-attr]
        self._dequeue_batch()
        return output

    def _model_fwd(self, batch: Any) -> Any:
        return self._model(batch) if self._custom_model_fwd is None else self._custom_model_fwd(batch)

    @property
    def _fwd_name(self) -> str:
        return "model(batch)" if self._custom_model_fwd is None else "custom_model_fwd(batch)"

    def reset(self) -> None:
        """Drop the in-flight batches and the iterator (the model stays pipelined)."""
        self.batches.clear()
        self.contexts.clear()
        self._fetcher.close()

    def close(self) -> None:
        self._fetcher.close_thread()


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """:class:`TrainPipelineSparseDist` for evaluation: forward only (under ``torch.no_grad``), every batch run.

    Args (torchrec's order; ``host_prefetch`` and ``group`` keyword-only):
        model, device, apply_jit, pipeline_postproc, host_prefetch, group: as :class:`TrainPipelineSparseDist`.
        optimizer: accepted for torchrec's signature and ignored (may be None).
    """

    _trains = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        *,
        host_prefetch: int = 2,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=True,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            host_prefetch=host_prefetch,
            group=group,
        )


__all__ = ["EvalPipelineSparseDist", "TrainPipeline", "TrainPipelineBase", "TrainPipelineSparseDist", "backward"]
