"""The search on fake topologies (no processes): proposers' candidates, partitioner balance and storage limits,
constraints honoured, every sharding type plannable on CPU (and equal to the hand-written plan), each PlannerError
case naming the table, the need and the capacity, the stats table, and the candidate plans for exhaustive search."""

from __future__ import annotations

import pytest
from planner.planner_testing import ALL_TYPES, DENSE, FUSED, Model, PlanOnlySharder, ebc, ec, planner, topology

from tritonrec.dist.planner import (
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingStats,
    EmbeddingStorageEstimator,
    GreedyPerfPartitioner,
    GreedyProposer,
    GridSearchProposer,
    HeuristicalStorageReservation,
    ParameterConstraints,
    Perf,
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
    Storage,
    UniformProposer,
)
from tritonrec.dist.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)


def _space(module, topo, constraints=None):  # type: ignore[no-untyped-def]
    estimators = [EmbeddingPerfEstimator(topo), EmbeddingStorageEstimator(topo)]
    return EmbeddingEnumerator(topo, 10, constraints, estimators).enumerate(module, [PlanOnlySharder()])


def _drain(proposer, space) -> list[list[ShardingOption]]:  # type: ignore[no-untyped-def]
    proposer.load(space)
    proposals = []
    while (proposal := proposer.propose()) is not None:
        proposals.append(proposal)
        proposer.feedback(partitionable=True)
    return proposals


def _tw_option(name: str, seconds: float, nbytes: int) -> ShardingOption:
    """A table-wise option with a given estimate (for partitioner tests)."""
    module = ebc([(10, 4)])
    shard = Shard([10, 4], [0, 0], Storage(ddr=nbytes), Perf(fwd_compute=seconds))
    return ShardingOption(
        name, module.embedding_bags["t0"].weight, ("", module), PlanOnlySharder(), "table_wise", FUSED, [shard],
        [1.0], [1.0], [10],
    )  # fmt: skip


def test_enumerator_lists_every_type_kernel_and_column_split() -> None:
    space = _space(ebc([(100, 64)]), topology(world_size=4, local_world_size=2))
    keys = {(o.sharding_type, o.compute_kernel, o.num_column_shards) for o in space}
    # dim 64 with 32-column minimum: CW in 2 blocks (4 would be 16 wide), TWCW in 2, GRID in 2 (2 hosts)
    expected = {(t, k, 2 if t in ("column_wise", "table_column_wise", "grid_shard") else None) for t in ALL_TYPES
                for k in (DENSE, FUSED)}  # fmt: skip
    assert keys == expected
    narrow = _space(ebc([(100, 64)]), topology(world_size=4), {"t0": ParameterConstraints(min_partition=16)})
    assert {o.num_column_shards for o in narrow if o.sharding_type == "column_wise"} == {2, 4}
    tiny = _space(ebc([(100, 8)]), topology())
    assert {o.num_column_shards for o in tiny if o.sharding_type == "column_wise"} == {1}  # too narrow to split


def test_a_fused_collections_tables_are_offered_the_fused_kernel_only() -> None:
    """The dense kernel would silently drop a fused collection's own optimizer (its tables carry
    ``_in_backward_optimizers``, as tables given one by apply_optimizer_in_backward do): not an option for them."""
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(num_embeddings=100, embedding_dim=64, name="t0", feature_names=["f0"])]
    fused = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, device="meta")
    space = _space(fused, topology(world_size=4, local_world_size=2))
    assert {o.compute_kernel for o in space} == {FUSED}
    assert {o.sharding_type for o in space} == set(ALL_TYPES)
    assert {o.compute_kernel for o in _space(ebc([(100, 64)]), topology())} == {DENSE, FUSED}  # a plain one: both


def test_proposers_candidates() -> None:
    constraints = {
        "t0": ParameterConstraints(sharding_types=["table_wise", "row_wise", "data_parallel"], compute_kernels=[FUSED]),
        "t1": ParameterConstraints(sharding_types=["table_wise", "row_wise"], compute_kernels=[FUSED]),
    }
    space = _space(ebc([(100, 8), (1000, 8)]), topology(), constraints)
    grid = _drain(GridSearchProposer(), space)
    combos = {tuple(o.sharding_type for o in p) for p in grid}
    assert len(grid) == 6 and len(combos) == 6  # 3 x 2, each once
    assert _drain(GridSearchProposer(max_proposals=5), space) == []  # too many: skipped
    uniform = _drain(UniformProposer(), space)
    assert [{o.sharding_type for o in p} for p in uniform] == [{"table_wise"}, {"row_wise"}]  # DP lacks t1
    greedy = _drain(GreedyProposer(), space)
    assert len(greedy) == 1 + 2 + 1  # the fastest of each, then one step at a time to each table's last option
    fastest = {fqn: min(o.shards[0].perf.total for o in space if o.fqn == fqn) for fqn in ("t0", "t1")}
    for option in greedy[0]:
        assert max(s.perf.total for s in option.shards) <= fastest[option.fqn] + 1e-15
    # after the first proposal, the table holding the most storage (t1) moves first
    assert greedy[1][0] is greedy[0][0] and greedy[1][1] is not greedy[0][1]


def test_partitioner_balances_estimated_time() -> None:
    options = [_tw_option(f"t{i}", seconds, 100) for i, seconds in enumerate([4.0, 3.0, 2.0, 1.0])]
    placed = GreedyPerfPartitioner().partition(options, topology())
    per_rank = [sum(o.shards[0].perf.total for o in placed if o.shards[0].rank == r) for r in range(2)]
    assert sorted(per_rank) == [5.0, 5.0]  # largest first onto the least loaded rank: {4, 1}, {3, 2}
    assert all(o.shards[0].rank is None for o in options)  # the proposal itself is not modified
    full = topology(ddr_cap=250)  # each rank holds two 100-byte shards
    placed = GreedyPerfPartitioner().partition([_tw_option(f"t{i}", 1.0 + i, 100) for i in range(4)], full)
    assert sorted(o.shards[0].rank for o in placed) == [0, 0, 1, 1]
    with pytest.raises(PlannerError, match="cannot place table 't4'.* needs 100 bytes of ddr, but the rank with the"):
        GreedyPerfPartitioner().partition([_tw_option(f"t{i}", 5.0 - i, 100) for i in range(5)], full)
    space = _space(ebc([(100, 64)]), topology(world_size=4), {"t0": ParameterConstraints(min_partition=16)})
    cw = next(o for o in space if o.sharding_type == "column_wise" and o.num_column_shards == 4)
    assert sorted(s.rank for s in GreedyPerfPartitioner().partition([cw], topology(world_size=4))[0].shards) == [
        0, 1, 2, 3,
    ]  # fmt: skip


HAND_WRITTEN = {
    "table_wise": lambda ranks: table_wise(ranks[0]),
    "row_wise": lambda ranks: row_wise(),
    "column_wise": lambda ranks: column_wise(ranks),
    "table_row_wise": lambda ranks: table_row_wise(ranks[0] // 2),
    "table_column_wise": lambda ranks: table_column_wise(ranks),
    "grid_shard": lambda ranks: grid_shard([ranks[0] // 2, ranks[2] // 2]),
    "data_parallel": lambda ranks: data_parallel(),
}


@pytest.mark.parametrize("sharding_type", ALL_TYPES)
def test_every_sharding_type_is_plannable_on_cpu_and_equals_the_hand_written_plan(sharding_type: str) -> None:
    topo = topology(world_size=4, local_world_size=2)
    module = Model(ebc([(101, 64), (37, 32)]))
    constraints = {
        name: ParameterConstraints(sharding_types=[sharding_type], min_partition=16) for name in ("t0", "t1")
    }
    sharder = PlanOnlySharder()
    plan = planner(topo, constraints=constraints).plan(module, [sharder])
    module_plan = plan.get_plan_for_module("sparse.ebc")
    assert list(plan.plan) == ["sparse.ebc"] and set(module_plan) == {"t0", "t1"}
    generators = {}
    for name, sharding in module_plan.items():
        assert sharding.sharding_type == sharding_type
        generators[name] = HAND_WRITTEN[sharding_type](sharding.ranks)
    expected = construct_module_sharding_plan(module.sparse.ebc, generators, sharder, 2, 4, "cpu")
    for name, sharding in module_plan.items():
        assert sharding.compute_kernel in (DENSE, FUSED)
        assert expected[name].ranks == sharding.ranks
        assert [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in expected[name].shards] == [
            (list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in sharding.shards
        ]


def test_constraints_are_honoured() -> None:
    constraints = {
        "t0": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=[DENSE]),
        "t1": ParameterConstraints(sharding_types=["column_wise"], min_partition=8, stochastic_rounding=False),
    }
    plan = planner(topology(), constraints=constraints).plan(ebc([(100, 16), (100, 16)]), [PlanOnlySharder()])
    module_plan = plan.get_plan_for_module("")
    assert (module_plan["t0"].sharding_type, module_plan["t0"].compute_kernel) == ("row_wise", DENSE)
    assert module_plan["t1"].sharding_type == "column_wise" and len(module_plan["t1"].shards) == 2
    assert module_plan["t1"].stochastic_rounding is False and module_plan["t0"].stochastic_rounding is None
    # the pooling factor moves the choice: the hot table's lookups are split over both ranks, a cold table that is
    # expensive to replicate is not data-parallel
    hot = {"t0": ParameterConstraints(pooling_factors=[500.0]), "t1": ParameterConstraints(pooling_factors=[0.1])}
    chosen = planner(topology(), constraints=hot).plan(ebc([(100_000, 64), (100_000, 64)]), [PlanOnlySharder()])
    t0, t1 = chosen.get_plan_for_module("")["t0"], chosen.get_plan_for_module("")["t1"]
    assert sorted(t0.ranks) == [0, 1] and t0.sharding_type != "data_parallel", t0
    assert t1.sharding_type != "data_parallel", t1
    with pytest.raises(ValueError, match=r"constraints name tables \['t7'\] that no sharder covers"):
        planner(topology(), constraints={"t7": ParameterConstraints()}).plan(ebc([(10, 4)]), [PlanOnlySharder()])


def test_planner_error_when_constraints_leave_no_option() -> None:
    sharder = PlanOnlySharder(types=["table_wise", "row_wise"])
    constraints = {"t1": ParameterConstraints(sharding_types=["column_wise"])}
    message = r"table 't1': no sharding option left on cpu: .*allow sharding types \['column_wise'\].*PlanOnlySharder"
    with pytest.raises(PlannerError, match=message) as err:
        planner(topology(), constraints=constraints).plan(ebc([(10, 4), (10, 4)]), [sharder])
    assert err.value.error_type == PlannerErrorType.STRICT_CONSTRAINTS


def test_planner_error_when_a_table_fits_on_no_rank() -> None:
    # t1 needs 50880 B even row-wise (the most compact way: 2500 x 4 fp32 rows, their Adagrad state and buffers)
    constraints = {"t1": ParameterConstraints(sharding_types=["table_wise", "row_wise"])}
    message = (
        r"table 't1' does not fit: its most compact option \(row_wise, fused\) needs 50880 bytes .* of ddr on one "
        r"rank, but a rank has 30000 bytes .* for tables \(capacity 29.3 KiB per rank minus 0 B reserved\)"
    )
    with pytest.raises(PlannerError, match=message) as err:
        planner(topology(ddr_cap=30_000), constraints=constraints).plan(ebc([(10, 4), (5000, 4)]), [PlanOnlySharder()])
    assert err.value.error_type == PlannerErrorType.INSUFFICIENT_STORAGE


def _table_wise_only(tables: int) -> dict[str, ParameterConstraints]:
    return {
        f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[FUSED]) for i in range(tables)
    }


def test_planner_error_when_the_tables_together_exceed_all_ranks() -> None:
    # each 2000 x 4 table needs 40,960 B (32,000 weights, 8,000 state, 320 input, 2 x 320 output): one fits a 50 kB
    # rank, three do not fit two
    message = (
        r"the tables need at least 122880 bytes .* of ddr in total - the largest, table 't\d', 40960 bytes - but the "
        r"2 ranks have 100000 bytes"
    )
    with pytest.raises(PlannerError, match=message) as err:
        planner(topology(ddr_cap=50_000), constraints=_table_wise_only(3)).plan(
            ebc([(2000, 4)] * 3), [PlanOnlySharder()]
        )
    assert err.value.error_type == PlannerErrorType.INSUFFICIENT_STORAGE


def test_planner_error_when_no_placement_exists() -> None:
    # three 40,960 B tables on two 65 kB ranks: 123 kB < 130 kB in total, but no rank takes two
    message = (
        r"no proposal could be placed on the ranks: cannot place table 't\d' \(table_wise, fused\): a shard of "
        r"2000 x 4 needs 40960 bytes of ddr, but the rank with the most free ddr has 24040 bytes left"
    )
    with pytest.raises(PlannerError, match=message) as err:
        planner(topology(ddr_cap=65_000), constraints=_table_wise_only(3)).plan(
            ebc([(2000, 4)] * 3), [PlanOnlySharder()]
        )
    assert err.value.error_type == PlannerErrorType.PARTITION


def test_planner_error_when_the_reservation_exceeds_a_rank() -> None:
    # the dense layer: 16 x 16 + 16 fp32 = 1088 B, x6 = 6528 B, plus 50 % of 10 kB
    message = (
        r"the storage reservation needs 11528 bytes of ddr per rank \(50% of capacity = 5000 \+ dense parameters "
        r"1088 x 6 = 6528\) but a rank holds 10000 bytes"
    )
    reservation = HeuristicalStorageReservation(percentage=0.5)
    with pytest.raises(PlannerError, match=message):
        planner(topology(ddr_cap=10_000), storage_reservation=reservation).plan(
            Model(ebc([(10, 4)])), [PlanOnlySharder()]
        )
    with pytest.raises(ValueError, match=r"percentage must be a number in \[0, 1\), got percentage=1.5"):
        HeuristicalStorageReservation(percentage=1.5)


def test_stats_table_and_plan_output() -> None:
    lines: list[str] = []
    topo = topology()
    stats = EmbeddingStats(out=lines.append)
    plan = planner(topo, stats=stats).plan(Model(ebc([(100, 8), (50, 8)])), [PlanOnlySharder()])
    assert len(lines) == 1
    report = lines[0]
    assert report.startswith("tritonrec planner: 2 ranks on cpu (1 host), batch size 10 per rank, 2 tables;")
    assert "estimated step time" in report and "ddr tables" in report
    rank_lines = [line for line in report.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(rank_lines) == 2
    for name, sharding in plan.get_plan_for_module("sparse.ebc").items():
        row = next(line for line in report.splitlines() if line.startswith(f"{name} "))
        assert sharding.sharding_type in row and "sparse.ebc" in row
    assert planner(topo).plan(ebc([(10, 4)]), [PlanOnlySharder(module_type=type(topo))]).plan == {}  # no tables


def test_candidate_plans_for_exhaustive_search() -> None:
    constraints = {
        name: ParameterConstraints(sharding_types=["table_wise", "row_wise"], compute_kernels=[FUSED])
        for name in ("t0", "t1")
    }
    p = planner(topology(), constraints=constraints)
    module = ebc([(100, 8), (1000, 8)])
    candidates = p.candidate_plans(module, [PlanOnlySharder()])
    assert len(candidates) == 4  # (TW, RW)^2; each TW table placed once, on the least loaded rank
    assert [c.estimated_step_s for c in candidates] == sorted(c.estimated_step_s for c in candidates)
    assert {tuple(sorted(c.sharding_types().values())) for c in candidates} == {
        ("row_wise", "row_wise"), ("row_wise", "table_wise"), ("table_wise", "table_wise"),
    }  # fmt: skip
    best = p.plan(module, [PlanOnlySharder()])
    assert str(best) == str(candidates[0].plan)  # the planner returns the grid's best
    assert all(len(c.storage_per_rank) == 2 for c in candidates)
    storage = candidates[0].storage_per_rank
    options = candidates[0].options
    assert [sum(s.storage.ddr for o in options for s in o.shards if s.rank == r) for r in range(2)] == [
        storage[0].ddr, storage[1].ddr,
    ]  # fmt: skip

    # a grid too large for its cap proposes nothing: the error says so and names the argument that lifts the cap
    with pytest.raises(PlannerError, match=r"grid search has 4 combinations, over its max_proposals=3; pass proposer="):
        p.candidate_plans(module, [PlanOnlySharder()], proposer=GridSearchProposer(max_proposals=3))
    assert len(p.candidate_plans(module, [PlanOnlySharder()], proposer=GridSearchProposer(max_proposals=4))) == 4


def test_planner_checks_its_input() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int, got batch_size=0"):
        planner(topology(), batch_size=0)
    with pytest.raises(TypeError, match="topology must be a Topology, got int"):
        planner(2)  # type: ignore[arg-type]
    p = planner(topology())
    with pytest.raises(ValueError, match=r"sharders must be a non-empty list of ModuleSharder, got \[\]"):
        p.plan(ebc([(10, 4)]), [])
    with pytest.raises(TypeError, match="sharders must hold ModuleSharder instances, got str"):
        p.plan(ebc([(10, 4)]), ["ebc"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="module must be an nn.Module, got dict"):
        p.plan({}, [PlanOnlySharder()])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="collective_plan needs an initialised torch.distributed process group"):
        p.collective_plan(ebc([(10, 4)]), [PlanOnlySharder()])
    with pytest.raises(ValueError, match="sort_by must be 'perf' or 'storage', got sort_by='size'"):
        GreedyPerfPartitioner(sort_by="size")
    with pytest.raises(ValueError, match="max_proposals must be a positive int, got max_proposals=0"):
        GridSearchProposer(max_proposals=0)


def test_plans_every_module_its_sharders_cover() -> None:
    model = Model(ebc([(100, 8)]))
    model.sequence = ec([(50, 16), (70, 16)])
    sharders = [PlanOnlySharder(), PlanOnlySharder(module_type=type(model.sequence))]
    plan = planner(topology()).plan(model, sharders)
    assert sorted(plan.plan) == ["sequence", "sparse.ebc"]
    assert set(plan.get_plan_for_module("sequence")) == {"t0", "t1"}
    only_bags = planner(topology()).plan(model, sharders[:1])
    assert list(only_bags.plan) == ["sparse.ebc"]
