"""Storage and perf estimates against hand-computed values (round-number coefficients from planner_testing), the
group fixed costs in a plan's rating, and the input checks of Topology, ParameterConstraints and calibration files.

The running example: a ``[100, 8]`` fp32 table, one feature, 4 ids per bag, 10 samples per rank, 2 ranks on one host
(link 2 GB/s). Per rank: 40 ids, 10 bags.
"""

from __future__ import annotations

import json
import math

import pytest
from planner.planner_testing import COEFFS, DENSE, FUSED, PlanOnlySharder, ebc, ec, topology

from tritonrec.dist.planner import (
    DEFAULT_COEFFICIENTS,
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingPerfModel,
    EmbeddingStorageEstimator,
    ParameterConstraints,
    PerfCoefficients,
    Topology,
    load_perf_coefficients,
)
from tritonrec.dist.planner.calibrate import fit_latency_and_rate, fit_nonnegative
from tritonrec.modules import OptimType


def _options(module, topo, constraints=None, sharder=None, batch_size=10):  # type: ignore[no-untyped-def]
    enumerator = EmbeddingEnumerator(
        topo,
        batch_size,
        constraints or {"t0": ParameterConstraints(pooling_factors=[4.0])},
        estimator=[EmbeddingPerfEstimator(topo), EmbeddingStorageEstimator(topo)],
    )
    options = enumerator.enumerate(module, [sharder or PlanOnlySharder()])
    return {(o.sharding_type, o.compute_kernel, o.num_column_shards): o for o in options}


def _ddr(option) -> list[int]:  # type: ignore[no-untyped-def]
    assert all(s.storage.hbm == 0 for s in option.shards)
    return [s.storage.ddr for s in option.shards]


def test_storage_counts_weights_optimizer_state_and_buffers() -> None:
    options = _options(ebc([(100, 8)]), topology())
    # TW serves the global batch: 80 ids, 20 bags. weights 100*8*4 = 3200, rowwise Adagrad 100*4 = 400,
    # input 80*8 + 20*8 = 800, output 20*8*4 = 640 twice (and its gradient)
    assert _ddr(options["table_wise", FUSED, None]) == [3200 + 400 + 800 + 2 * 640]
    # the dense kernel holds a weight-sized gradient instead of optimizer state
    assert _ddr(options["table_wise", DENSE, None]) == [3200 + 3200 + 800 + 2 * 640]
    # RW: 50 rows per rank, ids split by rows (40 each), partial output for all 20 bags
    assert _ddr(options["row_wise", FUSED, None]) == [1600 + 200 + (40 * 8 + 20 * 8) + 2 * 640] * 2
    # DP: whole table per rank, its own batch only (40 ids, 10 bags)
    assert _ddr(options["data_parallel", DENSE, None]) == [3200 + 3200 + (40 * 8 + 10 * 8) + 2 * 320] * 2


def test_a_shared_feature_costs_every_table_reading_it() -> None:
    """Two tables reading one feature (torchrec's shared features) are estimated as if each read its own copy."""
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

    def options(second: list[str]) -> dict:  # type: ignore[type-arg]
        configs = [
            EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="t0", feature_names=["a", "b"]),
            EmbeddingBagConfig(num_embeddings=60, embedding_dim=8, name="t1", feature_names=second),
        ]
        topo = topology()
        enumerator = EmbeddingEnumerator(
            topo, 10, estimator=[EmbeddingPerfEstimator(topo), EmbeddingStorageEstimator(topo)]
        )
        found = enumerator.enumerate(EmbeddingBagCollection(configs, device="meta"), [PlanOnlySharder()])
        return {(o.name, o.sharding_type, o.compute_kernel, o.num_column_shards): o for o in found}

    shared, separate = options(["a"]), options(["c"])
    assert shared.keys() == separate.keys() and {key[0] for key in shared} == {"t0", "t1"}
    for key, option in shared.items():
        other = separate[key]
        assert len(option.input_lengths) == len(other.input_lengths) == (2 if key[0] == "t0" else 1), key
        assert [s.perf for s in option.shards] == [s.perf for s in other.shards], key
        assert _ddr(option) == _ddr(other), key


def test_storage_of_column_shards_adam_weights_and_sequences() -> None:
    constraints = {"t0": ParameterConstraints(pooling_factors=[4.0], min_partition=4)}
    options = _options(ebc([(100, 8)]), topology(), constraints)
    assert _ddr(options["column_wise", FUSED, 2]) == [1600 + 400 + 800 + 2 * (20 * 4 * 4)] * 2
    adam = _options(ebc([(100, 8)]), topology(), sharder=PlanOnlySharder(fused_params={"optimizer": OptimType.ADAM}))
    assert _ddr(adam["table_wise", FUSED, None]) == [3200 + 2 * 800 * 4 + 800 + 2 * 640]  # two fp32 per element
    per_element = PlanOnlySharder(fused_params={"optimizer": "exact_adagrad"})
    adagrad = _options(ebc([(100, 8)]), topology(), constraints, sharder=per_element)
    assert _ddr(adagrad["table_wise", FUSED, None]) == [3200 + 800 * 4 + 800 + 2 * 640]  # one fp32 per element
    assert _ddr(adagrad["column_wise", FUSED, 2]) == [1600 + 400 * 4 + 800 + 2 * (20 * 4 * 4)] * 2  # its columns'
    sgd = _options(ebc([(100, 8)]), topology(), sharder=PlanOnlySharder(fused_params={"optimizer": "exact_sgd"}))
    assert _ddr(sgd["table_wise", FUSED, None]) == [3200 + 800 + 2 * 640]
    weighted = _options(ebc([(100, 8)], weighted=True), topology())
    assert _ddr(weighted["table_wise", FUSED, None]) == [3200 + 400 + (80 * 12 + 20 * 8) + 2 * 640]
    # sequence lookups output one row per id: 80 ids * 8 cols * 4 bytes
    seq = _options(ec([(100, 8)]), topology(), sharder=PlanOnlySharder(module_type=type(ec([(1, 1)]))))
    assert _ddr(seq["table_wise", FUSED, None]) == [3200 + 400 + 800 + 2 * 2560]
    # two features at different pooling factors and batch sizes: ids 10*2 + 5*6 = 50 per rank, bags 15
    two = ParameterConstraints(pooling_factors=[2.0, 6.0], batch_sizes=[10, 5])
    multi = _options(ebc([(100, 8)], features=2), topology(), {"t0": two})
    assert _ddr(multi["table_wise", FUSED, None]) == [3200 + 400 + (100 * 8 + 30 * 8) + 2 * (30 * 8 * 4)]


def test_perf_models_compute_and_the_comms_of_each_sharding_type() -> None:
    options = _options(ebc([(100, 8)]), topology())
    tw = options["table_wise", FUSED, None].shards[0].perf
    # compute: 80 ids at 1 ns (2 ns backward) + 80 ids * 8 cols * 4 B = 2560 B at 1 GB/s forward, 0.5 GB/s backward
    assert tw.fwd_compute == pytest.approx(80e-9 + 2.56e-6) and tw.bwd_compute == pytest.approx(160e-9 + 5.12e-6)
    # input all-to-all: half of 800 B crosses at 2 GB/s; pooled output all-to-all: half of 640 B, both directions
    assert tw.fwd_comms == pytest.approx((400 + 320) / 2e9) and tw.bwd_comms == pytest.approx(320 / 2e9)
    rw = options["row_wise", FUSED, None].shards[0].perf
    assert rw.fwd_compute == pytest.approx(40e-9 + 1.28e-6)
    # reduce-scatter at efficiency 0.5 forward, all-gather at 1.0 backward
    assert rw.fwd_comms == pytest.approx(240 / 2e9 + 320 / (2e9 * 0.5)) and rw.bwd_comms == pytest.approx(320 / 2e9)
    dp = options["data_parallel", DENSE, None].shards[0].perf
    # no forward comms; backward: lookup + whole-table gradient, then an all-reduce of 2*(1/2)*3200 B at 0.25
    assert dp.fwd_comms == 0 and dp.bwd_compute == pytest.approx(80e-9 + 1280 / 5e8 + 3200 / 5e8)
    assert dp.bwd_comms == pytest.approx(3200 / (2e9 * 0.25))


def test_perf_of_host_level_types_uses_both_links() -> None:
    topo = topology(world_size=4, local_world_size=2)  # 2 hosts: inter-host link 0.1 GB/s, intra 2 GB/s
    options = _options(ebc([(100, 8)]), topo)
    twrw = options["table_row_wise", FUSED, None]
    assert [s.size for s in twrw.shards] == [[50, 8], [50, 8]]
    perf = twrw.shards[0].perf
    # 4 ranks * 40 ids * 1/2 = 80 ids, 40 bags; input 80*8 + 40*8 = 960 B, 3/4 remote, over the 0.1 GB/s link;
    # output 40*8*4 = 1280 B: half reduced inside the host (2 GB/s at 0.5), a 1/2 slice sent 3/4 remote
    a2a_out = 0.75 * 1280 / 2 / 1e8
    assert perf.fwd_comms == pytest.approx(0.75 * 960 / 1e8 + 640 / (2e9 * 0.5) + a2a_out)
    assert perf.bwd_comms == pytest.approx(640 / 2e9 + a2a_out)
    tw = options["table_wise", FUSED, None].shards[0].perf
    assert tw.bwd_comms == pytest.approx(0.75 * (40 * 8 * 4) / 1e8)  # 4 ranks * 10 bags, across hosts


def test_plan_rating_adds_each_groups_fixed_costs_once() -> None:
    topo = topology()
    enumerator = EmbeddingEnumerator(topo, 10, estimator=[EmbeddingPerfEstimator(topo)])
    both = [o for o in enumerator.enumerate(ebc([(100, 8), (100, 8)]), [PlanOnlySharder()])
            if o.sharding_type == "table_wise" and o.compute_kernel == FUSED]  # fmt: skip
    both[0].shards[0].rank, both[1].shards[0].rank = 0, 0
    perfs = EmbeddingPerfModel(topo).rank_perfs(both)
    shard = both[0].shards[0].perf
    # rank 0: both shards + one lookup call (1e-4 fwd, 2e-4 bwd) + the KJT all-to-all's fixed cost (5e-5) and the
    # output all-to-all's latency forward and backward (1e-5 each), once
    fixed = COEFFS.input_dist.latency_s + 2 * COEFFS.comms["all_to_all"].latency_s
    assert perfs[0].total == pytest.approx(2 * shard.total + 3e-4 + fixed)
    assert perfs[1].total == pytest.approx(fixed)  # takes part in the collectives only
    assert EmbeddingPerfModel(topo).rate(both) == pytest.approx(perfs[0].total)


def test_topology_and_constraints_check_their_input() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got world_size=0"):
        Topology(0, "cpu")
    with pytest.raises(ValueError, match="compute_device must be 'cpu' or 'cuda', got compute_device='tpu'"):
        Topology(2, "tpu")
    with pytest.raises(ValueError, match="local_world_size must divide world_size 4, got local_world_size=3"):
        Topology(4, "cpu", local_world_size=3)
    with pytest.raises(ValueError, match=r"ddr_cap must be a non-negative int \(bytes\), got ddr_cap=-1"):
        Topology(2, "cpu", ddr_cap=-1)
    with pytest.raises(ValueError, match=r"inter_host_bw must be a positive finite number \(bytes/s\)"):
        Topology(2, "cpu", inter_host_bw=math.nan, calibration=COEFFS)
    topo = Topology(2, "cpu", calibration=COEFFS)
    assert (topo.hbm_cap, topo.ddr_cap, topo.intra_host_bw, topo.inter_host_bw) == (0, 128 * 1024**3, 1e9, 1e8)
    assert Topology(8, "cuda", calibration=DEFAULT_COEFFICIENTS["cuda"]).hbm_cap == 32 * 1024**3
    with pytest.raises(ValueError, match=r"sharding_types must be non-empty values of .*, got \['diagonal'\]"):
        ParameterConstraints(sharding_types=["diagonal"])
    with pytest.raises(ValueError, match=r"compute_kernels must be non-empty values of .*, got \['magic'\]"):
        ParameterConstraints(compute_kernels=["magic"])
    with pytest.raises(ValueError, match="pooling_factors must hold finite non-negative numbers"):
        ParameterConstraints(pooling_factors=[math.inf])
    with pytest.raises(ValueError, match="batch_sizes has 1 entries but pooling_factors has 2"):
        ParameterConstraints(pooling_factors=[1.0, 2.0], batch_sizes=[4])
    with pytest.raises(ValueError, match="min_partition must be a positive int, got min_partition=0"):
        ParameterConstraints(min_partition=0)
    three = {"t0": ParameterConstraints(pooling_factors=[1.0, 2.0, 3.0])}
    with pytest.raises(ValueError, match="table 't0' is read by 2 features but its constraints give 3 pooling"):
        _options(ebc([(100, 8)], features=2), topology(), three)


def test_constraints_of_the_wrong_container_name_the_argument() -> None:
    # a bare string was read as its characters ("got ['r', 'o', 'w', ...]"), a list of constraints failed in dict()
    with pytest.raises(TypeError, match="sharding_types must be a list, got sharding_types='row_wise'"):
        ParameterConstraints(sharding_types="row_wise")
    with pytest.raises(TypeError, match="compute_kernels must be a list, got compute_kernels='fused'"):
        ParameterConstraints(compute_kernels="fused")
    assert ParameterConstraints(sharding_types=("row_wise",)).sharding_types == ["row_wise"]
    with pytest.raises(TypeError, match="constraints must be a dict of table name -> ParameterConstraints, got list"):
        EmbeddingEnumerator(topology(), 10, [ParameterConstraints()])  # type: ignore[arg-type]


def test_calibration_file_round_trip_and_errors(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = COEFFS.save(tmp_path / "calib.json")
    assert load_perf_coefficients(path, "cpu") == COEFFS
    assert not list(tmp_path.glob("*.partial"))
    assert Topology(2, "cpu", calibration=str(path)).coefficients == COEFFS
    monkeypatch.setenv("TRITONREC_PLANNER_CALIBRATION", str(path))
    assert Topology(2, "cpu").coefficients == COEFFS  # the environment variable is the second place looked at
    monkeypatch.delenv("TRITONREC_PLANNER_CALIBRATION")
    monkeypatch.setenv("HOME", str(tmp_path / "empty_home"))
    assert load_perf_coefficients(None, "cpu") is DEFAULT_COEFFICIENTS["cpu"]
    with pytest.raises(FileNotFoundError, match="calibration file .*missing.json' does not exist"):
        load_perf_coefficients(tmp_path / "missing.json", "cpu")
    with pytest.raises(ValueError, match="was measured on cpu, the topology computes on cuda"):
        load_perf_coefficients(path, "cuda")
    data = json.loads(path.read_text())
    data["comms"]["all_gather"]["bytes_per_s"] = -1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"calib.*bad.json'.*comms.all_gather.bytes_per_s must be a positive finite"):
        load_perf_coefficients(bad, "cpu")
    del data["lookup"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing or malformed field 'lookup'"):
        load_perf_coefficients(bad, "cpu")
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_perf_coefficients(bad, "cpu")
    assert PerfCoefficients.from_json(COEFFS.to_json()) == COEFFS


def test_nonnegative_fit_of_lookup_costs() -> None:
    ids = [100.0, 1000.0, 100.0, 1000.0, 5000.0]
    sizes = [3200.0, 32000.0, 51200.0, 512000.0, 160000.0]
    seconds = [5e-5 + 2e-8 * i + b / 1e9 for i, b in zip(ids, sizes, strict=True)]
    assert fit_nonnegative([[1.0] * 5, ids, sizes], seconds) == pytest.approx([5e-5, 2e-8, 1e-9])
    # a cost that falls with size is noise: that feature gets 0, the others are refitted
    assert fit_nonnegative([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0]) == pytest.approx([1.5, 0.0])


def test_latency_and_rate_fit() -> None:
    latency, rate = fit_latency_and_rate([1e3, 1e4, 1e5], [1e-4 + 1e3 / 1e8, 1e-4 + 1e4 / 1e8, 1e-4 + 1e5 / 1e8])
    assert latency == pytest.approx(1e-4) and rate == pytest.approx(1e8)
    assert fit_latency_and_rate([1e3, 2e3], [2e-3, 1e-3]) == (0.0, 2e3 / 1e-3)  # noise: best observed rate
    with pytest.raises(ValueError, match="need at least two"):
        fit_latency_and_rate([1.0], [1.0])
