"""The multi-process harness itself: results come back in rank order, failures and hangs surface as errors."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

pytestmark = pytest.mark.dist


def _all_reduce_rank(rank: int, world_size: int) -> list[float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.tolist()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def _sleep_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_in_rank_order() -> None:
    assert run_ranks(_all_reduce_rank, 2) == [[3.0], [3.0]]


def test_rank_error_is_reported() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*boom on rank one"):
        run_ranks(_fail_on_rank_one, 2)


def test_hung_rank_times_out_and_prints_where_it_hangs(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish"):
        run_ranks(_sleep_on_rank_zero, 2, timeout=15)  # generous: spawning is slow on a loaded machine
    assert "in _sleep_on_rank_zero" in capfd.readouterr().err  # the hung rank's stack, from faulthandler


def _tensors_by_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(3) + rank, "big": torch.full((300_000,), float(rank))}


def test_tensor_results_arrive_by_value() -> None:
    """Results larger than a pipe's buffer, with tensors: pickled in the rank, so no handle outlives the rank."""
    results = run_ranks(_tensors_by_rank, 2)
    for rank, result in enumerate(results):
        assert torch.equal(result["ids"], torch.arange(3) + rank) and bool((result["big"] == rank).all())
