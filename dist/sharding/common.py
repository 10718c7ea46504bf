"""What every sharding shares: a table's shards read off its :class:`ParameterSharding`, the shards a rank holds
(each a smaller table for the lookup kernels), the columns a sharding's output carries, and the per-batch context.

A shard is ``(rank, row_offset, rows, col_offset, cols)`` of one table. The lookup kernels never see ranks: a shard
is handed to them as a table of ``rows x cols`` whose indices were already made shard-local by the input dist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.sharding.layout import check_table_layout
from tritonrec.dist.types import ParameterSharding, ShardingType
from tritonrec.kernels.embedding import PoolingMode
from tritonrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    PoolingType,
    data_type_to_dtype,
    get_embedding_names_by_table,
    pooling_type_to_pooling_mode,
)

# Sharding types whose shards see only part of each bag: MEAN is looked up as SUM and divided after the output
# dist by the bag length the sample-owning rank holds (the global length).
PARTIAL_BAG_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value)
# Sharding types that split a table's columns (rowwise Adagrad then needs the row's squares from every column block)
COLUMN_SPLIT_TYPES = (
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.GRID_SHARD.value,
)


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a table: where it lives and which part of the ``[rows, dim]`` table it holds."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass(frozen=True)
class ShardedTable:
    """A table of the unsharded module with its placement (``index``: its position in the module's configs;
    ``embedding_names``: the output name of each of its features, ``feature@table`` for a feature other tables of
    the module read too)."""

    index: int
    config: BaseEmbeddingConfig
    sharding: ParameterSharding
    shards: tuple[ShardSpec, ...]
    embedding_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def sharding_type(self) -> str:
        return self.sharding.sharding_type

    @property
    def dtype(self) -> torch.dtype:
        return data_type_to_dtype(self.config.data_type)

    @property
    def pooling(self) -> PoolingMode:
        if not isinstance(self.config, EmbeddingBagConfig):
            return PoolingMode.NONE
        return pooling_type_to_pooling_mode(self.config.pooling)

    @property
    def is_mean(self) -> bool:
        return isinstance(self.config, EmbeddingBagConfig) and self.config.pooling == PoolingType.MEAN

    def column_blocks(self) -> list[tuple[int, int]]:
        """Distinct ``(col_offset, cols)`` blocks of the table, in column order."""
        return sorted({(s.col_offset, s.cols) for s in self.shards})


def table_shards(config: BaseEmbeddingConfig, sharding: ParameterSharding, world_size: int) -> tuple[ShardSpec, ...]:
    """The shards of ``config``'s table under ``sharding``: one per rank for data parallel (the whole table), else
    one per entry of the sharding spec (its placement names the rank)."""
    rows, dim = config.num_embeddings, config.embedding_dim
    if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return tuple(ShardSpec(r, 0, rows, 0, dim) for r in range(world_size))
    shards = []
    for meta in sharding.shards:
        rank = meta.placement.rank()
        (row_offset, col_offset), (n_rows, n_cols) = meta.shard_offsets, meta.shard_sizes
        shards.append(ShardSpec(rank, row_offset, n_rows, col_offset, n_cols))
    return tuple(shards)


def sharded_tables(
    configs: list[BaseEmbeddingConfig], plan: dict[str, ParameterSharding], world_size: int
) -> list[ShardedTable]:
    """Every table of ``configs`` with its placement; raises when the plan misses or mislabels a table."""
    names = [c.name for c in configs]
    unknown = sorted(set(plan) - set(names))
    if unknown:
        raise ValueError(f"the plan names unknown tables {unknown}; the module has tables {names}")
    missing = [n for n in names if n not in plan]
    if missing:
        raise ValueError(f"tables {missing} have no ParameterSharding in the plan: every table needs one")
    out = []
    embedding_names = get_embedding_names_by_table(configs)
    for index, config in enumerate(configs):
        sharding = plan[config.name]
        shards = table_shards(config, sharding, world_size)
        for s in shards:
            if not 0 <= s.rank < world_size:
                raise ValueError(f"table {config.name!r}: shard placed on rank {s.rank}, world_size is {world_size}")
        if not shards:
            raise ValueError(f"table {config.name!r}: {sharding.sharding_type} sharding lists no shards")
        check_table_layout(
            config.name, sharding.sharding_type, config.num_embeddings, config.embedding_dim, shards, world_size
        )
        out.append(ShardedTable(index, config, sharding, shards, tuple(embedding_names[index])))
    return out


def group_by_sharding_type(tables: list[ShardedTable]) -> dict[str, list[ShardedTable]]:
    """Tables per sharding type, types in first-appearance order (every rank derives the same order)."""
    groups: dict[str, list[ShardedTable]] = {}
    for table in tables:
        groups.setdefault(table.sharding_type, []).append(table)
    return groups


_DTYPE_ORDER = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank looks up, as the lookup sees it: a ``rows x cols`` table read by ``features`` (the KJT keys;
    positions in the lookup's feature list are the order the input dist delivers them in)."""

    table: ShardedTable
    shard_index: int
    spec: ShardSpec
    pooling: PoolingMode
    features: tuple[str, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def embedding_names(self) -> tuple[str, ...]:
        """What each of ``features`` is called in the module's output (``feature@table`` when shared)."""
        return self.table.embedding_names


def order_for_lookup(shards: list[LocalShard], config_rank: Mapping[str, int] | None = None) -> list[LocalShard]:
    """Shards grouped by storage dtype, then by fused config (``config_rank``: table name -> its config's position,
    the same on every rank; all one config when None), stable inside a group, so each group's features are
    contiguous in the lookup's input (one kernel launch per group)."""
    ranks = config_rank or {}
    return sorted(shards, key=lambda s: (_DTYPE_ORDER.index(s.dtype), ranks.get(s.table.name, 0)))


@dataclass(frozen=True)
class OutputColumns:
    """Columns of a sharding's output ``[B_me, width]``: for each block, ``(embedding name, col_offset in that
    embedding, width)``, in output order."""

    blocks: tuple[tuple[str, int, int], ...]

    @property
    def width(self) -> int:
        return sum(w for _, _, w in self.blocks)


@dataclass
class ShardingContext:
    """What one sharding's input dist learns about a batch and its output dist needs.

    ``batch_size_per_rank``: every rank's batch (fixed stride). ``lengths``: this rank's bag lengths ``[F, B_me]``
    of the sharding's features in input order (mean division after a partial-bag output dist). VBE:
    ``stride_per_key_per_rank`` of the distributed KJT and ``batch_size_per_feature_pre_a2a``. Sequence:
    ``input_splits`` / ``output_splits`` of the values all-to-all, ``unbucketize_permute``, ``lengths_after_dist``.
    """

    batch_size_per_rank: list[int] = field(default_factory=list)
    lengths: torch.Tensor | None = None
    variable_batch: bool = False
    stride_per_key_per_rank: list[list[int]] | None = None
    batch_size_per_feature_pre_a2a: list[int] = field(default_factory=list)
    input_splits: list[int] = field(default_factory=list)
    output_splits: list[int] = field(default_factory=list)
    unbucketize_permute: torch.Tensor | None = None
    lengths_after_dist: torch.Tensor | None = None
    sparse_features_recat: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.lengths, self.unbucketize_permute, self.lengths_after_dist, self.sparse_features_recat):
            if t is not None and t.is_cuda:
                t.record_stream(stream)  # type: ignore[arg-type]


def select_features(features: KeyedJaggedTensor, names: list[str], cache: dict) -> KeyedJaggedTensor:
    """``features`` restricted to (and ordered like) ``names``, which may repeat a key; no copy when already so."""
    keys = tuple(features.keys())
    if list(keys) == names:
        return features
    indices = cache.get(keys)
    if indices is None:
        index = features.index_per_key()
        missing = [n for n in names if n not in index]
        if missing:
            raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
        indices = [index[n] for n in names]
        cache[keys] = indices
    return features.permute(indices)


def mean_divisor(lengths: torch.Tensor, dims: list[int], is_mean: list[bool]) -> torch.Tensor:
    """``[B, sum(dims)]`` divisor for pooled outputs of features with ``lengths [F, B]``: the bag length (at least 1,
    so an empty bag stays zero) on MEAN features' columns, 1 elsewhere."""
    per_feature = torch.where(
        torch.tensor(is_mean, device=lengths.device)[:, None], lengths.clamp(min=1), torch.ones_like(lengths)
    )
    repeats = torch.tensor(dims, device=lengths.device)
    return per_feature.to(torch.float32).repeat_interleave(repeats, dim=0).T


__all__ = [
    "COLUMN_SPLIT_TYPES",
    "PARTIAL_BAG_TYPES",
    "LocalShard",
    "OutputColumns",
    "ShardSpec",
    "ShardedTable",
    "ShardingContext",
    "group_by_sharding_type",
    "mean_divisor",
    "order_for_lookup",
    "select_features",
    "sharded_tables",
    "table_shards",
]
