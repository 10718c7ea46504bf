"""2 gloo ranks: the values reduced across ranks equal one process's values over the union of both ranks' data
(each step's batches concatenated, the same global window); local_compute sees only the rank's own data; only rank 0
reports without compute_on_all_ranks; a checkpoint restores the lifetime values; sync() makes local_compute report
the formulas over the union until unsync() (get_pre_compute_states() and load_pre_compute_states() are refused until
then); get_pre_compute_states() holds the union's sums and samples on every rank; a time-adjusted compute interval
is the largest any rank asks for, on every rank. One spawn serves every case."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from dist_utils import run_ranks

from tests.metrics.dist_cases import BATCH, TASKS, WINDOW, build, rank_stream
from tests.metrics.dist_sync_cases import INTERVAL_CASES, run_all, uneven_stream
from tests.metrics.reference import accuracy, auc, calibration, cat_steps, ctr, mae, mse, ne, rmse
from tests.metrics.test_compute_interval import formula_steps
from tritonrec.metrics import RecComputeMode

pytestmark = pytest.mark.dist
WORLD = 2
MODES = [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION]


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(run_all, WORLD, timeout=120.0)


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


REFERENCES = {"ne": ne, "ctr": ctr, "calibration": calibration, "accuracy": accuracy, "mse": mse, "rmse": rmse,
              "mae": mae, "auc": auc}  # fmt: skip


def _formulas_over_the_union() -> dict[str, float]:
    """Every key from the reference formulas: lifetime over both ranks' whole streams, window over each rank's last
    WINDOW / WORLD samples (the local windows), AUC window only (torchrec's)."""
    per_rank = [rank_stream(rank) for rank in range(WORLD)]
    local_window = WINDOW // WORLD
    want = {}
    for t, task in enumerate(TASKS):
        for scope in ("lifetime", "window"):
            start = -local_window if scope == "window" else 0
            p, y, w = (torch.cat([cat_steps(steps, f"{role}{t}")[start:] for steps in per_rank]) for role in "plw")
            for name, reference in REFERENCES.items():
                if name == "auc" and scope == "lifetime":
                    continue
                namespace = "mse" if name == "rmse" else name
                want[f"{namespace}-{task.name}|local_{scope}_{name}"] = reference(p, y, w)  # local_compute's keys
    return want


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_synced_local_compute_reports_the_formulas_over_the_union_until_unsync(mode: RecComputeMode) -> None:
    want = _formulas_over_the_union()
    for result in _results():
        cases = result["sync"][mode.name]
        synced = cases["synced_local"]
        _assert_close(synced, want)
        # compute() while synced evaluates the synced states without reducing them a second time
        assert {key.replace("|", "|local_"): value for key, value in cases["synced_compute"].items()} == synced
        assert "already been synced" in cases["sync_twice"]
        assert "update while synced: call unsync() first" in cases["update_while_synced"]
        for name, action in (("states_while_synced", "get"), ("load_while_synced", "load")):
            message = f"RecMetricModule.{action}_pre_compute_states while synced (metric 'ne'): call unsync() first"
            assert cases[name] == message
        assert cases["synced_local_after_refusals"] == synced  # the refusals left the synced states as they were
        # unsync brings back the rank's own states (the update tried while synced was refused)
        assert cases["unsynced_local"] == cases["local"]
        # a fresh module loading the pre-compute states reports the same global values, with no collective
        assert cases["loaded_local"] == cases["synced_local"]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pre_compute_states_hold_the_unions_sums_on_every_rank(mode: RecComputeMode) -> None:
    results = [result["sync"][mode.name] for result in _results()]
    per_rank = [rank_stream(rank) for rank in range(WORLD)]
    fused = mode == RecComputeMode.FUSED_TASKS_COMPUTATION
    for t in range(len(TASKS)):
        y, w = (torch.cat([cat_steps(steps, f"{role}{t}") for steps in per_rank]).double() for role in "lw")
        for result in results:
            ctr_states = result["states"]["ctr"]["t0" if fused else f"t{t}"]
            row = t if fused else 0
            assert float(ctr_states["ctr_num"][row]) == pytest.approx(float((w * y).sum()), rel=1e-6)
            assert float(ctr_states["ctr_denom"][row]) == pytest.approx(float(w.sum()), rel=1e-6)
    for result in results:
        for states in (result["states"], result["mesh_states"]):
            _assert_same_states(states, results[0]["states"])


def _assert_same_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for namespace in want:
        if namespace == "throughput":
            continue
        for task in want[namespace]:
            assert got[namespace][task].keys() == want[namespace][task].keys()
            for name, value in want[namespace][task].items():
                other = got[namespace][task][name]
                if isinstance(value, list):
                    assert len(other) == len(value) and all(map(torch.equal, other, value)), (namespace, name)
                else:
                    assert torch.equal(other, value), (namespace, task, name)


def test_pre_compute_states_gather_auc_samples_of_unequal_counts_in_rank_order() -> None:
    for result in _results():
        states = result["sync"]["uneven_auc"]
        for name, role in (("predictions", "p"), ("labels", "l"), ("weights", "w")):
            want = torch.cat([cat_steps(uneven_stream(rank), f"{role}0") for rank in range(WORLD)])
            assert len(states[name]) == 1
            assert torch.equal(states[name][0], want[None].float())


def test_adjusted_compute_interval_is_the_largest_rank_wish_on_every_rank() -> None:
    """torchrec all-reduces the new steps with MAX; a rank whose interval lay inside the range offers its current
    steps (in torchrec it skips the all-reduce: the other ranks hang)."""
    steps, low, high, clocks = INTERVAL_CASES["both_outside"]
    want = {
        "both_outside": max(formula_steps(steps, low, high, clock) for clock in clocks),  # 60: rank 0's
        "inside_and_slow": 10,
        "inside_and_fast": 80,
    }
    assert want["both_outside"] == 60
    for result in _results():
        assert result["interval"] == want
