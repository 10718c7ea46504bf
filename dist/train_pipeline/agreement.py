"""Ranks agree, once per step, on whether every one of them has a batch and whether any stage failed.

Why: a rank whose data ends one step early, or whose data loader or stage raises, would otherwise leave the other
ranks blocked in the next collective until the process-group timeout (torchrec #2670, #189). Each step every rank
contributes its status (OK, EXHAUSTED or FAILED) to one tiny all-reduce; then all ranks take the same decision:
stop together at the first step some rank has no batch for, and raise together when some rank failed (the failing
rank re-raises its own error, the others a :class:`PipelineStageError` naming it and carrying its error's type and
message, which the ranks exchange only then).

The all-reduce runs on a side gloo group over the same ranks (:mod:`tritonrec.dist.side_groups`; a group that does
not span the world is used itself), so it never interleaves with the model's collectives: a rank that failed before
launching a collective the others launched leaves the main group's order unmatched, but the side group's order is
always the same on every rank.

The staged pipeline also carries, in the same tensor, which of its in-flight batches each rank dropped (a stage
returned None): ``slots`` more entries, summed over the ranks, so a batch any rank dropped is dropped on every rank.
The step still costs one all-reduce, of ``world_size + slots`` int32s.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.side_groups import INPUT_DIST, renew_side_groups, same_ranks_group
from tritonrec.kernels.checks import check_int


class PipelineStageError(RuntimeError):
    """Raised on every rank when a pipeline stage failed on another rank (that rank raises its own error).

    ``causes``: ``{rank: "Type: message"}`` of the failing ranks' own errors, which the ranks exchange when they agree
    on the failure, so this rank's log shows the root cause (a malformed line's file and line, say) and not only
    that another rank failed."""

    def __init__(self, stage: str, failed_ranks: list[int], rank: int, causes: dict[int, str] | None = None) -> None:
        self.stage = stage
        self.failed_ranks = failed_ranks
        self.rank = rank
        self.causes = dict(causes or {})
        raised = "".join(f"; rank {r} raised {cause}" for r, cause in sorted(self.causes.items()))
        super().__init__(
            f"pipeline stage {stage!r} failed on rank(s) {failed_ranks}{raised}; rank {rank} stops with them "
            f"(the failing rank raised the original error)"
        )

    def __reduce__(self) -> tuple[type, tuple[str, list[int], int, dict[int, str]]]:
        # pickled with its constructor's arguments (the default pickles only the message), so a spawned rank's
        # error reaches the launching process whole
        return type(self), (self.stage, self.failed_ranks, self.rank, self.causes)


class Status(enum.IntEnum):
    OK = 0
    EXHAUSTED = 1
    FAILED = 2


class StepAgreement:
    """Per-step agreement of the ranks of ``group`` (default: the world; a no-op without torch.distributed).

    Args:
        group: the ranks that agree.
        stages: names of the stages that can fail, the same list on every rank (a failure is reported by its index,
            so every rank names the stage that failed).
        slots: positions of in-flight batches a rank may report as dropped (:meth:`start`'s ``dropped``; 0: none).

    Every rank must call :meth:`agree` the same number of times, in the same order, which the pipelines guarantee
    by calling it at fixed points of each step.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stages: list[str] | None = None, slots: int = 0) -> None:
        slots = check_int(slots, "slots", 0)
        self._group: dist.ProcessGroup | None = None
        self.stages = list(stages or ["next_batch"])
        self.slots = slots
        # called on every rank, in order, when the ranks agree that one failed (before raising): work that must be
        # collective, as renewing the input dists' group
        self.on_failure: list[Callable[[], None]] = []
        self.rank, self.world_size = 0, 1
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            self._group = same_ranks_group(group, "agreement", backend="gloo")
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def agree(self, status: Status, error: BaseException | None = None, failed_stage: str | None = None) -> bool:
        """Combine this rank's ``status`` with every other rank's; True when every rank has a batch.

        ``error`` (raised by ``failed_stage``, one of ``stages``) makes this rank's status FAILED. When any rank
        failed, raises on every rank: ``error`` on the failing rank, :class:`PipelineStageError` on the others.
        """
        return self.start(status, error, failed_stage).result()

    def start(
        self,
        status: Status,
        error: BaseException | None = None,
        failed_stage: str | None = None,
        dropped: Iterable[int] = (),
    ) -> PendingAgreement:
        """:meth:`agree` in two halves: launch the all-reduce now, read the decision with ``.result()`` later (the
        pipelines do work in between that does not depend on it). Every rank must call ``result()`` before it waits
        on any collective a failed rank may not have launched.

        ``dropped``: the slots (``0 .. slots - 1``) this rank dropped since its last agreement; ``.dropped()`` gives
        the ones any rank dropped."""
        code = int(status)
        if error is not None:
            code = int(Status.FAILED) + self.stages.index(failed_stage or self.stages[0])
        # [world_size] status codes (one per rank), then [slots] drop counts: one tensor, one all-reduce
        world, dropped = max(self.world_size, 1), tuple(dropped)
        flags = torch.zeros(world + self.slots, dtype=torch.int32)
        flags[self.rank] = code
        for slot in dropped:
            if not 0 <= slot < self.slots:
                raise ValueError(f"dropped must hold slots in [0, {self.slots}), got {slot!r} in dropped={dropped!r}")
            flags[world + slot] = 1
        work = None if self._group is None else dist.all_reduce(flags, group=self._group, async_op=True)
        return PendingAgreement(self, flags, work, error)

    def exchange_errors(self, error: BaseException | None) -> dict[int, str]:
        """``{rank: "Type: message"}`` of every rank that failed, from each rank's ``error`` (collective: every rank
        calls it once the ranks agreed that one failed). An exchange that fails itself gives ``{}``: the stage's
        failure stays the error raised."""
        if self._group is None:
            return {}
        described = None if error is None else f"{type(error).__name__}: {error}"
        everyone: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, described, group=self._group)
        except Exception:
            return {}
        return {rank: cause for rank, cause in enumerate(everyone) if isinstance(cause, str)}


class PendingAgreement:
    """An agreement in flight (:meth:`StepAgreement.start`); :meth:`result` waits for it and decides, once."""

    def __init__(self, agreement: StepAgreement, flags: torch.Tensor, work: Any, error: BaseException | None) -> None:
        self._agreement, self._flags, self._work, self._error = agreement, flags, work, error
        self._decided: bool | None = None

    def wait(self) -> None:
        """Wait for the all-reduce (a rank that never comes: a CollectiveTimeoutError naming the agreement), without
        deciding yet."""
        if self._work is not None:
            wait_for_work(self._work, "train pipeline step agreement", self._agreement._group)
            self._work = None

    def result(self) -> bool:
        """True when every rank has a batch; raises on every rank when one failed (as :meth:`StepAgreement.agree`)."""
        if self._decided is None:
            self.wait()
            codes = self._flags.tolist()[: max(self._agreement.world_size, 1)]
            failed = [r for r, c in enumerate(codes) if c >= Status.FAILED]
            if failed:
                stage = self._agreement.stages[codes[failed[0]] - Status.FAILED]
                causes = self._agreement.exchange_errors(self._error)
                error = self._error or PipelineStageError(stage, failed, self._agreement.rank, causes)
                for hook in self._agreement.on_failure:
                    try:
                        hook()
                    except Exception as hook_error:  # the stage's failure stays the error raised
                        error.add_note(f"after it, {hook!r} failed too: {type(hook_error).__name__}: {hook_error}")
                raise error
            self._decided = all(c == Status.OK for c in codes)
        return self._decided

    def dropped(self) -> list[int]:
        """The slots any rank reported dropped (ascending), once :meth:`result` returned."""
        if self._decided is None:
            raise RuntimeError("dropped() is known only after result() returned")
        counts = self._flags.tolist()[max(self._agreement.world_size, 1) :]
        return [slot for slot, count in enumerate(counts) if count]


def renew_input_dist_groups() -> None:
    """The pipelines' ``on_failure`` hook: when a rank failed to launch an input dist the others launched, theirs stay
    unmatched on the input dists' side group, so every such group is replaced (collective, on every rank at the
    agreement) and the shardings move to the new ones (``EmbeddingSharding.input_dist_pg``)."""
    renew_side_groups(INPUT_DIST)


__all__ = ["PendingAgreement", "PipelineStageError", "Status", "StepAgreement", "renew_input_dist_groups"]
