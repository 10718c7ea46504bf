"""Gradient accumulation around any train pipeline (torchrec's ``GradientAccumulationConfig`` /
``GradientAccumulationWrapper``, same names and semantics).

The wrapper hands the pipeline an optimizer that clears gradients only at the start of an accumulation window and
steps only at its end, and runs the window's other micro-batches under ``no_sync()`` of every
``DistributedDataParallel`` in the model, so the dense gradients are all-reduced once per window. As in torchrec,
fused embedding tables still update inside every micro-batch's backward (their rule runs in the backward; there is no
gradient left to accumulate); only the optimizer the pipeline steps accumulates.

Where torchrec's flush at the end of the data steps the remaining micro-batches' gradients as they are, unsynced
when the last of them ran under ``no_sync`` (each rank then steps its own gradients and the replicas drift apart),
this one all-reduces them first, as DDP would have. The first step and ``num_warmup_steps`` steps always sync (DDP's
reducer must see a synced backward first; torchrec's rule).

Around a pipeline that does not train (:class:`EvalPipelineSparseDist`, which may hold no optimizer) the wrapper
passes every call through: it neither swaps nor steps the optimizer, so an evaluation between training windows
cannot step (or clear) the open window's gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tritonrec.dist.train_pipeline.base_pipeline import In, Out, TrainPipeline
from tritonrec.kernels.checks import check_int


@dataclass
class GradientAccumulationConfig:
    """``num_steps`` micro-batches per optimizer step (``> 1`` enables accumulation); the first
    ``num_warmup_steps`` steps all-reduce every micro-batch (at least 1)."""

    is_enabled: bool = False
    num_steps: int = 1
    num_warmup_steps: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.is_enabled, bool):
            raise TypeError(f"is_enabled must be a bool, got is_enabled={self.is_enabled!r}")
        self.num_steps = check_int(self.num_steps, "num_steps", 1)
        self.num_warmup_steps = check_int(self.num_warmup_steps, "num_warmup_steps", 1)
        if self.num_steps > 1:
            self.is_enabled = True


class _GAOptimizerWrapper:
    """The optimizer the pipeline sees: ``zero_grad`` at the start of a window, ``step`` at its end; everything
    else goes to the wrapped optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: GradientAccumulationConfig) -> None:
        self._optimizer = optimizer
        self._config = config
        self._current_step = 0
        self._needs_zero_grad = True

    def _should_step(self) -> bool:
        return (self._current_step + 1) % self._config.num_steps == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._needs_zero_grad:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            self._needs_zero_grad = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._should_step():
            self._optimizer.step(*args, **kwargs)
            self._needs_zero_grad = True

    def advance_step(self) -> None:
        self._current_step += 1

    def reset(self) -> None:
        self._current_step = 0
        self._needs_zero_grad = True

    def set_step(self, step: int) -> None:
        self._current_step = check_int(step, "step", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _ddp_modules(model: nn.Module) -> list[DistributedDataParallel]:
    """Every DDP in ``model`` (looked through DistributedModelParallel), outermost first."""
    root = getattr(model, "_dmp_wrapped_module", model)
    if not isinstance(root, nn.Module):
        return []
    return [m for m in root.modules() if isinstance(m, DistributedDataParallel)]


def _all_reduce_mean(ddp: DistributedDataParallel) -> None:
    """Average the gradients of the parameters ``ddp`` synchronises over its process group, as its reducer does: not
    those it was told to ignore (DistributedModelParallel's table shards, which differ per rank). A parameter without
    a gradient on some rank (unused there, ``find_unused_parameters``) counts as zeros, and gets the average wherever
    any rank used it; one no rank used keeps no gradient. A sparse gradient is averaged dense and stays sparse. One
    all-reduce: the gradients and the used-flags."""
    group = ddp.process_group
    size = dist.get_world_size(group)
    ignored = ddp.parameters_to_ignore
    params = [p for name, p in ddp.module.named_parameters() if name not in ignored and p.requires_grad]
    if size == 1 or not params:
        return
    # a sparse gradient (an nn.Embedding(sparse=True) in the dense part) travels dense and comes back sparse
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
             for p in params]  # fmt: skip
    used = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(size)
    flat = torch.cat([flat, used.to(flat.dtype)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g, anywhere in zip(params, grads, flat[-len(params) :].tolist(), strict=True):
        mean = flat[offset : offset + g.numel()].view_as(g)
        if anywhere > 0 and p.grad is not None and p.grad.is_sparse:
            p.grad = mean.to_sparse(p.grad.sparse_dim())
        elif anywhere > 0:
            p.grad = g if p.grad is None else p.grad
            p.grad.copy_(mean)
        offset += g.numel()


class GradientAccumulationWrapper(Generic[In, Out]):
    """Runs ``pipeline`` with gradient accumulation over ``config.num_steps`` micro-batches (see the module
    docstring). ``optimizer`` is the one the pipeline steps (it is swapped for the accumulating wrapper when
    accumulation is on); ``model`` the one it trains (its DDP modules skip the sync inside a window).

        pipeline = TrainPipelineSparseDist(model, optimizer, device)
        wrapped = GradientAccumulationWrapper(pipeline, optimizer, model, GradientAccumulationConfig(num_steps=4))
        while True:
            wrapped.progress(batches)  # StopIteration at the end, after stepping a partial last window
    """

    def __init__(
        self,
        pipeline: TrainPipeline[In, Out],
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        config: GradientAccumulationConfig,
    ) -> None:
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"config must be a GradientAccumulationConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self._accumulates = config.is_enabled and getattr(pipeline, "_trains", True)
        if self._accumulates and getattr(pipeline, "_optimizer", None) is not optimizer:
            raise ValueError(
                "optimizer must be the optimizer the pipeline steps (a StagedTrainPipeline leaves the step to its "
                "caller: accumulate there)"
            )
        self._pipeline = pipeline
        self._model = model
        self._config = config
        self._optimizer_wrapper = _GAOptimizerWrapper(optimizer, config)
        self._ddp: list[DistributedDataParallel] | None = None
        self._unsynced = False  # a micro-batch of the open window ran under no_sync
        if self._accumulates:
            pipeline._optimizer = self._optimizer_wrapper  # type: ignore[attr-defined]

    def _ddp_modules(self) -> list[DistributedDataParallel]:
        if self._ddp is None:
            self._ddp = _ddp_modules(self._model)
        return self._ddp

    def _should_sync_grad(self, is_last_batch: bool = False) -> bool:
        step = self.current_step
        if is_last_batch or step == 0 or step < self._config.num_warmup_steps:
            return True
        return (step + 1) % self._config.num_steps == 0

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for ddp in self._ddp_modules():
                stack.enter_context(ddp.no_sync())
            yield

    def _flush(self, steps_accumulated: int) -> bool:
        """Step a partial last window (its gradients all-reduced first if any micro-batch skipped the sync)."""
        if steps_accumulated % self._config.num_steps == 0:
            return False
        if self._unsynced:
            for ddp in self._ddp_modules():
                _all_reduce_mean(ddp)
            self._unsynced = False
        optimizer = self._optimizer_wrapper._optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._optimizer_wrapper._needs_zero_grad = False
        return True

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: bool | None = None) -> Out:
        """One micro-batch through the pipeline; ``is_last_batch=True`` syncs it and steps a partial window."""
        if not self._accumulates:
            return self._pipeline.progress(dataloader_iter)
        sync = self._should_sync_grad(bool(is_last_batch))
        try:
            with contextlib.nullcontext() if sync else self._no_sync():
                result = self._pipeline.progress(dataloader_iter)
        except StopIteration:
            self._flush(self.current_step)
            raise
        # a synced backward all-reduced everything accumulated so far (DDP reduces the summed .grad)
        self._unsynced = not sync
        self._optimizer_wrapper.advance_step()
        if is_last_batch:
            self._flush(self.current_step)
        return result

    def attach(self, model: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        """The pipeline's ``attach``; a new ``model`` is also the one whose DDP modules skip the sync from now on.

        (torchrec's wrapper keeps skipping the old model's, so the new one all-reduces every micro-batch.)"""
        if model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
            if self._unsynced:
                raise RuntimeError(
                    "attach(model) inside an accumulation window: the open window's gradients were not all-reduced "
                    "yet; attach a new model at a window boundary (after the optimizer step)"
                )
            self._model, self._ddp = model, None
        self._pipeline.attach(model, *args, **kwargs)  # type: ignore[attr-defined]

    def reset(self) -> None:
        """Start counting windows again (and reset the pipeline when it can)."""
        self._optimizer_wrapper.reset()
        self._unsynced = False
        if hasattr(self._pipeline, "reset"):
            self._pipeline.reset()

    @property
    def optimizer_wrapper(self) -> _GAOptimizerWrapper:
        return self._optimizer_wrapper

    @property
    def current_step(self) -> int:
        """Micro-batches run since the start (or :meth:`reset` / :meth:`set_step`)."""
        return self._optimizer_wrapper._current_step

    def set_step(self, step: int) -> None:
        self._optimizer_wrapper.set_step(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)


__all__ = ["GradientAccumulationConfig", "GradientAccumulationWrapper"]
