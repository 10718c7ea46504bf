"""Plans of tower-sharded modules: which sharding types a tower takes, which host it lands on, and the plan its
embedding module is then sharded by inside that host (torchrec's ``embedding_tower_sharding`` rules).

A tower is placed on ONE host (``LOCAL_WORLD_SIZE`` consecutive ranks; one rank per host when
``LOCAL_WORLD_SIZE=1``): every table of the tower is ``table_row_wise`` or ``table_column_wise`` on that host's
ranks. Inside the host the tower's embedding module is sharded over the host's own process group, the table-row-wise
tables row-wise and the table-column-wise ones column-wise, with the ranks renumbered to the host's local ranks
(:func:`intra_node_plan`). torchrec asserts all this; here a plan that breaks it is refused with a ``ValueError``
naming the tower, the table and its ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

from tritonrec.dist.embedding import EmbeddingCollectionSharder
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.sharding_plan import placement
from tritonrec.dist.types import ModuleSharder, ParameterSharding, ShardingType
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.embedding_tower import EmbeddingTower

# torchrec's EmbeddingTowerSharder.sharding_types: the tower stays on one host, its tables split over its ranks
TOWER_SHARDING_TYPES = [ShardingType.TABLE_ROW_WISE.value, ShardingType.TABLE_COLUMN_WISE.value]
# what each becomes inside the host
_INTRA_NODE_TYPE = {
    ShardingType.TABLE_ROW_WISE.value: ShardingType.ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value: ShardingType.COLUMN_WISE.value,
}


def check_tower(tower: object, name: str) -> EmbeddingTower:
    """``tower`` as an :class:`EmbeddingTower` whose embedding module a tower sharder can shard."""
    if not isinstance(tower, EmbeddingTower):
        raise TypeError(f"{name} must be an EmbeddingTower, got {type(tower).__name__}")
    if not isinstance(tower.embedding, (EmbeddingBagCollection, EmbeddingCollection)):
        raise TypeError(
            f"{name}.embedding must be an EmbeddingBagCollection or an EmbeddingCollection to be tower-sharded, "
            f"got {type(tower.embedding).__name__}"
        )
    return tower


def embedding_sharder(
    tower: EmbeddingTower,
    fused_params: dict | None,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None,
) -> ModuleSharder[nn.Module]:
    """The sharder of ``tower``'s embedding module (EBC or EC sharder, with the tower sharder's options)."""
    if isinstance(tower.embedding, EmbeddingCollection):
        return EmbeddingCollectionSharder(fused_params, qcomm_codecs_registry)  # type: ignore[return-value]
    return EmbeddingBagCollectionSharder(fused_params, qcomm_codecs_registry)  # type: ignore[return-value]


def tower_table_names(tower: EmbeddingTower) -> list[str]:
    """``tower``'s table names, in config order."""
    embedding = tower.embedding
    if isinstance(embedding, EmbeddingCollection):
        return [c.name for c in embedding.embedding_configs()]
    return [c.name for c in embedding.embedding_bag_configs()]  # type: ignore[operator]


def tower_feature_names(tower: EmbeddingTower) -> tuple[list[str], list[str]]:
    """``(features, weighted_features)`` keys ``tower`` reads: a weighted EBC's features all go to the weighted KJT,
    any other module's to the plain one (torchrec's ``embedding_feature_names``; a feature read by two tables of the
    tower is listed once)."""
    embedding = tower.embedding
    if isinstance(embedding, EmbeddingCollection):
        configs, weighted = embedding.embedding_configs(), False
    else:
        configs, weighted = embedding.embedding_bag_configs(), embedding.is_weighted()  # type: ignore[operator]
    names = list(dict.fromkeys(f for c in configs for f in c.feature_names))
    return ([], names) if weighted else (names, [])


def tower_host(
    tower_name: str,
    tables: list[str],
    plan: Mapping[str, ParameterSharding],
    local_size: int,
    world_size: int,
) -> int:
    """The host every table of ``tower_name`` lives on; ``ValueError`` for a table missing from ``plan``, of a
    sharding type other than :data:`TOWER_SHARDING_TYPES`, with ranks outside the world, or on another host than the
    tower's other tables."""
    hosts: dict[int, str] = {}
    for table in tables:
        if table not in plan:
            raise ValueError(f"{tower_name}: table {table!r} has no ParameterSharding in the plan")
        sharding = plan[table]
        if sharding.sharding_type not in TOWER_SHARDING_TYPES:
            raise ValueError(
                f"{tower_name}: table {table!r} is {sharding.sharding_type}; a tower's tables must be one of "
                f"{TOWER_SHARDING_TYPES} (the tower runs on one host)"
            )
        ranks = shard_ranks(sharding)
        bad = [r for r in ranks if not 0 <= r < world_size]
        if not ranks or bad:
            raise ValueError(f"{tower_name}: table {table!r} has shards on ranks {ranks}, world_size is {world_size}")
        table_hosts = sorted({r // local_size for r in ranks})
        if len(table_hosts) != 1:
            raise ValueError(
                f"{tower_name}: table {table!r} has shards on ranks {ranks}, which span hosts {table_hosts} "
                f"(hosts of {local_size} ranks); a tower's tables must sit on one host"
            )
        hosts.setdefault(table_hosts[0], table)
    if len(hosts) != 1:
        placed = {h: f"{t!r} on host {h}" for h, t in hosts.items()}
        raise ValueError(
            f"{tower_name}: its tables are on different hosts ({', '.join(placed.values())}; hosts of {local_size} "
            "ranks); all tables of a tower must sit on the same host"
        )
    return next(iter(hosts))


def shard_ranks(sharding: ParameterSharding) -> list[int]:
    """The rank of each shard: read off the sharding spec's placements (what the sharded modules use), else
    ``ranks``."""
    if sharding.sharding_spec is not None:
        return [s.placement.rank() for s in sharding.shards]
    return list(sharding.ranks or [])


def intra_node_plan(plan: Mapping[str, ParameterSharding], local_size: int) -> dict[str, ParameterSharding]:
    """``plan`` as the tower's host sees it: table-row-wise -> row-wise, table-column-wise -> column-wise, every rank
    (in ``ranks`` and in the shards' placements) taken modulo ``local_size``. The input plan is left unchanged
    (torchrec rewrites it in place)."""
    out = {}
    for table, sharding in plan.items():
        local = copy.copy(sharding)
        local.sharding_type = _INTRA_NODE_TYPE[sharding.sharding_type]
        local.ranks = [r % local_size for r in sharding.ranks] if sharding.ranks else sharding.ranks
        if sharding.sharding_spec is not None:
            local.sharding_spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=list(s.shard_offsets),
                        shard_sizes=list(s.shard_sizes),
                        placement=placement(s.placement.device().type, s.placement.rank() % local_size, local_size),
                    )
                    for s in sharding.shards
                ]
            )
        out[table] = local
    return out


__all__ = [
    "TOWER_SHARDING_TYPES",
    "check_tower",
    "embedding_sharder",
    "intra_node_plan",
    "shard_ranks",
    "tower_feature_names",
    "tower_host",
    "tower_table_names",
]
