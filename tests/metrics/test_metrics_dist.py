"""2 gloo ranks: the values reduced across ranks equal one process's values over the union of both ranks' data
(each step's batches concatenated, the same global window); local_compute sees only the rank's own data; only rank 0
reports without compute_on_all_ranks; a checkpoint restores the lifetime values. One spawn serves every case."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from dist_utils import run_ranks

from tests.metrics.dist_cases import BATCH, build, rank_stream, run_rank
from tritonrec.metrics import RecComputeMode

pytestmark = pytest.mark.dist
WORLD = 2
MODES = [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION]


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(run_rank, WORLD, timeout=120.0)


def _single_process(mode: RecComputeMode, steps: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    module = build(1, 0, len(next(iter(steps[0].values()))), mode)
    out = []
    for step in steps:
        module.update(step)
        out.append({key: float(value) for key, value in module.compute().items()})
    return out


def _union_steps() -> list[dict[str, torch.Tensor]]:
    per_rank = [rank_stream(rank) for rank in range(WORLD)]
    return [
        {key: torch.cat([steps[i][key] for steps in per_rank]) for key in per_rank[0][i]}
        for i in range(len(per_rank[0]))
    ]


def _assert_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        # the ranks add their float32 batch sums separately: float32 rounding, not an exact match
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_reduced_values_equal_single_process_over_the_union(mode: RecComputeMode) -> None:
    want = _single_process(mode, _union_steps())
    for rank, result in enumerate(_results()):
        assert len(result[mode.name]["compute"]) == len(want)
        for got_step, want_step in zip(result[mode.name]["compute"], want, strict=True):
            _assert_close(got_step, want_step)
        rank0_only = result[mode.name]["rank0_only"]
        if rank == 0:
            _assert_close(rank0_only[-1], want[-1])
        else:
            assert all(step == {} for step in rank0_only)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_local_compute_sees_only_the_ranks_own_data(mode: RecComputeMode) -> None:
    for rank, result in enumerate(_results()):
        # one process with this rank's data and the rank's local window (40 / 2 = 20 samples)
        module = build(WORLD, 0, BATCH, mode)
        for step in rank_stream(rank):
            module.update(step)
        _assert_close(result[mode.name]["local"], {k: float(v) for k, v in module.local_compute().items()})


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_restored_lifetime_values_are_reduced_over_the_ranks(mode: RecComputeMode) -> None:
    want = _single_process(mode, _union_steps())[-1]
    for result in _results():
        restored = result[mode.name]["restored"]
        lifetime = {key: value for key, value in want.items() if "|lifetime_" in key}
        _assert_close({key: restored[key] for key in lifetime}, lifetime)
        assert math.isnan(restored["ne-t0|window_ne"])  # the window restarts empty: 0 / 0, as torchrec
