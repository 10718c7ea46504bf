"""``python -m tritonrec.dist.planner.calibrate``: the JSON it writes is what the planner reads (quick sweep, torch
twins; the spawned collective timing runs in the slow suite and, on the process group, in test_collective_plan)."""

from __future__ import annotations

import json

import pytest

from tritonrec.dist.planner import DEFAULT_COEFFICIENTS, Topology, load_perf_coefficients
from tritonrec.dist.planner.calibrate import calibrate, main


def test_cli_writes_coefficients_the_planner_reads(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = main(["--quick", "--skip-comms", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path / "c.json")])
    assert "wrote" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["measured_on"]["quick"] is True and data["measured_on"]["lookup_backend"] == "torch"
    coefficients = load_perf_coefficients(path, "cpu")
    assert coefficients.lookup.fwd_bytes_per_s > 0 and coefficients.lookup.bwd_bytes_per_s > 0
    assert Topology(2, "cpu", calibration=path).coefficients == coefficients


def test_calibrate_checks_its_input() -> None:
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        calibrate("tpu")
    with pytest.raises(ValueError, match="world_size must be an int >= 2, got world_size=1"):
        calibrate("cpu", world_size=1)


@pytest.mark.slow
@pytest.mark.dist
def test_cli_times_collectives_on_spawned_gloo_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = main(["--quick", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path / "c.json")])
    coefficients = load_perf_coefficients(path, "cpu")
    assert coefficients.measured_on["backend"] == "gloo"
    assert all(c.bytes_per_s > 0 and c.latency_s >= 0 for c in coefficients.comms.values())
    # measured on the ranks, not the defaults: the KJT all-to-all, host sharing, the quick sweep's group steps
    assert coefficients.input_dist.latency_s > 0 and coefficients.lookup.alone_speedup >= 1.0
    assert coefficients.input_dist != DEFAULT_COEFFICIENTS["cpu"].input_dist
    assert set(coefficients.group_step_s) == {"table_wise", "row_wise"}
    assert all(fwd > 0 and bwd > 0 for fwd, bwd in coefficients.group_step_s.values())
