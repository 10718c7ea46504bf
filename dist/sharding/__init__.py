"""One module per sharding type, each building its input dist, local lookup and output dist from the existing
pieces (KJTAllToAll, block bucketizing, the table-batched lookups, the pooled/sequence embedding collectives)."""

from __future__ import annotations

from typing import Any

import torch

from tritonrec.dist.embedding_lookup import FusedConfigs
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharding.base import EmbeddingSharding
from tritonrec.dist.sharding.common import (
    LocalShard,
    OutputColumns,
    ShardedTable,
    ShardingContext,
    ShardSpec,
    sharded_tables,
)
from tritonrec.dist.sharding.dp import DpSharding
from tritonrec.dist.sharding.rw import RwSharding
from tritonrec.dist.sharding.tw import CwSharding, TwCwSharding, TwCwTableColumnSharding
from tritonrec.dist.sharding.twrw import GridSharding, TwRwSharding
from tritonrec.dist.types import ShardingEnv, ShardingType

SHARDING_CLASSES: dict[str, type[EmbeddingSharding]] = {
    ShardingType.DATA_PARALLEL.value: DpSharding,
    ShardingType.TABLE_WISE.value: TwCwSharding,
    ShardingType.COLUMN_WISE.value: CwSharding,
    ShardingType.TABLE_COLUMN_WISE.value: TwCwTableColumnSharding,
    ShardingType.ROW_WISE.value: RwSharding,
    ShardingType.TABLE_ROW_WISE.value: TwRwSharding,
    ShardingType.GRID_SHARD.value: GridSharding,
}


def build_shardings(
    tables: list[ShardedTable],
    env: ShardingEnv,
    device: torch.device,
    options: object,
    codecs_registry: dict[str, QuantizedCommCodecs] | None,
    pooled: bool,
) -> list[EmbeddingSharding]:
    """One sharding per (sharding type, compute kernel), in order of first appearance among the tables (every rank
    derives the same list from the same plan). ``options``: the module's ``LookupOptions``; tables with a fused
    optimizer of their own (``options.table_fused``) pass it to their sharding per table."""
    by_key: dict[tuple[str, str], list[ShardedTable]] = {}
    for table in tables:
        by_key.setdefault((table.sharding_type, table.sharding.compute_kernel), []).append(table)
    shardings = []
    for i, ((sharding_type, kernel), group) in enumerate(by_key.items()):
        cls = SHARDING_CLASSES[sharding_type]
        shardings.append(
            cls(
                group,
                env,
                device,
                kernel,
                _fused_configs(options, group),
                codecs_registry,
                pooled=pooled,
                bounds_check=options.bounds_check,  # type: ignore[attr-defined]
                backend=options.backend,  # type: ignore[attr-defined]
                seed_base=16 * i,
            )
        )
    return shardings


def _fused_configs(options: Any, tables: list[ShardedTable]) -> FusedConfigs:
    """``options.fused`` (a ``LookupOptions``) when no table has its own, else table name -> its config."""
    if not options.table_fused:
        return options.fused  # type: ignore[no-any-return]
    return {t.name: options.fused_of(t.name) for t in tables}


__all__ = [
    "SHARDING_CLASSES",
    "CwSharding",
    "DpSharding",
    "EmbeddingSharding",
    "GridSharding",
    "LocalShard",
    "OutputColumns",
    "RwSharding",
    "ShardSpec",
    "ShardedTable",
    "ShardingContext",
    "TwCwSharding",
    "TwCwTableColumnSharding",
    "TwRwSharding",
    "build_shardings",
    "sharded_tables",
]
