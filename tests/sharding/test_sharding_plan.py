"""Plan types and hand-written plans: shard sizes/offsets per sharding type, plan tables, impossible plans."""

from __future__ import annotations

import pytest

from tritonrec.dist.sharding_plan import (
    calculate_shard_sizes_and_offsets,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig


class _PlanOnlySharder(ModuleSharder[EmbeddingBagCollection]):
    """Enough of a sharder to build plans (the real sharders live in tritonrec.dist)."""

    def __init__(self, types: list[str] | None = None) -> None:
        super().__init__()
        self._types = types or [t.value for t in ShardingType]

    def shard(self, module, params, env, device=None, module_fqn=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def shardable_parameters(self, module):  # type: ignore[no-untyped-def]
        return {name: bag.weight for name, bag in module.embedding_bags.items()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return self._types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


def _ebc(rows: int = 10, dim: int = 4) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(2)
    ]
    return EmbeddingBagCollection(tables, device="meta")


@pytest.mark.parametrize(
    ("rows", "parts", "expected"),
    [(10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0]), (1, 2, [1, 0]), (0, 3, [0, 0, 0]), (8, 2, [4, 4])],
)
def test_row_wise_blocks_use_ceil_block_size(rows: int, parts: int, expected: list[int]) -> None:
    sizes, offsets = calculate_shard_sizes_and_offsets(rows, 3, parts, parts, "row_wise")
    assert [s[0] for s in sizes] == expected
    assert [o[0] for o in offsets] == [sum(expected[:p]) for p in range(parts)]
    assert all(s[1] == 3 for s in sizes) and all(o[1] == 0 for o in offsets)


def test_grid_and_column_shapes() -> None:
    sizes, offsets = calculate_shard_sizes_and_offsets(5, 8, 4, 2, "grid_shard", num_column_shards=2)
    assert sizes == [[3, 4], [2, 4], [3, 4], [2, 4]]
    assert offsets == [[0, 0], [3, 0], [0, 4], [3, 4]]
    sizes, offsets = calculate_shard_sizes_and_offsets(5, 6, 2, 2, ShardingType.COLUMN_WISE, num_column_shards=3)
    assert sizes == [[5, 2]] * 3 and offsets == [[0, 0], [0, 2], [0, 4]]
    with pytest.raises(ValueError, match="do not divide the embedding dim 6"):
        calculate_shard_sizes_and_offsets(5, 6, 2, 2, "column_wise", num_column_shards=4)


def test_construct_plan_every_type_and_str() -> None:
    sharder = _PlanOnlySharder()
    plan = construct_module_sharding_plan(
        _ebc(),
        {"t0": table_wise(rank=3), "t1": grid_shard(host_indexes=[0, 1])},
        sharder,
        local_size=2,
        world_size=4,
        device_type="cpu",
    )
    assert plan["t0"].ranks == [3] and plan["t0"].compute_kernel == "fused"
    assert [list(s.shard_sizes) for s in plan["t0"].shards] == [[10, 4]]
    assert plan["t1"].ranks == [0, 1, 2, 3]
    assert [str(s.placement) for s in plan["t1"].shards] == [f"rank:{r}/cpu" for r in range(4)]
    for generators in (
        {"t0": data_parallel(), "t1": row_wise()},
        {"t0": table_row_wise(host_index=1), "t1": column_wise(ranks=[1, 1])},
        {"t0": table_column_wise(ranks=[2, 3]), "t1": table_wise(rank=0)},
    ):
        built = construct_module_sharding_plan(
            _ebc(), generators, sharder, local_size=2, world_size=4, device_type="cpu"
        )
        assert set(built) == {"t0", "t1"}
    dp = construct_module_sharding_plan(
        _ebc(), {"t0": data_parallel(), "t1": row_wise()}, sharder, local_size=2, world_size=4, device_type="cpu"
    )
    assert dp["t0"].sharding_spec is None and dp["t0"].ranks == [0, 1, 2, 3]
    assert dp["t0"].compute_kernel == "dense"
    text = str(ShardingPlan({"sparse.ebc": plan}))
    assert "module: sparse.ebc" in text and "table_wise" in text and "rank:3/cpu" in text


def test_data_parallel_defaults_to_the_fused_kernel_for_a_fused_collections_tables() -> None:
    """A fused collection's tables update inside the backward: the dense kernel would silently drop their optimizer
    (the table then trained by the dense optimizer, or not at all), so data_parallel() picks fused for them, as for
    tables given an optimizer by apply_optimizer_in_backward; a plain collection's tables stay dense (torchrec's)."""
    from tritonrec.modules import FusedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0"])]
    fused = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    sharder = _PlanOnlySharder()
    plan = construct_module_sharding_plan(fused, {"t0": data_parallel()}, sharder, 2, 2, "cpu")
    assert plan["t0"].compute_kernel == "fused"
    plan = construct_module_sharding_plan(fused, {"t0": data_parallel(compute_kernel="dense")}, sharder, 2, 2, "cpu")
    assert plan["t0"].compute_kernel == "dense"  # named explicitly: left to the sharded module to judge
    plain = EmbeddingBagCollection(tables, backend="torch")
    plan = construct_module_sharding_plan(plain, {"t0": data_parallel()}, sharder, 2, 2, "cpu")
    assert plan["t0"].compute_kernel == "dense"


@pytest.mark.parametrize(
    ("generators", "message"),
    [
        ({"t0": table_wise(rank=4), "t1": row_wise()}, r"table 't0': rank must be .*world_size=4\), got rank=4"),
        ({"t0": column_wise(ranks=[0, 1, 2]), "t1": row_wise()}, r"table 't0': 3 column shards do not divide"),
        ({"t0": row_wise(), "t1": row_wise(), "t9": row_wise()}, r"unknown tables \['t9'\]"),
        ({"t0": row_wise()}, r"tables \['t1'\] have no sharding"),
        ({"t0": table_row_wise(host_index=2), "t1": row_wise()}, r"table 't0': host_index must be .*got host_index=2"),
        ({"t0": table_column_wise(ranks=[1, 2]), "t1": row_wise()}, r"table 't0': .* span hosts \[0, 1\]"),
        ({"t0": row_wise(compute_kernel="quant"), "t1": row_wise()}, r"table 't0': compute kernel 'quant'"),
    ],
)
def test_impossible_plans_name_table_and_reason(generators: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        construct_module_sharding_plan(
            _ebc(), generators, _PlanOnlySharder(), local_size=2, world_size=4, device_type="cpu"
        )


def test_unsupported_sharding_type_on_device() -> None:
    sharder = _PlanOnlySharder(types=["table_wise"])
    with pytest.raises(ValueError, match=r"table 't1': _PlanOnlySharder does not support row_wise on cpu"):
        construct_module_sharding_plan(
            _ebc(), {"t0": table_wise(0), "t1": row_wise()}, sharder, local_size=2, world_size=2, device_type="cpu"
        )


def test_types_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="sharding_type must be one of"):
        ParameterSharding("diagonal", "fused")
    with pytest.raises(ValueError, match="compute_kernel must be one of"):
        ParameterSharding("table_wise", "magic")
    assert ParameterSharding(ShardingType.ROW_WISE, EmbeddingComputeKernel.FUSED).sharding_type == "row_wise"
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got rank=2"):
        ShardingEnv.from_local(2, 2)
    env = ShardingEnv.from_local(4, 1)
    assert (env.world_size, env.rank, env.process_group) == (4, 1, None)
    assert isinstance(EmbeddingModuleShardingPlan(), dict)


def _cpu_plan(generators: dict, rows: int = 10, dim: int = 4, world_size: int = 4) -> EmbeddingModuleShardingPlan:
    return construct_module_sharding_plan(
        _ebc(rows, dim), generators, _PlanOnlySharder(), local_size=2, world_size=world_size, device_type="cpu"
    )


def test_column_wise_uneven_blocks_follow_size_per_rank() -> None:
    plan = _cpu_plan(
        {"t0": column_wise(size_per_rank=[1, 5, 2]), "t1": column_wise(ranks=[3, 1], size_per_rank=[6, 2])}, dim=8
    )
    # torchrec: block i on rank i; with ranks= too, block i on ranks[i]
    assert plan["t0"].ranks == [0, 1, 2]
    assert [list(s.shard_sizes) for s in plan["t0"].shards] == [[10, 1], [10, 5], [10, 2]]
    assert [list(s.shard_offsets) for s in plan["t0"].shards] == [[0, 0], [0, 1], [0, 6]]
    assert plan["t1"].ranks == [3, 1]
    assert [list(s.shard_offsets) for s in plan["t1"].shards] == [[0, 0], [0, 6]]
    assert [str(s.placement) for s in plan["t1"].shards] == ["rank:3/cpu", "rank:1/cpu"]


def test_device_arguments_name_the_placement_device() -> None:
    plan = _cpu_plan(
        {"t0": table_wise(2, "cuda", compute_kernel="dense"), "t1": column_wise([0, 1], device_types=["cpu", "cuda"])}
    )
    assert [str(s.placement) for s in plan["t0"].shards] == ["rank:2/cuda:0"]
    assert plan["t0"].compute_kernel == "dense"
    assert [str(s.placement) for s in plan["t1"].shards] == ["rank:0/cpu", "rank:1/cuda:1"]


def test_row_wise_sizes_placement_gives_uneven_row_blocks() -> None:
    plan = _cpu_plan(
        {"t0": row_wise(([4, 0, 5, 1], "cpu")), "t1": row_wise(([0, 10, 0, 0], ["cpu", "cuda", "cpu", "cuda"]))}
    )
    assert plan["t0"].sharding_type == "row_wise" and plan["t0"].ranks == [0, 1, 2, 3]
    assert [list(s.shard_sizes) for s in plan["t0"].shards] == [[4, 4], [0, 4], [5, 4], [1, 4]]
    assert [list(s.shard_offsets) for s in plan["t0"].shards] == [[0, 0], [4, 0], [4, 0], [9, 0]]
    assert [str(s.placement) for s in plan["t0"].shards] == [f"rank:{r}/cpu" for r in range(4)]
    assert [list(s.shard_offsets) for s in plan["t1"].shards] == [[0, 0], [0, 0], [10, 0], [10, 0]]
    assert [str(s.placement) for s in plan["t1"].shards] == [
        "rank:0/cpu",
        "rank:1/cuda:1",
        "rank:2/cpu",
        "rank:3/cuda:1",
    ]
    assert plan["t0"].compute_kernel == "fused"  # the sharder's default, as for row_wise()


def test_row_wise_num_buckets_accepted_where_it_keeps_the_ceil_layout() -> None:
    plan = _cpu_plan({"t0": row_wise(num_buckets=8), "t1": row_wise(num_buckets=4)}, rows=16)
    assert [s.shard_sizes[0] for s in plan["t0"].shards] == [4, 4, 4, 4]
    assert plan["t0"] == plan["t1"] == _cpu_plan({"t0": row_wise(), "t1": row_wise()}, rows=16)["t0"]


@pytest.mark.parametrize(
    ("rows", "num_buckets", "sizes"),
    # torchrec 1.8's _calculate_rw_shard_sizes_and_offsets gives these rows per rank (checked in a scratch run)
    [(10, 5, [4, 2, 2, 2]), (30, 6, [10, 10, 5, 5]), (12, 6, [4, 4, 2, 2])],
)
def test_row_wise_num_buckets_places_whole_buckets_as_uneven_blocks(rows: int, num_buckets: int, sizes: list) -> None:
    plan = _cpu_plan({"t0": row_wise(num_buckets=num_buckets), "t1": row_wise()}, rows=rows)
    assert [s.shard_sizes[0] for s in plan["t0"].shards] == sizes
    assert [s.shard_offsets[0] for s in plan["t0"].shards] == [sum(sizes[:r]) for r in range(4)]
    uneven = _cpu_plan({"t0": row_wise((sizes, "cpu")), "t1": row_wise()}, rows=rows)["t0"]
    assert plan["t0"] == uneven  # the same plan as the uneven blocks written out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: column_wise(), r"column_wise needs ranks= or size_per_rank="),
        (lambda: column_wise(size_per_rank=[]), r"size_per_rank=\[\]"),
        (lambda: column_wise(size_per_rank=[4, 0]), r"size_per_rank must be .*got size_per_rank=0"),
        (lambda: column_wise(size_per_rank="dense"), r"size_per_rank must be a list .*got size_per_rank='dense'"),
        (lambda: column_wise([0, 1], [2, 1, 1]), r"ranks=\[0, 1\] and size_per_rank=\[2, 1, 1\] must have the same"),
        (lambda: column_wise([0], device_types="cpu"), r"device_types must name device types .*'cpu'"),
        (lambda: table_wise(0, "fused"), r"device must name device types .*device='fused' .*pass compute_kernel="),
        (lambda: row_wise("dense"), r"got sizes_placement='dense' \(a compute kernel name\? pass compute_kernel="),
        (lambda: row_wise(([5, 5],)), r"sizes_placement must be \(rows per rank, device type\), got .*\(\[5, 5\],\)"),
        (lambda: row_wise(([], "cpu")), r"sizes_placement\[0\] must be a non-empty list .*got \[\]"),
        (
            lambda: row_wise(([5, -1], "cpu")),
            r"sizes_placement must be a list of non-negative .*got sizes_placement=-1",
        ),
        (lambda: row_wise(([5, 2.5], "cpu")), r"sizes_placement must be .*got sizes_placement=2.5"),
        (
            lambda: row_wise(([5, 5], "fused")),
            r"sizes_placement\[1\] must name device types .*'fused' .*compute_kernel=",
        ),
        (lambda: row_wise(([5, 5], None)), r"sizes_placement\[1\] must name device types .*=None"),
        (lambda: row_wise(([5, 5], "tpu")), r"sizes_placement\[1\] must name device types .*'tpu' is not a torch dev"),
        (lambda: table_wise(0, "gpu"), r"device must name device types .*'gpu' is not a torch device type"),
        (lambda: column_wise([0, 1], device_types=["cpu", "xpux"]), r"device_types must .*'xpux' is not a torch"),
        (lambda: row_wise(([5, 5], ["cpu"])), r"sizes_placement\[1\]=\['cpu'\] must name one device type per row"),
        (lambda: row_wise(([5, 5], "cpu"), num_buckets=2), r"sizes_placement or num_buckets, got both"),
        (lambda: row_wise(num_buckets=0), r"num_buckets must be .*got num_buckets=0"),
    ],
)
def test_generator_arguments_are_checked_when_made(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("generators", "message"),
    [
        ({"t0": column_wise(size_per_rank=[1, 2]), "t1": row_wise()}, r"t0.*size_per_rank=\[1, 2\] sums to 3 .*dim 4"),
        ({"t0": column_wise(size_per_rank=[2, 3]), "t1": row_wise()}, r"t0.*sums to 5"),
        ({"t0": column_wise(ranks=[0, 4], size_per_rank=[1, 3]), "t1": row_wise()}, r"got rank=4"),
        ({"t0": column_wise([0, 1], device_types=["cpu"]), "t1": row_wise()}, r"device_types=\['cpu'\] must name one"),
        ({"t0": row_wise(num_buckets=2), "t1": row_wise()}, r"t0.*num_buckets=2 must be >= world_size 4"),
        ({"t0": row_wise(num_buckets=4), "t1": row_wise()}, r"t0.*num_buckets=4 must divide the table's 10 rows"),
        (
            {"t0": row_wise(([5, 4, 0, 0], "cpu")), "t1": row_wise()},
            r"t0.*sizes_placement=\[5, 4, 0, 0\] sums to 9 rows",
        ),
        ({"t0": row_wise(), "t1": row_wise(([5, 5], "cpu"))}, r"t1.*sizes_placement gives 2 row counts \[5, 5\]; .*4"),
    ],
)
def test_impossible_uneven_plans_name_table_and_argument(generators: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cpu_plan(generators, rows=10, dim=4)
