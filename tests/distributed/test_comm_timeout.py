"""A rank that never joins a collective makes the others fail with a clear timeout error naming the collective.

Rank 1 joins the group setup and one forward, then stays away; rank 0 meets five stuck collectives, each on its own
group (a timed-out collective leaves its group unusable): the per-collective timeout on a forward, on the sparse
all-to-all's first round and on a backward, the process group's own timeout (no per-collective one set), and the
metadata check that comes before a checked call's collective. The first four run with the metadata checks off
(``TRITONREC_DIST_CHECKS=0``) so that they reach the real collectives. A side group made from a group with a short
timeout (:func:`~tritonrec.dist.side_groups.same_ranks_group`), and the pipelines' step agreement on one, time out
as that group does.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.spawned import spawn_ranks
from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.comm_ops import alltoall_pooled, reduce_scatter_base_pooled
from tritonrec.dist.comm_timeout import CollectiveTimeoutError, collective_timeout
from tritonrec.dist.dist_data import KJTAllToAll
from tritonrec.dist.side_groups import same_ranks_group
from tritonrec.dist.train_pipeline import PipelineStage, StagedTrainPipeline
from tritonrec.dist.train_pipeline.agreement import Status, StepAgreement

pytestmark = pytest.mark.dist

PER_COLLECTIVE_S = 0.3
GROUP_TIMEOUT_S = 0.6
ABSENT_S = 6.0  # longer than every stuck collective on rank 0 together, with margin


def _outcome(attempt: Callable[[], Any]) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        attempt()
    except Exception as error:  # the test checks the type
        return type(error).__name__, str(error), time.monotonic() - started
    return "none", "", time.monotonic() - started


def _stuck_collectives(rank: int, world: int) -> dict[str, tuple[str, str, float]]:
    os.environ["TRITONREC_DIST_CHECKS"] = "0"
    forward_group, kjt_group, backward_group, check_group = (dist.new_group() for _ in range(4))
    short_group = dist.new_group(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    side_group = same_ranks_group(short_group, "timeout_test")  # must time out as its parent does
    agreement = StepAgreement(short_group)  # its own side group of short_group
    # a staged pipeline whose step agreement is in flight during the forward (deferred): the forward hook's wait
    staged = StagedTrainPipeline([PipelineStage("copy", lambda b: b)], group=short_group)
    embs = torch.ones(2, 1, requires_grad=True)
    joined = alltoall_pooled(embs, [1, 1], [1, 1], group=backward_group).wait()  # both ranks join this one
    if rank == 1:
        time.sleep(ABSENT_S)  # never joins anything else
        return {}
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(2), lengths=torch.tensor([1, 1]))
    outcomes = {}
    with collective_timeout(PER_COLLECTIVE_S):
        outcomes["forward"] = _outcome(lambda: alltoall_pooled(embs, [1, 1], [1, 1], group=forward_group).wait())
        outcomes["kjt"] = _outcome(lambda: KJTAllToAll(kjt_group, [1, 1])(kjt).wait())
        outcomes["backward"] = _outcome(lambda: joined.sum().backward())
    outcomes["group_timeout"] = _outcome(lambda: reduce_scatter_base_pooled(torch.ones(2, 1), short_group).wait())
    outcomes["side_group"] = _outcome(lambda: dist.all_reduce(torch.ones(1), group=side_group))
    outcomes["agreement"] = _outcome(lambda: agreement.agree(Status.OK))
    staged._pending = staged._fetcher.start(iter([1]), None, "", [])
    outcomes["staged_deferred"] = _outcome(staged._finish_deferred_agreement)  # raises: nothing more to wait on
    os.environ["TRITONREC_DIST_CHECKS"] = "1"
    with collective_timeout(PER_COLLECTIVE_S):
        outcomes["check"] = _outcome(lambda: alltoall_pooled(embs, [1, 1], [1, 1], group=check_group).wait())
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[str, str, float]]:
    return spawn_ranks(_stuck_collectives, 2, timeout=60)[0]


@pytest.mark.parametrize(
    ("attempt", "collective", "limit_s"),
    [
        ("forward", "alltoall_pooled timed out after 0.3 s", PER_COLLECTIVE_S),
        ("kjt", "KJTAllToAll splits timed out after 0.3 s", PER_COLLECTIVE_S),
        ("backward", "alltoall_pooled backward timed out after 0.3 s", PER_COLLECTIVE_S),
        ("group_timeout", "reduce_scatter_base_pooled timed out (process group timeout)", GROUP_TIMEOUT_S),
        ("agreement", "train pipeline step agreement timed out (process group timeout)", GROUP_TIMEOUT_S),
        ("staged_deferred", "train pipeline step agreement timed out (process group timeout)", GROUP_TIMEOUT_S),
        ("check", "alltoall_pooled (metadata check) timed out after 0.3 s", PER_COLLECTIVE_S),
    ],
)
def test_absent_rank_gives_named_timeout(
    outcomes: dict[str, tuple[str, str, float]], attempt: str, collective: str, limit_s: float
) -> None:
    error_name, message, elapsed = outcomes[attempt]
    assert error_name == CollectiveTimeoutError.__name__, f"{error_name}: {message}"
    assert collective in message, message
    assert "rank 0 of a group of 2" in message, message
    assert elapsed < limit_s + 2.0, f"took {elapsed:.1f} s, so it waited past the timeout"


def test_side_group_times_out_as_its_parent(outcomes: dict[str, tuple[str, str, float]]) -> None:
    """A side group (the pipelines' step agreement, the input dists) waited 30 minutes, torch's gloo default, for a
    peer that never came, where its parent group gives up after its own timeout."""
    error_name, message, elapsed = outcomes["side_group"]
    assert error_name != "none", "the all-reduce with an absent peer returned"
    assert elapsed < GROUP_TIMEOUT_S + 1.0, f"took {elapsed:.1f} s ({error_name}: {message}): not the parent's timeout"


def test_timeout_error_is_a_timeout_error() -> None:
    assert issubclass(CollectiveTimeoutError, TimeoutError) and issubclass(CollectiveTimeoutError, RuntimeError)
