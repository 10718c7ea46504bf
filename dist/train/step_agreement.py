"""What every rank of the distributed job must agree on after each step: whether any rank received SIGTERM, and
whether any rank's training loss or scores left the finite numbers. One all-reduce of ``4 W`` float64s a step on the
job's gloo side group, where the SIGTERM flag alone used to travel.

Each rank fills its own four slots ``(signal, non-finite step, loss, scores hold NaN)`` and leaves the others zero,
so a sum gives every rank every rank's values. A rank that stops on its own (a NaN only it saw) would leave the others
waiting in the next collective; agreeing first makes every rank raise the same :class:`NonFiniteLossError` at the same
step, naming the ranks that saw it.

On CPU the loss is read at its own step. On an accelerator, reading it back would stall the pipeline every step, so
the check is copied to pinned host memory without waiting and read at the next step's agreement: a diverged step is
then reported one step later (the error still names its step), and the job's last step is covered by the loss check
of its final log step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.train.launch import StopRequest
from tritonrec.dist.train.loop import NonFiniteLossError, nonfinite_step_message

_SLOTS = 4  # per rank: signal, non-finite step (0: none), loss, scores hold NaN (0 / 1)


class _StepCheck:
    """One step's ``[non-finite, loss, scores hold NaN]`` on the host, possibly still being copied there."""

    def __init__(self, step: int, loss: torch.Tensor, logits: torch.Tensor) -> None:
        loss, logits = loss.detach(), logits.detach()
        values = torch.stack([
            (~torch.isfinite(loss).all() | torch.isnan(logits).any()).double(),
            loss.double().sum(),  # the scalar loss itself
            torch.isnan(logits).any().double(),
        ])  # fmt: skip
        self.step = step
        self._event = None
        if values.device.type == "cpu":
            self._host = values
        else:
            self._host = torch.empty(3, dtype=torch.float64, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.Event(values.device.type)
            self._event.record()

    def read(self) -> tuple[bool, float, bool]:
        if self._event is not None:
            self._event.synchronize()
        flag, loss, scores_nan = self._host.tolist()
        return bool(flag), loss, bool(scores_nan)


class JobStepAgreement:
    """The training job's per-step agreement (see module docstring; the train pipelines' own agreement on batches
    and stage failures is :class:`tritonrec.dist.train_pipeline.agreement.StepAgreement`). Call :meth:`note` with
    each step's output, then :meth:`agree` (every rank, every step)."""

    def __init__(self, stop: StopRequest, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self._stop = stop
        self._group = group
        self._lagged = device.type != "cpu"
        self._unread: _StepCheck | None = None
        self._ready: _StepCheck | None = None

    def note(self, step: int, output: Any) -> None:
        """Record step ``step``'s model output ``(loss, logits, labels)`` for the next :meth:`agree`."""
        loss, logits = output[0], output[1]
        check = _StepCheck(step, loss, logits)
        if self._lagged:  # read the previous step's check, whose copy is long done
            self._ready, self._unread = self._unread, check
        else:
            self._ready = check

    def agree(self) -> bool:
        """One all-reduce: :class:`NonFiniteLossError` on every rank when a rank's checked step diverged, else
        whether any rank received SIGTERM (then every rank's :class:`StopRequest` knows the signal)."""
        world = 1 if self._group is None else dist.get_world_size(self._group)
        rank = 0 if self._group is None else dist.get_rank(self._group)
        slots = torch.zeros(world, _SLOTS, dtype=torch.float64)
        slots[rank, 0] = self._stop.signal or 0
        ready, self._ready = self._ready, None
        if ready is not None:
            nonfinite, loss, scores_nan = ready.read()
            if nonfinite:
                slots[rank, 1:] = torch.tensor([ready.step, loss, float(scores_nan)], dtype=torch.float64)
        if self._group is not None:
            dist.all_reduce(slots, group=self._group)
        _raise_if_diverged(slots)
        signal = int(slots[:, 0].max().item())
        if signal and not self._stop.requested:
            self._stop.signal = signal
        return bool(signal)


def _raise_if_diverged(slots: torch.Tensor) -> None:
    """``slots [W, 4]`` summed over ranks -> :class:`NonFiniteLossError` naming the step and each rank that saw it."""
    diverged = [r for r in range(slots.shape[0]) if slots[r, 1] > 0]
    if not diverged:
        return
    step = int(min(slots[r, 1].item() for r in diverged))
    seen = [r for r in diverged if int(slots[r, 1].item()) == step]
    losses = ", ".join(f"{_format(slots[r, 2].item())} on rank {r}" for r in seen)
    scores_nan = any(slots[r, 3].item() > 0 for r in seen)
    raise NonFiniteLossError(nonfinite_step_message(step, losses, scores_nan))


def _format(loss: float) -> str:
    return str(loss) if not math.isfinite(loss) else f"{loss:.6g}"


__all__ = ["JobStepAgreement"]
