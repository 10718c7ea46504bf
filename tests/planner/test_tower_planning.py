"""The planner with a tower sharder (torchrec's ``dependency`` grouping): every tower's tables land on ONE host, with
the sharding types the tower sharder allows, so the plan passes the tower sharders' checks; without the grouping the
same planner splits a tower over hosts (the test's control). Single process: the plans are checked by
:func:`tower_host`, the rule the sharded modules apply; training under planner plans runs in
tests/model_parallel/test_tower_sharding*.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tritonrec.dist import EmbeddingBagCollectionSharder
from tritonrec.dist.embedding_tower_plan import TOWER_SHARDING_TYPES, tower_host
from tritonrec.dist.embedding_tower_sharding import EmbeddingTowerCollectionSharder, EmbeddingTowerSharder
from tritonrec.dist.planner import (
    EmbeddingEnumerator,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from tritonrec.dist.planner import enumerators as enumerators_module
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTower, EmbeddingTowerCollection

# tower -> (table, rows): tower 0 has two large tables, which a per-table greedy placement puts on two hosts
TOWERS = [[("big0", 4000), ("big1", 3600)], [("small0", 40), ("small1", 30)], [("mid0", 900)]]
DIM = 16


class Interaction(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 4)

    def forward(self, pooled: object) -> torch.Tensor:
        return self.linear(pooled.values())  # type: ignore[attr-defined]


def _tower(tables: list[tuple[str, int]]) -> EmbeddingTower:
    configs = [EmbeddingBagConfig(num_embeddings=n, embedding_dim=DIM, name=t, feature_names=[f"f_{t}"])
               for t, n in tables]  # fmt: skip
    return EmbeddingTower(EmbeddingBagCollection(configs), Interaction(DIM * len(tables)))


class Model(nn.Module):
    def __init__(self, towers: list[list[tuple[str, int]]]) -> None:
        super().__init__()
        self.towers = EmbeddingTowerCollection([_tower(t) for t in towers])
        self.other = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=50, embedding_dim=DIM, name="plain",
                                                                feature_names=["f_plain"])])  # fmt: skip


def _plan(model: nn.Module, world: int, local: int, sharders: list, constraints: dict | None = None) -> dict:
    topology = Topology(world, "cpu", local_world_size=local)
    planner = EmbeddingShardingPlanner(topology, batch_size=8, stats=[], constraints=constraints)
    return {path: dict(module_plan) for path, module_plan in planner.plan(model, sharders).plan.items()}


def _sharders() -> list:
    return [EmbeddingTowerCollectionSharder(), EmbeddingBagCollectionSharder()]


@pytest.mark.parametrize(("world", "local"), [(2, 1), (4, 2), (4, 1), (8, 2), (6, 3), (4, 4)])
def test_each_tower_on_one_host_with_tower_sharding_types(world: int, local: int) -> None:
    plan = _plan(Model(TOWERS), world, local, _sharders())["towers"]
    assert sorted(plan) == sorted(t for tower in TOWERS for t, _ in tower)
    hosts = []
    for i, tower in enumerate(TOWERS):
        tables = [t for t, _ in tower]
        assert all(plan[t].sharding_type in TOWER_SHARDING_TYPES for t in tables), plan
        hosts.append(tower_host(f"towers[{i}]", tables, plan, local, world))  # raises on a split tower
    if world // local >= 2:  # the towers are balanced over the hosts, not all put on one
        assert len(set(hosts)) >= 2, hosts


def test_without_the_grouping_the_same_planner_splits_a_tower(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with no ``dependency`` the per-table placement spreads tower 0's two large tables over the
    hosts, which the tower sharders refuse."""
    monkeypatch.setattr(enumerators_module, "tower_dependency", lambda path, module, table: None)
    plan = _plan(Model(TOWERS), 4, 2, _sharders())["towers"]
    with pytest.raises(ValueError, match="different hosts"):
        tower_host("towers[0]", ["big0", "big1"], plan, 2, 4)


def test_enumerated_options_name_their_tower() -> None:
    enumerator = EmbeddingEnumerator(Topology(4, "cpu", local_world_size=2), batch_size=8)
    options = enumerator.enumerate(Model(TOWERS), _sharders())
    dependency = {(o.name, o.dependency) for o in options}
    assert ("big1", "towers.tower_0") in dependency and ("small0", "towers.tower_1") in dependency
    assert ("mid0", "towers.tower_2") in dependency and ("plain", None) in dependency
    assert all(o.dependency is None for o in options if o.name == "plain")


def test_per_tower_sharder_keeps_each_tower_whole() -> None:
    """``EmbeddingTowerSharder`` on each tower of an unsharded collection: the dependency is the tower's path."""
    model = Model(TOWERS)
    plan = _plan(model, 4, 2, [EmbeddingTowerSharder(), EmbeddingBagCollectionSharder()])
    assert sorted(plan) == ["other", "towers.towers.0", "towers.towers.1", "towers.towers.2"]
    for i, tower in enumerate(TOWERS):
        tower_host(f"towers[{i}]", [t for t, _ in tower], plan[f"towers.towers.{i}"], 2, 4)


def test_constraints_pick_the_tower_sharding_type() -> None:
    constraints = {"big1": ParameterConstraints(sharding_types=["table_column_wise"]),
                   "big0": ParameterConstraints(sharding_types=["table_row_wise"])}  # fmt: skip
    plan = _plan(Model(TOWERS), 4, 2, _sharders(), constraints)["towers"]
    assert plan["big1"].sharding_type == "table_column_wise" and plan["big0"].sharding_type == "table_row_wise"
    tower_host("towers[0]", ["big0", "big1"], plan, 2, 4)


def test_a_tower_too_large_for_any_host_names_the_tower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each table fits on a host, the whole tower on none: refused naming the tower and its tables (without the
    grouping the same topology takes the tables, split over the hosts)."""
    big = [[("huge0", 40_000), ("huge1", 40_000)], [("tiny", 10)]]
    topology = Topology(4, "cpu", local_world_size=2, ddr_cap=2_500_000)
    with pytest.raises(PlannerError, match=r"tower 'towers.tower_0' \(tables \['huge0', 'huge1'\]\) fits on no host"):
        EmbeddingShardingPlanner(topology, batch_size=8, stats=[]).plan(Model(big), _sharders())
    monkeypatch.setattr(enumerators_module, "tower_dependency", lambda path, module, table: None)
    EmbeddingShardingPlanner(topology, batch_size=8, stats=[]).plan(Model(big), _sharders())


def test_tower_dependency_refuses_a_table_in_no_tower() -> None:
    with pytest.raises(ValueError, match="'nowhere'"):
        enumerators_module.tower_dependency("towers", Model(TOWERS).towers, "nowhere")


def _sequence_options(module: nn.Module, sharder: object, topology: Topology) -> dict[tuple, object]:
    """(sharding type, kernel, column blocks) -> table ``seq``'s option, estimated."""
    from tritonrec.dist.planner import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    constraints = {"seq": ParameterConstraints(pooling_factors=[6.0, 2.0])}
    estimators = [EmbeddingPerfEstimator(topology), EmbeddingStorageEstimator(topology)]
    enumerator = EmbeddingEnumerator(topology, batch_size=8, constraints=constraints, estimator=estimators)
    options = enumerator.enumerate(module, [sharder])  # type: ignore[list-item]
    return {(o.sharding_type, o.compute_kernel, o.num_column_shards): o for o in options if o.name == "seq"}


@pytest.mark.parametrize("per_tower", [False, True])
def test_a_sequence_table_in_a_tower_is_costed_as_a_sequence_table(per_tower: bool) -> None:
    """An EmbeddingCollection table (two features, 6 and 2 ids per sample) inside a tower gets the options, storage
    and perf the planner gives the same table in a plain EmbeddingCollection under the same sharding types: one
    output row per id, its features counted, not a pooled table's one row per bag."""
    from tests.planner.planner_testing import PlanOnlySharder
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig

    def sequence() -> EmbeddingCollection:
        config = EmbeddingConfig(num_embeddings=300, embedding_dim=DIM, name="seq", feature_names=["fa", "fb"])
        return EmbeddingCollection([config], device="meta")

    topology = Topology(4, "cpu", local_world_size=2)
    tower = EmbeddingTower(sequence(), Interaction(DIM))
    towered = EmbeddingTowerCollection([tower]) if not per_tower else tower
    sharder = EmbeddingTowerSharder() if per_tower else EmbeddingTowerCollectionSharder()
    got = _sequence_options(towered, sharder, topology)
    plain = PlanOnlySharder(EmbeddingCollection, types=list(TOWER_SHARDING_TYPES), kernels=sharder.compute_kernels(
        "table_row_wise", "cpu"))  # fmt: skip
    want = _sequence_options(sequence(), plain, topology)
    assert sorted(got) == sorted(want)
    for key, option in got.items():
        expected = want[key]
        assert option.is_pooled is False and option.output_dim == expected.output_dim, key
        assert option.input_lengths == expected.input_lengths, key
        assert [s.storage for s in option.shards] == [s.storage for s in expected.shards], key
        assert [s.perf for s in option.shards] == [s.perf for s in expected.shards], key


def test_a_fused_table_in_a_tower_is_costed_with_its_optimizer_state() -> None:
    """A fused EBC's table inside a tower gets the storage of the same table in a plain fused EBC (its full Adagrad
    state counted, not the default optimizer's): the planner reads the fused optimizer of the tower's embedding
    module, which the tower itself does not have."""
    from tritonrec.dist.planner import EmbeddingStorageEstimator
    from tritonrec.modules import FusedEmbeddingBagCollection

    def fused() -> FusedEmbeddingBagCollection:
        config = EmbeddingBagConfig(num_embeddings=300, embedding_dim=DIM, name="seq", feature_names=["fa"])
        return FusedEmbeddingBagCollection([config], "EXACT_ADAGRAD", {"lr": 0.1}, device="meta")

    def storages(module: nn.Module, sharder: object) -> dict[tuple, list]:
        topology = Topology(4, "cpu", local_world_size=2)
        enumerator = EmbeddingEnumerator(topology, batch_size=8, estimator=[EmbeddingStorageEstimator(topology)])
        options = enumerator.enumerate(module, [sharder])  # type: ignore[list-item]
        return {(o.sharding_type, o.compute_kernel): [s.storage for s in o.shards] for o in options}

    got = storages(
        EmbeddingTowerCollection([EmbeddingTower(fused(), Interaction(DIM))]), EmbeddingTowerCollectionSharder()
    )
    want = storages(fused(), EmbeddingBagCollectionSharder())
    shared = sorted(set(got) & set(want))
    assert shared, (sorted(got), sorted(want))
    for key in shared:
        assert got[key] == want[key], key
