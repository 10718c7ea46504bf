"""Checks that a table's shards, as a plan lists them, are a layout its sharding type can run.

A hand-written or edited plan (a ``ParameterSharding`` built for another table size, an edited ``shard_sizes``, a
spec of another sharding type) used to be taken as given: shards that left rows out looked those rows up in the wrong
place (silently wrong embeddings), and shards larger than the table made one rank fail in its first forward while the
others waited on it until the process group's timeout. :func:`check_table_layout` rejects such a plan when the
sharded module is built, naming the table and the shard.

What each type needs (``rows x dim`` table, shards in plan order):

* every type: each shard inside the table, no two overlapping, together covering it exactly;
* table-wise: one shard;
* column-wise / table-column-wise: every shard holds all rows (any column blocks);
* row-wise: one shard per rank, shard ``p`` on rank ``p`` holding the ``p``-th block of rows in row order (the
  input dist bucketizes ids by ``ceil(rows / W)`` blocks, or by the shards' row boundaries when they are uneven);
* table-row-wise: the same over the consecutive ranks of one host;
* grid: each column block laid out as table-row-wise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tritonrec.dist.types import ShardingType


class _Shard(Protocol):
    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


def _where(shard: _Shard) -> str:
    return (
        f"rows [{shard.row_offset}, {shard.row_offset + shard.rows}) x columns "
        f"[{shard.col_offset}, {shard.col_offset + shard.cols}) on rank {shard.rank}"
    )


def _check_tiling(name: str, rows: int, dim: int, shards: Sequence[_Shard]) -> None:
    for s in shards:
        if (
            min(s.row_offset, s.rows, s.col_offset) < 0
            or s.cols < 1
            or s.row_offset + s.rows > rows
            or s.col_offset + s.cols > dim
        ):
            raise ValueError(f"table {name!r}: a shard holds {_where(s)}, outside the [{rows}, {dim}] table")
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            rows_meet = a.row_offset < b.row_offset + b.rows and b.row_offset < a.row_offset + a.rows
            cols_meet = a.col_offset < b.col_offset + b.cols and b.col_offset < a.col_offset + a.cols
            if rows_meet and cols_meet:
                raise ValueError(f"table {name!r}: shards overlap: {_where(a)} and {_where(b)}")
    covered = sum(s.rows * s.cols for s in shards)
    if covered != rows * dim:
        raise ValueError(
            f"table {name!r}: the shards cover {covered} of the [{rows}, {dim}] table's {rows * dim} entries; "
            "together they must cover it exactly (was the plan made for a table of another size?)"
        )


def _check_row_blocks(name: str, kind: str, rows: int, shards: Sequence[_Shard], world_size: int) -> None:
    """``shards`` (one table, or one column block of a grid table) row-wise over consecutive ranks in order."""
    from tritonrec.dist.sharding_plan import calculate_shard_sizes_and_offsets

    parts = len(shards)
    first = shards[0].rank
    if kind == ShardingType.ROW_WISE.value:
        expected_ranks = list(range(world_size))
    else:  # one host's local ranks
        expected_ranks = list(range(first, first + parts)) if first % parts == 0 else []
    ranks = [s.rank for s in shards]
    if ranks != expected_ranks or world_size % parts:
        want = "every rank in order" if kind == ShardingType.ROW_WISE.value else "one host's local ranks in order"
        raise ValueError(f"table {name!r}: {kind} places its row blocks on ranks {ranks}; it needs {want}")
    if kind == ShardingType.ROW_WISE.value:  # any row blocks in rank order: the input dist sends by boundaries
        starts = [sum(s.rows for s in shards[:p]) for p in range(parts)]
        sizes, offsets = [[s.rows] for s in shards], [[start] for start in starts]
        why = "row blocks follow each other in rank order"
    else:
        sizes, offsets = calculate_shard_sizes_and_offsets(rows, 1, parts, parts, ShardingType.ROW_WISE)
        why = f"blocks of ceil({rows} / {parts}) rows in rank order"
    for p, s in enumerate(shards):
        if [s.rows, s.row_offset] != [sizes[p][0], offsets[p][0]]:
            raise ValueError(
                f"table {name!r}: {kind} shard {p} holds rows [{s.row_offset}, {s.row_offset + s.rows}) but the "
                f"input dist sends it rows [{offsets[p][0]}, {offsets[p][0] + sizes[p][0]}) ({why})"
            )


def check_table_layout(name: str, kind: str, rows: int, dim: int, shards: Sequence[_Shard], world_size: int) -> None:
    """Raise ``ValueError`` naming table ``name`` when ``shards`` are not a ``kind`` layout of a ``[rows, dim]``
    table on ``world_size`` ranks (data-parallel tables are not checked: every rank holds the whole table)."""
    if kind == ShardingType.DATA_PARALLEL.value:
        return
    _check_tiling(name, rows, dim, shards)
    if kind == ShardingType.TABLE_WISE.value and len(shards) != 1:
        raise ValueError(f"table {name!r}: table_wise needs one shard, the plan lists {len(shards)}")
    if kind in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
        for s in shards:
            if s.rows != rows:
                raise ValueError(f"table {name!r}: {kind} shards hold every row, but one holds {_where(s)}")
    if kind in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
        for s in shards:
            if s.cols != dim:
                raise ValueError(f"table {name!r}: {kind} shards hold every column, but one holds {_where(s)}")
        _check_row_blocks(name, kind, rows, shards, world_size)
    if kind == ShardingType.GRID_SHARD.value:
        blocks: dict[tuple[int, int], list[_Shard]] = {}
        for s in shards:
            blocks.setdefault((s.col_offset, s.cols), []).append(s)
        for block in blocks.values():
            _check_row_blocks(name, kind, rows, block, world_size)


__all__ = ["check_table_layout"]
