"""Ranks agree, once per step, on whether every one of them has a batch and whether any stage failed.

Why: a rank whose data ends one step early, or whose data loader or stage raises, would otherwise leave the other
ranks blocked in the next collective until the process-group timeout (torchrec #2670, #189). Each step every rank
contributes its status (OK, EXHAUSTED or FAILED) to one tiny all-reduce; then all ranks take the same decision:
stop together at the first step some rank has no batch for, and raise together when some rank failed (the failing
rank re-raises its own error, the others a :class:`PipelineStageError` naming it).

The all-reduce runs on a side gloo group created once per default group, so it never interleaves with the model's
collectives: a rank that failed before launching a collective the others launched leaves the main group's order
unmatched, but the side group's order is always the same on every rank.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

_SIDE_GROUPS: dict[int, dist.ProcessGroup] = {}


class PipelineStageError(RuntimeError):
    """Raised on every rank when a pipeline stage failed on another rank (that rank raises its own error)."""

    def __init__(self, stage: str, failed_ranks: list[int], rank: int) -> None:
        self.stage = stage
        self.failed_ranks = failed_ranks
        super().__init__(
            f"pipeline stage {stage!r} failed on rank(s) {failed_ranks}; rank {rank} stops with them "
            f"(the failing rank raised the original error)"
        )


class Status(enum.IntEnum):
    OK = 0
    EXHAUSTED = 1
    FAILED = 2


def _side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the same ranks as ``group`` (created on first use; every rank must get here together)."""
    key = id(group)
    if key not in _SIDE_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _SIDE_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _SIDE_GROUPS[key]


class StepAgreement:
    """Per-step agreement of the ranks of ``group`` (default: the world; a no-op without torch.distributed).

    Args:
        group: the ranks that agree.
        stages: names of the stages that can fail, the same list on every rank (a failure is reported by its index,
            so every rank names the stage that failed).

    Every rank must call :meth:`agree` the same number of times, in the same order, which the pipelines guarantee
    by calling it at fixed points of each step.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stages: list[str] | None = None) -> None:
        self._group: dist.ProcessGroup | None = None
        self.stages = list(stages or ["next_batch"])
        self.rank, self.world_size = 0, 1
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            self._group = _side_group(group)
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def agree(self, status: Status, error: BaseException | None = None, failed_stage: str | None = None) -> bool:
        """Combine this rank's ``status`` with every other rank's; True when every rank has a batch.

        ``error`` (raised by ``failed_stage``, one of ``stages``) makes this rank's status FAILED. When any rank
        failed, raises on every rank: ``error`` on the failing rank, :class:`PipelineStageError` on the others.
        """
        code = int(status)
        if error is not None:
            code = int(Status.FAILED) + self.stages.index(failed_stage or self.stages[0])
        if self._group is None:
            codes = [code]
        else:
            flags = torch.zeros(self.world_size, dtype=torch.int32)
            flags[self.rank] = code
            dist.all_reduce(flags, group=self._group)
            codes = flags.tolist()
        failed = [r for r, c in enumerate(codes) if c >= Status.FAILED]
        if failed:
            if error is not None:
                raise error
            raise PipelineStageError(self.stages[codes[failed[0]] - Status.FAILED], failed, self.rank)
        return all(c == Status.OK for c in codes)


__all__ = ["PipelineStageError", "Status", "StepAgreement"]
