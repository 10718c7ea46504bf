"""``collective_plan`` on 2 real gloo ranks (one spawn for the module): every rank gets rank 0's plan (rank 1 is set up
so that planning locally would give another), the stats table is printed on rank 0 only, a planning error reaches
every rank, and the calibration's collective timing runs on the same process group."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from dist_utils import run_ranks

from tests.planner.planner_testing import Model, PlanOnlySharder, ebc, planner, topology
from tritonrec.dist.planner import EmbeddingStats, ParameterConstraints, PlannerError

pytestmark = pytest.mark.dist

SPECS = [(1000, 16), (200, 32), (5000, 8)]
ROW_WISE_ONLY = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(len(SPECS))}


def _rank_cases(rank: int, world: int) -> dict[str, Any]:
    import torch

    from tritonrec.dist.planner.calibrate import QUICK_MESSAGES, measure_collectives

    out: dict[str, Any] = {}
    lines: list[str] = []
    # rank 1's own planner may only use row-wise: had it planned itself, its plan would differ from rank 0's
    constraints = None if rank == 0 else ROW_WISE_ONLY
    plan = planner(topology(), stats=EmbeddingStats(out=lines.append), constraints=constraints)
    out["plan"] = str(plan.collective_plan(Model(ebc(SPECS)), [PlanOnlySharder()]))
    out["local_plan"] = str(planner(topology(), constraints=constraints).plan(Model(ebc(SPECS)), [PlanOnlySharder()]))
    out["reports"] = lines
    # rank 0 cannot fit the tables; rank 1 could: both must raise rank 0's error
    tight = planner(topology(ddr_cap=1000 if rank == 0 else 10**9))
    try:
        tight.collective_plan(Model(ebc(SPECS)), [PlanOnlySharder()])
        out["error"] = None
    except PlannerError as err:
        out["error"] = str(err)
    try:
        planner(topology(world_size=4)).collective_plan(Model(ebc(SPECS)), [PlanOnlySharder()])
    except ValueError as err:
        out["world_mismatch"] = str(err)
    out["collectives"] = measure_collectives(None, torch.device("cpu"), QUICK_MESSAGES, repeats=2)
    return out


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(_rank_cases, 2, timeout=180.0)


def test_every_rank_gets_rank_zeros_plan() -> None:
    results = _results()
    assert results[0]["plan"] == results[1]["plan"]
    assert results[1]["local_plan"] != results[1]["plan"]  # rank 1 really received it
    expected = planner(topology()).plan(Model(ebc(SPECS)), [PlanOnlySharder()])
    assert results[0]["plan"] == str(expected) == results[0]["local_plan"]


def test_stats_are_printed_on_rank_zero_only() -> None:
    reports = [r["reports"] for r in _results()]
    assert len(reports[0]) == 1 and reports[0][0].startswith("tritonrec planner: 2 ranks on cpu")
    assert reports[1] == []


def test_a_planning_error_reaches_every_rank() -> None:
    errors = [r["error"] for r in _results()]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "does not fit" in errors[0] and "1000 bytes" in errors[0]
    for result in _results():
        assert result["world_mismatch"] == "the process group has 2 ranks but the topology has 4"


def test_collective_calibration_measures_on_the_group() -> None:
    for result in _results():
        fitted = result["collectives"]
        assert set(fitted) == {"all_to_all", "reduce_scatter", "all_gather", "all_reduce"}
        for latency, rate in fitted.values():
            assert latency >= 0 and rate > 0
