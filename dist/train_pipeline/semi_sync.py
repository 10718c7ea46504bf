"""Semi-synchronous training (torchrec's ``TrainPipelineSemiSync``, our code): the embedding lookup of batch ``i+1``
is launched before batch ``i``'s backward, so its all-to-all overlaps batch ``i``'s backward and optimizer step.

What stays stale. Tables with a fused optimizer (the default for sharded tables) update inside the backward. From
batch ``start_batch + 1`` on, batch ``j``'s lookup runs before batch ``j-1``'s backward: it reads the tables as they
were after batch ``j-2``'s update (one step of staleness), and batch ``j``'s gradient (computed from those rows)
is applied to the tables as they are after batch ``j-1``'s update. Before that (``j <= start_batch``) the lookup runs
after the previous optimizer step, and training equals :class:`TrainPipelineSparseDist` bit for bit. The dense
part is synchronous, unless ``stash_gradients``: then, from ``start_batch`` on, the dense optimizer applies each
batch's gradients one step later (none at ``start_batch``; the last batch's stay stashed at the end of the data).

Each step (``i >= start_batch``)::

    launch input dist of i+2 | forward i | lookup i+1 | agree, read i+3 | wait splits i+2 | backward i | step
    (i < start_batch:  launch input dist of i+2 | forward i | backward i | step | lookup i+1 | agree ...)

The forward of a pipelined sharded module returns the lookup launched for its batch, detached: ``loss.backward()``
stops there, and the pipeline then back-propagates the gradients it left on the detached outputs through the
lookups (the fused update). Each step the ranks agree once (:mod:`.agreement`), after every launch of the step and
before anything waits on it: an input dist or lookup that raised on one rank raises on every rank, and uneven ends
stop every rank at the same step. Two limits: in the synchronous phase the agreement follows the step's update (the
lookup it covers must read that update), so a failure raised there comes after batch ``i`` trained; and within an
output dist's first 8 calls, whose metadata check blocks (:mod:`tritonrec.dist.comm_consistency`), a lookup that
raises on one rank before its output dist leaves the others in that check until the group's timeout.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.record import record
from tritonrec.dist.train_pipeline.agreement import Status, StepAgreement, renew_input_dist_groups
from tritonrec.dist.train_pipeline.base_pipeline import In, Out, backward
from tritonrec.dist.train_pipeline.checks import check_bool, split_model_output
from tritonrec.dist.train_pipeline.fetch import NEXT_BATCH, BatchFetcher
from tritonrec.dist.train_pipeline.pipelines import START_SPARSE_DATA_DIST, TrainPipelineSparseDist
from tritonrec.dist.train_pipeline.semi_sync_forward import EmbeddingPipelinedForward, SemiSyncContext, wait_request
from tritonrec.dist.train_pipeline.tracing import TrainPipelineContext
from tritonrec.dist.train_pipeline.utils import stream_context, to_device, wait_for_batch
from tritonrec.kernels.checks import check_int

logger = logging.getLogger(__name__)

START_EMBEDDING_LOOKUP = "start_embedding_lookup"
Failure = tuple[BaseException, str] | None  # (error, stage) of a launch on this rank, reported at the next agreement

# torchrec's memory and 2D-sharding options tritonrec has nothing for: accepted only at their defaults
_REFUSED = {
    "enable_inplace_copy_batch": "batches are copied to the device into new tensors",
    "free_features_storage_early": "the features' storage is freed with the batch",
    "clear_data_dist_inputs": "the input dists' inputs are released with their context",
}


class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out]):
    """Semi-synchronous pipeline: batch ``i+1``'s lookup (and its all-to-all) is launched before batch ``i``'s
    backward, so it reads embeddings one update behind (see the module docstring for what stays stale).

    Args (torchrec's, in its order):
        model, optimizer, device, custom_model_fwd: as :class:`TrainPipelineSparseDist`. ``optimizer`` should hold
            the dense parameters only (fused tables update in their backward): see ``strict``.
        execute_all_batches: at the end of the data, train the batches in flight (True), or stop with
            ``StopIteration`` after the step that found the end, leaving the 2 batches in flight queued (their lookup
            and input dist launched) for a new iterator to train first (False). torchrec accepts False but drains.
        apply_jit: False only (True raises NotImplementedError, as in the sparse-dist pipeline).
        start_batch: batches with index below it train synchronously (torchrec's default 900); non-negative int.
        stash_gradients: from ``start_batch`` on, the dense optimizer steps each batch's gradients one step late.
        pipeline_postproc: False only (torchrec's default is True; tritonrec does not pipeline postprocs).
        strict: raise ValueError (else log a warning) when ``optimizer`` holds a pipelined module's parameters.
        dmp_collection_sync_interval_batches: a positive int or None; it applies to torchrec's 2D-sharding
            ``DMPCollection``, which tritonrec does not have, so it has no effect.
        enable_inplace_copy_batch, free_features_storage_early, clear_data_dist_inputs: False only (torchrec's
            memory options; True raises NotImplementedError).
    Keyword-only (tritonrec's): ``host_prefetch``, ``group`` as :class:`TrainPipelineSparseDist`.

    The per-batch context is :class:`SemiSyncContext` (torchrec's pipeline takes no ``context_type`` either).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        host_prefetch: int = 2,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(model, optimizer, device, execute_all_batches, apply_jit, SemiSyncContext,
                         pipeline_postproc, custom_model_fwd, host_prefetch=host_prefetch, group=group)  # fmt: skip
        self._start_batch = check_int(start_batch, "start_batch", 0, what="a non-negative int")
        self._stash_gradients = check_bool(stash_gradients, "stash_gradients")
        self._strict = check_bool(strict, "strict")
        if dmp_collection_sync_interval_batches is not None:
            check_int(dmp_collection_sync_interval_batches, "dmp_collection_sync_interval_batches", 1,
                      what="a positive int or None")  # fmt: skip
        refused = {"enable_inplace_copy_batch": enable_inplace_copy_batch,
                   "free_features_storage_early": free_features_storage_early,
                   "clear_data_dist_inputs": clear_data_dist_inputs}  # fmt: skip
        for name, value in refused.items():
            if check_bool(value, name):
                raise NotImplementedError(f"{name}=True is not supported ({_REFUSED[name]}); pass {name}=False")
        # the lookups report their failures in the step's agreement too: a stage list of our own
        self._fetcher = BatchFetcher(
            StepAgreement(group, [NEXT_BATCH, START_SPARSE_DATA_DIST, START_EMBEDDING_LOOKUP]), host_prefetch
        )
        self._fetcher.agreement.on_failure.append(renew_input_dist_groups)
        self._gradients: dict[str, torch.Tensor | None] = {}
        self._stopped = False  # execute_all_batches=False: the ranks agreed the data is over
        self._flushed = False  # flush() dropped the batches in flight: progress refuses to go on (see there)

    # ------------------------------------------------------------------------------------------------ the model
    def _rewrite(self, context: TrainPipelineContext) -> None:
        super()._rewrite(context)
        assert self._pipelined is not None
        for name, forward in list(self._pipelined.forwards.items()):
            semi = EmbeddingPipelinedForward(name, forward.call_args, forward.module, context, forward.stream)
            forward.module.forward = semi  # type: ignore[method-assign]
            self._pipelined.forwards[name] = semi
        self._validate_optimizer()

    def _validate_optimizer(self) -> None:
        """A pipelined module's parameters stepped by ``optimizer`` would be stepped on stale lookups' gradients."""
        assert self._pipelined is not None
        held = {id(p) for g in self._optimizer.param_groups for p in g["params"]}  # type: ignore[union-attr]
        for name, forward in self._pipelined.forwards.items():
            if any(id(p) in held for p in forward.module.parameters()):
                message = (f"optimizer holds parameters of pipelined module {name!r}, whose lookups run one step "
                           "stale under semi-sync (give the optimizer the dense parameters only)")  # fmt: skip
                if self._strict:
                    raise ValueError(f"{message}; strict=True refuses it")
                logger.warning(message)

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """As :meth:`TrainPipelineSparseDist.attach` (every rank at the same step); the batches in flight keep the
        lookups launched before :meth:`detach`. ``sparse_dist=True`` launches the next batch's input dist and lookup
        if it has none."""
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        check_bool(sparse_dist, "sparse_dist")
        self.detach()
        if model is not None:
            self._model = model
        self._model_attached = True
        if not self.contexts:
            return  # the next fill traces the model
        self._rewrite(self.contexts[0])
        for _ in range(2):  # (input dist, then lookup) of the batch next in line, when it has neither
            if not sparse_dist or self._head_ready():
                return
            failure = self._launch_ahead()
            error, stage = failure if failure is not None else (None, None)
            self._fetcher.agreement.start(Status.OK, error, stage).result()
            self._wait_ahead()

    def is_semi_sync(self) -> bool:
        """Whether the next batch trains semi-synchronously (its index is at least ``start_batch``)."""
        return bool(self.contexts) and self.contexts[0].index >= self._start_batch

    # ------------------------------------------------------------------------------------------------ the stages
    def _contexts(self, k: int) -> SemiSyncContext:
        return self.contexts[k]  # type: ignore[return-value]

    def _pipelines(self) -> bool:
        return self._pipelined is not None and bool(self._pipelined.forwards)

    def _start_embedding_lookup(self, context: SemiSyncContext) -> None:
        if not self._pipelines():
            return
        assert self._pipelined is not None
        with record(f"## start_embedding_lookup {context.index} ##"):
            for forward in self._pipelined.forwards.values():
                forward.start_lookup(context)  # type: ignore[attr-defined]

    @staticmethod
    def _attempt(stage: str, launch: Callable[..., None], *args: Any) -> Failure:
        try:
            launch(*args)
        except Exception as error:  # reported to every rank by the next agreement
            return error, stage
        return None

    def _head_ready(self) -> bool:
        return not self._pipelines() or self._contexts(0).lookup_started

    def _launch_ahead(self) -> Failure:
        """Launch what the batches in flight lack: batch 0's input dist or (splits done) its lookup, then batch 1's
        input dist. Returns this rank's failure, for the next agreement."""
        if not self.batches:
            return None
        if self._pipelined is None:
            self._init_pipelined_modules(self.contexts[0])
        head = self._contexts(0)
        failure: Failure = None
        if not self._head_ready():
            if head.input_dist_tensors_requests:
                failure = self._attempt(START_EMBEDDING_LOOKUP, self._start_embedding_lookup, head)
            elif not head.input_dist_started:
                failure = self._attempt(START_SPARSE_DATA_DIST, self._start_sparse_data_dist, self.batches[0], head)
        if len(self.batches) >= 2 and failure is None:
            second = self._contexts(1)
            if not (second.input_dist_started or second.lookup_started):
                failure = self._attempt(START_SPARSE_DATA_DIST, self._start_sparse_data_dist, self.batches[1], second)
        return failure

    def _wait_ahead(self) -> None:
        """Finish the split-size rounds of batches 0 and 1 (after the agreement that covered their launch)."""
        for k in range(min(2, len(self.contexts))):
            if self.contexts[k].input_dist_splits_requests:
                self._wait_sparse_data_dist(self.contexts[k])

    def _agree_and_enqueue(self, dataloader_iter: Iterator[In], failure: Failure) -> bool:
        """The step's agreement (this rank's failure, whether it has a batch): queue the next batch, start its copy."""
        error, stage = failure if failure is not None else (None, None)
        pending = self._fetcher.start(dataloader_iter, error, stage)
        if pending.local is not None:
            with record("## copy_batch_to_device ##"), stream_context(self._memcpy_stream):
                pending.local = to_device(pending.local, self._device, non_blocking=True)
        batch = pending.result()
        if batch is None:
            self._stopped = not self._execute_all_batches
            return False
        self.batches.append(batch)
        self.contexts.append(SemiSyncContext(index=self._next_index))
        self._next_index += 1
        return True

    def _fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        """Up to 3 batches in flight: batch 0 with its lookup launched, batch 1 with its input dist's tensors in
        flight, batch 2 copied. Draining (or stopped on this iterator), nothing is read."""
        if len(self.batches) >= 3:
            return
        if self.batches and (self._execute_all_batches or self._fetcher.is_current(dataloader_iter)):
            return
        self._stopped = False
        while len(self.batches) < 3:
            enqueued = self._agree_and_enqueue(dataloader_iter, self._launch_ahead())
            self._wait_ahead()
            if not enqueued:
                break
        if self.batches and not self._head_ready():  # the data ended before batch 0's lookup was launched
            self._agree_and_enqueue(dataloader_iter, self._launch_ahead())

    def _embedding_backward(self, context: SemiSyncContext) -> None:
        """Back-propagate the gradients the dense backward left on the detached lookup outputs (fused update)."""
        pairs = [(t, d.grad) for t, d in zip(context.embedding_tensors, context.detached_embedding_tensors,
                                             strict=True) if d.grad is not None]  # fmt: skip
        if len(pairs) < len(context.embedding_tensors) and context.index == 0:
            unused = [k for k, d in zip(context.embedding_features, context.detached_embedding_tensors, strict=True)
                      if d.grad is None]  # fmt: skip
            logger.warning("semi-sync: no gradient reached the embeddings of %s", unused)
        if pairs:
            with record(f"## emb_backward {context.index} ##"):
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _grad_swap(self) -> None:
        """Each parameter takes the gradient stashed last step and stashes this step's (none: it steps nothing
        now, and the stash is used once; torchrec would apply a stale stash again)."""
        for name, param in self._model.named_parameters():
            stashed = self._gradients.pop(name, None)
            if param.grad is not None:
                self._gradients[name] = param.grad.clone()
            param.grad = stashed

    def _step(self, context: SemiSyncContext, losses: torch.Tensor, semi: bool) -> None:
        backward(losses)
        self._embedding_backward(context)
        with record(f"## optimizer {context.index} ##"):
            if semi and self._stash_gradients:
                self._grad_swap()
            if not (self._stash_gradients and context.index == self._start_batch):  # nothing stashed yet
                self._optimizer.step()  # type: ignore[union-attr]

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        if self._flushed:
            raise RuntimeError(
                "TrainPipelineSemiSync.progress after flush(): the batches it had in flight were dropped, so going on "
                "would skip them; build a new pipeline (or call reset() to start over from a new iterator)"
            )
        if not self._model_attached:
            self.attach()
        self._fill_pipeline(dataloader_iter)
        if not self.batches or self._stopped:
            raise StopIteration
        context = self._contexts(0)
        assert self._pipelined is not None
        self._pipelined.set_context(context)
        semi = context.index >= self._start_batch
        training = self._model.training
        if training:
            self._optimizer.zero_grad()  # type: ignore[union-attr]
        wait_for_batch(self.batches[0], self._memcpy_stream)
        wait_for_batch(self.batches[0], self._data_dist_stream)
        # batch i+2's input dist goes ahead of the forward unless a sharded module running its own input dist in
        # the forward shares its group (a failed launch would mispair it before the agreement tells the ranks)
        early = self._pipelined.can_defer_agreement
        failure = None
        if early and len(self.batches) >= 3:
            failure = self._attempt(START_SPARSE_DATA_DIST, self._start_sparse_data_dist, self.batches[2],
                                    self.contexts[2])  # fmt: skip
        grad_mode = contextlib.nullcontext() if training else torch.no_grad()
        with record(f"## forward {context.index} ##"), grad_mode:
            result = self._model_fwd(self.batches[0])
        losses, output = split_model_output(result, self._fwd_name, training)
        self._dequeue_batch()
        if not early and len(self.batches) >= 2:
            failure = self._attempt(START_SPARSE_DATA_DIST, self._start_sparse_data_dist, self.batches[1],
                                    self.contexts[1])  # fmt: skip
        if not semi and training:  # synchronous: batch i+1's lookup reads batch i's update
            self._step(context, losses, semi)
        if self.batches and failure is None:
            failure = self._attempt(START_EMBEDDING_LOOKUP, self._start_embedding_lookup, self._contexts(0))
        self._agree_and_enqueue(dataloader_iter, failure)
        self._wait_ahead()
        if semi and training:  # semi-synchronous: batch i+1's lookup was launched before this update
            self._step(context, losses, semi)
        return output

    def flush(self) -> None:
        """End this pipeline's work before a checkpoint it will not train past (ours; torchrec has none): the
        gradients stashed by the last step are applied (``stash_gradients``), so the state holds every trained
        step's update, and the batches in flight are waited for (their collectives end on every rank) and dropped.
        Build a new pipeline to train on; it counts ``start_batch`` from 0."""
        if self._gradients:
            for name, param in self._model.named_parameters():
                param.grad = self._gradients.pop(name, None)
            self._optimizer.step()  # type: ignore[union-attr]
            self._optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        for context in self.contexts:
            for name, request in context.input_dist_splits_requests.items():
                context.input_dist_tensors_requests[name] = request.wait()
            context.input_dist_splits_requests.clear()
            for requests in (context.input_dist_tensors_requests, getattr(context, "embedding_a2a_requests", {})):
                for request in requests.values():
                    wait_request(request)
                requests.clear()
        self._flushed = self._flushed or bool(self.batches)  # only dropped batches make going on wrong
        self.batches.clear()
        self.contexts.clear()

    def reset(self) -> None:
        super().reset()
        self._stopped = False
        self._flushed = False


__all__ = ["EmbeddingPipelinedForward", "SemiSyncContext", "TrainPipelineSemiSync"]
