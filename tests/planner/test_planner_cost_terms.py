"""The perf model's fixed-cost and host-sharing terms (no processes): what a row split divides and what it does not,
the per-group costs (KJT all-to-all, bucketize, measured group steps), ranks sharing a host, and the planner
decisions they drive - table-wise for small tables when per-call costs dominate, row-wise when one table's
table-wise imbalance dominates or when a table does not fit on one rank. Each decision is shown to flip when the term
that drives it is taken away, so the tests fail for the right reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
from planner.planner_testing import COEFFS, FUSED, PlanOnlySharder, ebc, planner

from tritonrec.dist.planner import (
    CommCoefficients,
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingPerfModel,
    InputDistCoefficients,
    LookupCoefficients,
    ParameterConstraints,
    PerfCoefficients,
    Topology,
    load_perf_coefficients,
)
from tritonrec.dist.planner.calibrate import fit_nonnegative
from tritonrec.dist.planner.perf_models import shared_host_finish
from tritonrec.dist.planner.shard_estimators import group_fixed_perf

# a 2-core host on gloo, roughly as `calibrate` measures it: milliseconds of fixed cost per group, lookups twice as
# fast with the other rank idle
CPU_LIKE = PerfCoefficients(
    "cpu",
    LookupCoefficients(
        7e9,
        3e-4,
        1e9,
        7e-4,
        fwd_id_s=0.0,
        bwd_id_s=6e-8,
        fwd_bag_s=2e-8,
        bwd_bag_s=3e-8,
        fwd_table_s=4e-5,
        bwd_table_s=5e-5,
        alone_speedup=1.8,
    ),
    {
        "all_to_all": CommCoefficients(6e-4, 4e8),
        "reduce_scatter": CommCoefficients(7e-4, 3.5e8),
        "all_gather": CommCoefficients(6e-4, 2.5e8),
        "all_reduce": CommCoefficients(1.5e-4, 1.2e9),
    },
    inter_host_bw=1.25e9,
    input_dist=InputDistCoefficients(latency_s=2.5e-3, id_s=0.0, bucketize_call_s=6e-5, bucketize_id_s=4e-8),
)


def _alone(coeffs: PerfCoefficients, speedup: float) -> PerfCoefficients:
    return dataclasses.replace(coeffs, lookup=dataclasses.replace(coeffs.lookup, alone_speedup=speedup))


def _only_volume_costs(coeffs: PerfCoefficients) -> PerfCoefficients:
    """``coeffs`` with every per-call / per-group / per-table cost zeroed and no host sharing (only per-id,
    per-bag and byte terms)."""
    lookup = dataclasses.replace(coeffs.lookup, fwd_call_s=0.0, bwd_call_s=0.0, fwd_table_s=0.0, bwd_table_s=0.0,
                                 alone_speedup=1.0)  # fmt: skip
    comms = {name: CommCoefficients(0.0, c.bytes_per_s) for name, c in coeffs.comms.items()}
    inputs = InputDistCoefficients(0.0, coeffs.input_dist.id_s, 0.0, coeffs.input_dist.bucketize_id_s)
    return dataclasses.replace(coeffs, lookup=lookup, comms=comms, input_dist=inputs)


def _topo(coeffs: PerfCoefficients, ddr_cap: int = 10**9) -> Topology:
    return Topology(2, "cpu", ddr_cap=ddr_cap, intra_host_bw=2e9, calibration=coeffs)


def _types(specs, pooling, coeffs, ddr_cap=10**9, batch_size=256):  # type: ignore[no-untyped-def]
    """Sharding type per table of the planner's plan (table-wise or row-wise, fused) for ``[rows, dim]`` tables."""
    constraints = {
        f"t{i}": ParameterConstraints(sharding_types=["table_wise", "row_wise"], compute_kernels=[FUSED],
                                      pooling_factors=[p]) for i, p in enumerate(pooling)
    }  # fmt: skip
    plan = planner(_topo(coeffs, ddr_cap), batch_size, constraints=constraints).plan(ebc(specs), [PlanOnlySharder()])
    return {name: p.sharding_type for name, p in plan.plan[""].items()}


def test_row_split_divides_ids_but_not_bags_or_the_per_table_cost() -> None:
    lookup = LookupCoefficients(1e15, 0.0, 1e15, 0.0, fwd_id_s=1e-9, bwd_id_s=2e-9, fwd_bag_s=1e-8, bwd_bag_s=3e-8,
                                fwd_table_s=1e-5, bwd_table_s=2e-5)  # fmt: skip
    coeffs = dataclasses.replace(
        COEFFS, lookup=lookup, input_dist=InputDistCoefficients(5e-5, id_s=4e-9, bucketize_id_s=2e-9)
    )
    topo = _topo(coeffs)
    enumerator = EmbeddingEnumerator(topo, 10, {"t0": ParameterConstraints(pooling_factors=[4.0])},
                                     estimator=[EmbeddingPerfEstimator(topo)])  # fmt: skip
    options = {
        (o.sharding_type, o.compute_kernel): o for o in enumerator.enumerate(ebc([(100, 8)]), [PlanOnlySharder()])
    }
    # per rank 40 ids in 10 bags: a table-wise shard serves 80 ids in 20 bags, a row shard 40 ids in the same 20 bags
    tw = options["table_wise", FUSED].shards[0].perf
    assert tw.fwd_compute == pytest.approx(1e-5 + 20 * 1e-8 + 80 * 1e-9, rel=1e-6)
    assert tw.bwd_compute == pytest.approx(2e-5 + 20 * 3e-8 + 80 * 2e-9, rel=1e-6)
    rw = options["row_wise", FUSED].shards[0].perf
    # + bucketizing the rank's own 40 ids
    assert rw.fwd_compute == pytest.approx(1e-5 + 20 * 1e-8 + 40 * 1e-9 + 40 * 2e-9, rel=1e-6)
    assert rw.bwd_compute == pytest.approx(2e-5 + 20 * 3e-8 + 40 * 2e-9, rel=1e-6)
    # the input dist's per-id cost on the ids each shard receives, on top of the wire bytes
    wire = 0.5 * (80 * 8 + 20 * 8) / 2e9
    assert tw.fwd_comms == pytest.approx(wire + 80 * 4e-9 + 0.5 * 20 * 8 * 4 / 2e9)


def test_group_fixed_costs_of_each_type_and_measured_group_steps() -> None:
    topo = _topo(CPU_LIKE)
    comms, compute = group_fixed_perf("table_wise", True, topo)
    # KJT all-to-all fixed cost + output all-to-all forward; its gradient's all-to-all backward; no bucketize
    assert (comms.fwd_compute, comms.fwd_comms, comms.bwd_comms) == pytest.approx((0.0, 2.5e-3 + 6e-4, 6e-4))
    assert (compute.fwd_compute, compute.bwd_compute) == (3e-4, 7e-4)  # one lookup call, on the ranks holding shards
    comms, _ = group_fixed_perf("row_wise", True, topo)
    assert (comms.fwd_compute, comms.fwd_comms, comms.bwd_comms) == pytest.approx((6e-5, 2.5e-3 + 7e-4, 6e-4))
    measured = dataclasses.replace(CPU_LIKE, group_step_s={"table_wise": (4e-3, 2e-3)})
    comms, compute = group_fixed_perf("table_wise", True, _topo(measured))
    # a measured group step is the whole fixed cost, on every rank (lookup calls included)
    assert (comms.fwd_comms, comms.bwd_comms, comms.fwd_compute, compute.total) == (4e-3, 2e-3, 0.0, 0.0)
    comms, _ = group_fixed_perf("row_wise", True, _topo(measured))  # not measured: the sum of its terms
    assert comms.fwd_comms == pytest.approx(2.5e-3 + 7e-4)


def test_shared_host_finish_plays_out_processor_sharing() -> None:
    assert shared_host_finish([1.0, 3.0], 1.0) == [1.0, 3.0]
    # both busy for 1 s; then the second rank alone runs twice as fast through its remaining 2 busy-seconds
    assert shared_host_finish([3.0, 1.0], 2.0) == pytest.approx([2.0, 1.0])
    # 3 ranks, alone 3x: rate 1 while 3 compute, 2 while 2 do, 3 alone
    assert shared_host_finish([1.0, 2.0, 4.0], 3.0) == pytest.approx([1.0, 1.5, 1.5 + 2.0 / 3.0])
    assert shared_host_finish([2.0, 2.0], 2.0) == pytest.approx([2.0, 2.0])  # balanced: nothing gained


def test_rank_perfs_apply_host_sharing_to_compute_only() -> None:
    topo = _topo(CPU_LIKE)
    enumerator = EmbeddingEnumerator(topo, 64, estimator=[EmbeddingPerfEstimator(topo)])
    (tw,) = [o for o in enumerator.enumerate(ebc([(1000, 16)]), [PlanOnlySharder()])
             if o.sharding_type == "table_wise" and o.compute_kernel == FUSED]  # fmt: skip
    tw.shards[0].rank = 0
    perfs = EmbeddingPerfModel(topo).rank_perfs([tw])
    shard = tw.shards[0].perf
    # rank 0 computes alone (rank 1 holds nothing): 1.8x faster; comms unchanged
    assert perfs[0].fwd_compute == pytest.approx((shard.fwd_compute + 3e-4) / 1.8)
    assert perfs[0].bwd_compute == pytest.approx((shard.bwd_compute + 7e-4) / 1.8)
    assert perfs[0].fwd_comms == pytest.approx(shard.fwd_comms + 2.5e-3 + 6e-4)
    alone_free = dataclasses.replace(CPU_LIKE, lookup=dataclasses.replace(CPU_LIKE.lookup, alone_speedup=1.0))
    plain = EmbeddingPerfModel(_topo(alone_free)).rank_perfs([tw])
    assert plain[0].fwd_compute == pytest.approx(shard.fwd_compute + 3e-4)


def test_table_wise_beats_row_wise_for_small_tables_when_per_call_costs_dominate() -> None:
    specs, pooling = [(1000, 16)] * 3, [20.0] * 3
    # 3 small tables: table-wise leaves one rank 2 tables, the other 1, but a row-wise group's costs (one more KJT
    # all-to-all, bucketize, reduce-scatter + all-gather, per-table costs on both ranks) outweigh that imbalance
    assert set(_types(specs, pooling, CPU_LIKE).values()) == {"table_wise"}
    # without fixed costs only the imbalance is left: row-wise balances it
    assert "row_wise" in _types(specs, pooling, _only_volume_costs(CPU_LIKE)).values()


def test_row_wise_wins_when_one_tables_table_wise_imbalance_dominates() -> None:
    specs, quiet_host = [(50_000, 64)] * 4, _alone(CPU_LIKE, 1.3)
    # t0 reads 200 ids per sample (~100k a step): on one rank it would take far longer than row-wise's fixed costs
    assert _types(specs, [200.0, 1.0, 1.0, 1.0], quiet_host)["t0"] == "row_wise"
    # a tenth of the ids: the imbalance no longer pays for row-wise's fixed costs
    assert _types(specs, [20.0, 1.0, 1.0, 1.0], quiet_host)["t0"] == "table_wise"


def test_host_sharing_decides_between_balance_and_fewer_collectives() -> None:
    specs, pooling = [(50_000, 64)] * 4, [200.0, 1.0, 1.0, 1.0]
    # ranks that do not slow each other down: halving t0's work is worth row-wise's costs
    assert _types(specs, pooling, _alone(CPU_LIKE, 1.0))["t0"] == "row_wise"
    # a busy shared host (a rank alone 1.8x faster): the rank left with t0 runs mostly alone, table-wise wins
    assert _types(specs, pooling, _alone(CPU_LIKE, 1.8))["t0"] == "table_wise"


def test_row_wise_wins_when_a_table_does_not_fit_on_one_rank() -> None:
    specs, pooling = [(10, 4), (5000, 4)], [1.0, 1.0]
    assert _types(specs, pooling, CPU_LIKE, batch_size=10)["t1"] == "table_wise"
    # t1 needs ~100 kB whole and ~51 kB per row shard (test_planner_search): 80 kB per rank forces the split
    assert _types(specs, pooling, CPU_LIKE, ddr_cap=80_000, batch_size=10)["t1"] == "row_wise"


def test_calibration_files_carry_the_new_terms(tmp_path) -> None:  # type: ignore[no-untyped-def]
    full = dataclasses.replace(CPU_LIKE, group_step_s={"table_wise": (4e-3, 2e-3), "row_wise": (5e-3, 2.5e-3)})
    path = full.save(tmp_path / "c.json")
    assert load_perf_coefficients(path, "cpu") == full
    data = json.loads(path.read_text())
    # a version 1 file (before these terms): the KJT all-to-all costs its 3 collectives' latencies, no more
    old = {"version": 1, "compute_device": "cpu", "inter_host_bw": 1e9,
           "lookup": {k: data["lookup"][k] for k in ("fwd_bytes_per_s", "fwd_call_s", "bwd_bytes_per_s",
                                                      "bwd_call_s", "fwd_id_s", "bwd_id_s")},
           "comms": data["comms"]}  # fmt: skip
    (tmp_path / "v1.json").write_text(json.dumps(old))
    v1 = load_perf_coefficients(tmp_path / "v1.json", "cpu")
    assert v1.input_dist == InputDistCoefficients(latency_s=3 * 6e-4)
    assert (v1.lookup.fwd_table_s, v1.lookup.alone_speedup, v1.group_step_s) == (0.0, 1.0, {})
    for field, value, message in (
        (("lookup", "alone_speedup"), 0.5, r"lookup.alone_speedup must be >= 1"),
        (("input_dist", "bucketize_id_s"), -1.0, r"input_dist.bucketize_id_s must be a non-negative finite"),
        (("group_step_s", "diagonal"), {"fwd_s": 1.0, "bwd_s": 1.0}, r"unknown sharding type 'diagonal'"),
    ):
        bad = json.loads(path.read_text())
        bad[field[0]][field[1]] = value
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_perf_coefficients(tmp_path / "bad.json", "cpu")
    del data["input_dist"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing or malformed field 'input_dist'"):
        load_perf_coefficients(tmp_path / "bad.json", "cpu")


def test_relative_fit_keeps_the_fixed_cost_of_short_calls() -> None:
    sizes = [1e3, 1e6, 1e7]
    seconds = [1e-4 + s / 1e9 for s in sizes]
    seconds[2] *= 0.9  # 10 % noise on the long call: 1 ms, ten times the fixed cost
    absolute = fit_nonnegative([[1.0] * 3, sizes], seconds)
    relative = fit_nonnegative([[1.0] * 3, sizes], seconds, relative=True)
    # the absolute fit lets the long call's noise decide the intercept (1.5e-4); the relative one keeps it near 1e-4
    assert abs(relative[0] - 1e-4) < 0.05e-4 and abs(absolute[0] - 1e-4) > 0.3e-4
    with pytest.raises(ValueError, match="relative fit needs positive times"):
        fit_nonnegative([[1.0, 1.0], [1.0, 2.0]], [0.0, 1.0], relative=True)
