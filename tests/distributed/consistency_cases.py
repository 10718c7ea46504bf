"""Rank-side cases of the collective metadata check (test_comm_consistency.py), on 2 gloo ranks.

Each case makes the two ranks call one collective with metadata that disagrees (rank 0's arguments first, rank 1's
second). Some disagreements keep the byte counts equal, which a backend cannot notice and which silently mixes data;
the others make the byte counts differ, which aborts the process inside gloo unless the check refuses the call first.
The cases run with ``TRITONREC_DIST_CHECKS=1``: the suites before this one in the same processes have used up the
functional ops' first checked calls. The default (the first calls of each module instance) is checked separately.
Refused calls issue no collective and leave the group healthy, which a consistent call checks afterwards.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import comm_ops
from tritonrec.dist.comm_timeout import collective_timeout
from tritonrec.dist.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll, PooledEmbeddingsReduceScatter

WORLD = 2
ENV = "TRITONREC_DIST_CHECKS"


def _pg() -> dist.ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def _zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


def _kjt(keys: list[str]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys, torch.arange(6), lengths=torch.ones(6, dtype=torch.int64))


def _pick(rank: int, first: Any, second: Any) -> Any:
    return first if rank == 0 else second


# case name -> rank -> the call (rank 0's arguments, then rank 1's)
SILENT_CASES: dict[str, Callable[[int], Any]] = {
    # equal byte counts: without the check, rank 1 reads rank 0's 2-wide rows as 4-wide ones
    "pooled/dims_and_batch": lambda r: comm_ops.alltoall_pooled(
        _pick(r, _zeros(6, 2), _zeros(4, 4)), _pick(r, [2, 4], [2, 2]), _pick(r, [2, 4], [4, 4])
    ).wait(),
    "kjt/splits": lambda r: KJTAllToAll(_pg(), _pick(r, [1, 2], [2, 1]))(_kjt(["a", "b", "c"])).wait().wait(),
    "kjt/keys": lambda r: KJTAllToAll(_pg(), [2, 1])(_kjt(_pick(r, ["a", "b", "c"], ["b", "a", "c"]))).wait().wait(),
}

ABORTING_CASES: dict[str, Callable[[int], Any]] = {
    # unequal byte counts: without the check, gloo aborts both processes
    "pooled/batch_sizes": lambda r: comm_ops.alltoall_pooled(_zeros(4, 1), _pick(r, [2, 2], [3, 1]), [1, 1]).wait(),
    "alltoallv/out_split": lambda r: comm_ops.alltoallv(
        [_pick(r, _zeros(4, 1), _zeros(4, 2))], out_split=_pick(r, [1, 1], [1, 2])
    ).wait(),
    "sequence/splits": lambda r: comm_ops.alltoall_sequence(
        _zeros(3 - r, 2), None, None, torch.tensor([3 - r]), [1, 1], _pick(r, [1, 2], [1, 1])
    ).wait(),
    "reduce_scatter_v/splits": lambda r: comm_ops.reduce_scatter_v_pooled(
        _zeros(4, 2), _pick(r, [2, 2], [3, 1])
    ).wait(),
    "reduce_scatter_module/branch": lambda r: PooledEmbeddingsReduceScatter(_pg())(
        _zeros(4, 2), _pick(r, None, [3, 1])
    ).wait(),
    "variable_batch/batch_sizes": lambda r: comm_ops.variable_batch_alltoall_pooled(
        _pick(r, _zeros(6), _zeros(4)), _pick(r, [[1], [2]], [[1], [1]]), [1, 1], [[2], [2]]
    ).wait(),
    # rank 0's input is wrong for its own metadata; without the check rank 1 waits in the collective forever
    "one_rank_rejects_its_input": lambda r: comm_ops.alltoall_pooled(
        _pick(r, _zeros(5, 1), _zeros(4, 1)), [2, 2], [1, 1]
    ).wait(),
}


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except Exception as error:  # every exception is recorded; the test checks the type
        return type(error).__name__, str(error) or traceback.format_exc()
    return "none", ""


def _healthy_after_refusals(rank: int) -> list[float]:
    """A consistent all-to-all after all the refused ones: the group still works and the data is right."""
    embs = torch.arange(4.0).reshape(2, 2) + 10 * rank  # rows 0, 1 go to ranks 0, 1; one column per rank
    return comm_ops.alltoall_pooled(embs[:, rank : rank + 1], [1, 1], [1, 1]).wait().reshape(-1).tolist()


def _check_counts(rank: int) -> dict[str, Any]:
    """By default the first call of a new module instance is checked; how many calls of one instance are checked:
    the first 8 by default, all with the variable at 1, none at 0; a bad value is refused."""
    disagreeing = PooledEmbeddingsAllToAll(_pg(), _pick(rank, [1, 1], [1, 2]))
    counts: dict[str, Any] = {"default_first_call": _outcome(lambda: disagreeing(torch.ones(2, 1 + rank)).wait())}
    a2a = PooledEmbeddingsAllToAll(_pg(), [1, 1])
    embs = torch.ones(2, 1)
    for setting in (None, "1", "0"):
        if setting is not None:
            os.environ[ENV] = setting
        for _ in range(10):
            a2a(embs).wait()
        counts[str(setting)] = a2a.metadata_check.checks_run
    os.environ[ENV] = "maybe"
    counts["bad_value"] = _outcome(lambda: a2a(embs).wait())
    del os.environ[ENV]
    counts["calls"] = a2a.metadata_check.calls
    return counts


def run_consistency_cases(rank: int, world: int) -> dict[str, Any]:
    assert world == WORLD
    outcomes: dict[str, Any] = {}
    with collective_timeout(20.0):
        os.environ[ENV] = "1"
        for name, call in {**SILENT_CASES, **ABORTING_CASES}.items():
            outcomes[name] = _outcome(lambda call=call: call(rank))
        outcomes["healthy_after_refusals"] = _healthy_after_refusals(rank)
        del os.environ[ENV]
        outcomes["check_counts"] = _check_counts(rank)
    return outcomes
