"""A plan's shards must be a layout of the table they shard: a plan made for another table size, an edited
``shard_sizes`` or a spec of another sharding type is rejected when the sharded module reads it (``sharded_tables``,
which every sharded collection builds from), naming the table.

Before the check, such a plan was taken as given: a row-wise spec leaving row 3 of a 7-row table out looked row 3 up
on the wrong rank (DMP's pooled output off by 0.69 against the unsharded module on 2 gloo ranks), and a spec made
for a 10-row table failed on one rank in its first forward while the other waited out the process group's timeout.
"""

from __future__ import annotations

import copy

import pytest

from tritonrec.dist.sharding.common import sharded_tables
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
from tritonrec.dist.types import ShardMetadata
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

WORLD = 2


def _ebc(rows: int = 7, dim: int = 8) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["a"]),
        EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name="t1", feature_names=["b"]),
    ]
    return EmbeddingBagCollection(tables, device="meta")


def _plan(t1: object, rows: int = 7, dim: int = 8) -> dict:
    generators = {"t0": table_wise(rank=1, compute_kernel="dense"), "t1": t1}
    return construct_module_sharding_plan(_ebc(rows, dim), generators, None, WORLD, WORLD, "cpu")


def _check(plan: dict, rows: int = 7, dim: int = 8) -> None:
    sharded_tables(_ebc(rows, dim).embedding_bag_configs(), plan, WORLD)


@pytest.mark.parametrize(
    "t1",
    [
        row_wise(compute_kernel="dense"),
        column_wise([1, 0], compute_kernel="dense"),
        column_wise([0, 0, 1, 1], compute_kernel="dense"),
        table_row_wise(0, "dense"),
        table_column_wise([0, 1], compute_kernel="dense"),
        grid_shard([0, 0], "dense"),
        data_parallel(),
        table_wise(0, compute_kernel="dense"),
    ],
)
def test_plans_of_every_type_are_accepted(t1: object) -> None:
    _check(_plan(t1))


def _edited(t1: object, edit: object) -> dict:
    plan = copy.deepcopy(_plan(t1))
    edit(plan["t1"])  # type: ignore[operator]
    return plan


def _set(index: int, field: str, value: list[int]) -> object:
    return lambda sharding: setattr(sharding.sharding_spec.shards[index], field, value)


def _swap_placements(sharding: object) -> None:
    shards = sharding.sharding_spec.shards  # type: ignore[attr-defined]
    shards[0].placement, shards[1].placement = shards[1].placement, shards[0].placement


def _drop_last(sharding: object) -> None:
    sharding.sharding_spec.shards.pop()  # type: ignore[attr-defined]


def _add_shard(sharding: object) -> None:
    shard = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[7, 8], placement="rank:0/cpu")
    sharding.sharding_spec.shards.append(shard)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            _edited(row_wise(compute_kernel="dense"), _set(0, "shard_sizes", [3, 8])),
            "cover 48 of the \\[7, 8\\] table's 56",
        ),
        (_plan(row_wise(compute_kernel="dense"), rows=10), "rows \\[5, 10\\) x columns \\[0, 8\\) on rank 1, outside"),
        (_plan(row_wise(compute_kernel="dense"), rows=4), "cover 32 of the \\[7, 8\\] table's 56"),
        (_plan(column_wise([0, 1], compute_kernel="dense"), dim=16), "outside the \\[7, 8\\] table"),
        (_edited(row_wise(compute_kernel="dense"), _set(1, "shard_offsets", [3, 0])), "shards overlap"),
        (
            _edited(row_wise(compute_kernel="dense"), _swap_placements),
            "row_wise places its row blocks on ranks \\[1, 0\\]",
        ),
        (_edited(row_wise(compute_kernel="dense"), _set(0, "shard_sizes", [2, 8])), "cover 40"),
        (_edited(column_wise([0, 1], compute_kernel="dense"), _drop_last), "cover 28"),
        (_edited(table_wise(0, compute_kernel="dense"), _add_shard), "shards overlap"),
        (
            _edited(column_wise([0, 1], compute_kernel="dense"), lambda s: setattr(s, "sharding_type", "table_wise")),
            "one shard",
        ),
        (
            _edited(row_wise(compute_kernel="dense"), lambda s: setattr(s, "sharding_type", "column_wise")),
            "hold every row",
        ),
        (
            _edited(column_wise([0, 1], compute_kernel="dense"), lambda s: setattr(s, "sharding_type", "row_wise")),
            "every column",
        ),
    ],
)
def test_plan_that_does_not_lay_out_the_table_names_it(plan: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"table 't1': .*{message}"):
        _check(plan)


def test_uneven_row_wise_blocks_are_accepted() -> None:
    # rows [0, 3) and [3, 7): the input dist bucketizes by these row boundaries
    plan = _edited(row_wise(compute_kernel="dense"), _set(0, "shard_sizes", [3, 8]))
    plan["t1"].sharding_spec.shards[1].shard_offsets = [3, 0]
    plan["t1"].sharding_spec.shards[1].shard_sizes = [4, 8]
    _check(plan)
    _check(_plan(row_wise(([0, 7], "cpu"), compute_kernel="dense")))


def test_row_wise_blocks_must_follow_rank_order() -> None:
    plan = _plan(row_wise(([4, 3], "cpu"), compute_kernel="dense"))
    shards = plan["t1"].sharding_spec.shards  # rank 0 gets rows [4, 7), rank 1 rows [0, 4)
    shards[0].shard_offsets, shards[0].shard_sizes = [4, 0], [3, 8]
    shards[1].shard_offsets, shards[1].shard_sizes = [0, 0], [4, 8]
    with pytest.raises(ValueError, match="table 't1': row_wise shard 0 holds rows \\[4, 7\\) but the input dist"):
        _check(plan)


def test_table_row_wise_blocks_must_be_the_input_dists_blocks() -> None:
    # rows [0, 3) and [3, 7) tile the table, but table-row-wise sends ids by blocks of ceil(7 / 2) = 4 rows
    plan = _edited(table_row_wise(0, "dense"), _set(0, "shard_sizes", [3, 8]))
    plan["t1"].sharding_spec.shards[1].shard_offsets = [3, 0]
    plan["t1"].sharding_spec.shards[1].shard_sizes = [4, 8]
    with pytest.raises(ValueError, match="table 't1': table_row_wise shard 0 holds rows \\[0, 3\\) .*ceil\\(7 / 2\\)"):
        _check(plan)
