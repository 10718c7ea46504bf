"""Hand-written plans (torchrec's ``torchrec.distributed.sharding_plan`` names): per-table generators and
:func:`construct_module_sharding_plan`, plus :func:`calculate_shard_sizes_and_offsets`, which the planner shares.

Example (2 ranks)::

    plan = construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=1), "t1": row_wise(), "t2": column_wise(ranks=[0, 1])},
        sharder=EmbeddingBagCollectionSharder(),
        world_size=2,
        local_size=2,
        device_type="cpu",
    )

A generator is ``(param, local_size, world_size, device_type, sharder) -> ParameterSharding``; an impossible
placement raises ``ValueError`` and :func:`construct_module_sharding_plan` prefixes it with the table's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)
from tritonrec.kernels.checks import check_int

ParameterShardingGenerator = Callable[[nn.Parameter, int, int, str, ModuleSharder[Any]], ParameterSharding]

__all__ = [
    "ParameterShardingGenerator",
    "calculate_shard_sizes_and_offsets",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "grid_shard",
    "placement",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
]


def _row_blocks(rows: int, parts: int) -> list[int]:
    """Rows per part with ``ceil(rows / parts)`` per block (the block size ``block_bucketize`` divides by), so the
    trailing parts may be short or empty: 10 rows in 4 -> [3, 3, 3, 1]; 5 in 4 -> [2, 2, 1, 0]; 1 in 2 -> [1, 0]."""
    block = -(-rows // parts) if rows else 0
    return [max(0, min(block, rows - block * p)) for p in range(parts)]


def _column_blocks(dim: int, parts: int) -> list[int]:
    if dim % parts:
        raise ValueError(f"{parts} column shards do not divide the embedding dim {dim} (dim % shards must be 0)")
    return [dim // parts] * parts


def calculate_shard_sizes_and_offsets(
    rows: int,
    dim: int,
    world_size: int,
    local_world_size: int,
    sharding_type: str | ShardingType,
    num_column_shards: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Per shard ``[rows, cols]`` sizes and ``[row, col]`` global offsets of a ``[rows, dim]`` table.

    ``num_column_shards`` is the number of column blocks for CW / TWCW / GRID (each GRID block is then split row-wise
    over ``local_world_size`` ranks). DP lists one full-table entry per rank; TW one entry.
    """
    kind = ShardingType(sharding_type)
    if kind == ShardingType.DATA_PARALLEL:
        return [[rows, dim] for _ in range(world_size)], [[0, 0] for _ in range(world_size)]
    if kind == ShardingType.TABLE_WISE:
        return [[rows, dim]], [[0, 0]]
    if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        parts = world_size if kind == ShardingType.ROW_WISE else local_world_size
        sizes = _row_blocks(rows, parts)
        starts = [sum(sizes[:p]) for p in range(parts)]
        return [[n, dim] for n in sizes], [[s, 0] for s in starts]
    if num_column_shards is None or num_column_shards < 1:
        raise ValueError(f"{kind.value} needs num_column_shards >= 1, got {num_column_shards!r}")
    widths = _column_blocks(dim, num_column_shards)
    if kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        return [[rows, w] for w in widths], [[0, c * widths[0]] for c in range(num_column_shards)]
    sizes, offsets = [], []  # GRID: column block c is row-wise over one node's local ranks
    row_sizes = _row_blocks(rows, local_world_size)
    for c, width in enumerate(widths):
        for p, n in enumerate(row_sizes):
            sizes.append([n, width])
            offsets.append([sum(row_sizes[:p]), c * width])
    return sizes, offsets


def placement(device_type: str, rank: int, local_size: int) -> str:
    """torchrec's placement string: ``rank:<r>/cpu`` or ``rank:<r>/cuda:<local rank>``."""
    device = device_type if device_type == "cpu" else f"{device_type}:{rank % local_size}"
    return f"rank:{rank}/{device}"


def _default_kernel(sharder: ModuleSharder[Any], sharding_type: str, device_type: str) -> str:
    """The fused kernel where the sharder offers it (what training wants), else the sharder's first kernel."""
    kernels = sharder.compute_kernels(sharding_type, device_type)
    if not kernels:
        raise ValueError(f"the sharder offers no compute kernel for {sharding_type} on {device_type}")
    return EmbeddingComputeKernel.FUSED.value if EmbeddingComputeKernel.FUSED.value in kernels else kernels[0]


def _check_rank(rank: int, world_size: int, what: str) -> int:
    return check_int(rank, what, 0, world_size - 1, what=f"a rank in [0, world_size={world_size})")


def _sharding(
    param: nn.Parameter,
    kind: ShardingType,
    ranks: Sequence[int],
    local_size: int,
    world_size: int,
    device_type: str,
    sharder: ModuleSharder[Any],
    compute_kernel: str | None,
    num_column_shards: int | None = None,
) -> ParameterSharding:
    if param.dim() != 2:
        raise ValueError(f"only 2-D [rows, dim] tables can be sharded, got shape {tuple(param.shape)}")
    ranks = [_check_rank(rank, world_size, "rank") for rank in ranks]
    rows, dim = param.shape
    sizes, offsets = calculate_shard_sizes_and_offsets(rows, dim, world_size, local_size, kind, num_column_shards)
    if len(sizes) != len(ranks):
        raise ValueError(f"{kind.value} makes {len(sizes)} shards but {len(ranks)} ranks were given: {list(ranks)}")
    spec = None
    if kind != ShardingType.DATA_PARALLEL:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=o, shard_sizes=s, placement=placement(device_type, r, local_size))
                for s, o, r in zip(sizes, offsets, ranks, strict=True)
            ]
        )
    kernel = compute_kernel or _default_kernel(sharder, kind.value, device_type)
    return ParameterSharding(kind.value, kernel, list(ranks), spec)


def data_parallel(compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Replicate the table on every rank (gradients all-reduced)."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = list(range(world_size))
        kernel = compute_kernel or EmbeddingComputeKernel.DENSE.value
        return _sharding(param, ShardingType.DATA_PARALLEL, ranks, local_size, world_size, device_type, sharder, kernel)

    return generate


def table_wise(rank: int, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """The whole table on ``rank``."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        return _sharding(
            param, ShardingType.TABLE_WISE, [rank], local_size, world_size, device_type, sharder, compute_kernel
        )

    return generate


def row_wise(compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Row ranges on every rank (``ceil(rows / world_size)`` rows per block; trailing blocks may be empty)."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = list(range(world_size))
        return _sharding(
            param, ShardingType.ROW_WISE, ranks, local_size, world_size, device_type, sharder, compute_kernel
        )

    return generate


def column_wise(ranks: Sequence[int], compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """``len(ranks)`` equal column blocks, block ``i`` on ``ranks[i]`` (a rank may hold several blocks)."""
    ranks = list(ranks)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        if not ranks:
            raise ValueError("column_wise needs at least one rank, got ranks=[]")
        return _sharding(
            param,
            ShardingType.COLUMN_WISE,
            ranks,
            local_size,
            world_size,
            device_type,
            sharder,
            compute_kernel,
            len(ranks),
        )

    return generate


def _host_ranks(host_index: int, local_size: int, world_size: int) -> list[int]:
    hosts = world_size // local_size
    what = f"a host index in [0, {hosts}) (world_size {world_size} / local_size {local_size} = {hosts} hosts)"
    host_index = check_int(host_index, "host_index", 0, hosts - 1, what=what)
    return list(range(host_index * local_size, (host_index + 1) * local_size))


def table_row_wise(host_index: int, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Row-wise over the ``local_size`` ranks of host ``host_index``."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = _host_ranks(host_index, local_size, world_size)
        return _sharding(
            param, ShardingType.TABLE_ROW_WISE, ranks, local_size, world_size, device_type, sharder, compute_kernel
        )

    return generate


def table_column_wise(ranks: Sequence[int], compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Column-wise over ``ranks``, which must all sit on one host."""
    ranks = list(ranks)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        if not ranks:
            raise ValueError("table_column_wise needs at least one rank, got ranks=[]")
        checked = [_check_rank(rank, world_size, "rank") for rank in ranks]
        hosts = {rank // local_size for rank in checked}
        if len(hosts) != 1:
            raise ValueError(f"table_column_wise ranks {ranks} span hosts {sorted(hosts)}; they must share one host")
        return _sharding(
            param,
            ShardingType.TABLE_COLUMN_WISE,
            checked,
            local_size,
            world_size,
            device_type,
            sharder,
            compute_kernel,
            len(ranks),
        )

    return generate


def grid_shard(host_indexes: Sequence[int], compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """``len(host_indexes)`` column blocks, block ``i`` row-wise over the local ranks of host ``host_indexes[i]``."""
    host_indexes = list(host_indexes)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        if not host_indexes:
            raise ValueError("grid_shard needs at least one host index, got host_indexes=[]")
        ranks = [r for h in host_indexes for r in _host_ranks(h, local_size, world_size)]
        return _sharding(
            param,
            ShardingType.GRID_SHARD,
            ranks,
            local_size,
            world_size,
            device_type,
            sharder,
            compute_kernel,
            len(host_indexes),
        )

    return generate


def get_default_sharders() -> list[ModuleSharder[Any]]:
    """One sharder per shardable module type, with default options (torchrec's ``get_default_sharders``)."""
    from tritonrec.dist.embedding import EmbeddingCollectionSharder
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.dist.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
    ]


def get_module_to_default_sharders() -> dict[type, ModuleSharder[Any]]:
    """Module type -> its default sharder."""
    return {sharder.module_type: sharder for sharder in get_default_sharders()}


def _default_sharder(module: nn.Module) -> ModuleSharder[Any]:
    sharders = get_module_to_default_sharders()
    if type(module) in sharders:
        return sharders[type(module)]
    for module_type, sharder in sharders.items():
        if isinstance(module, module_type):
            return sharder
    raise ValueError(
        f"no default sharder shards {type(module).__name__} (default sharders shard "
        f"{sorted(t.__name__ for t in sharders)}); pass sharder="
    )


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: dict[str, ParameterShardingGenerator],
    sharder: ModuleSharder[Any] | None = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """Plan for ``module``: table name -> the generator's :class:`ParameterSharding`.

    Every shardable table must be named exactly once. ``sharder`` defaults to the module type's default sharder
    (:func:`get_module_to_default_sharders`). ``world_size`` / ``local_size`` default to the default process
    group's (``LOCAL_WORLD_SIZE`` or the whole world); ``device_type`` to ``"cuda"`` when available.
    Raises ``ValueError`` naming the table and the reason for an impossible plan.
    """
    import torch.distributed as dist

    from tritonrec.dist.comm import get_local_size

    if sharder is None:
        sharder = _default_sharder(module)
    if not isinstance(sharder, ModuleSharder):
        raise TypeError(f"sharder must be a ModuleSharder, got {type(sharder).__name__}")
    if not isinstance(module, sharder.module_type):
        raise TypeError(f"{type(sharder).__name__} shards {sharder.module_type.__name__}, got {type(module).__name__}")
    if world_size is None:
        world_size = dist.get_world_size()
    if local_size is None:
        local_size = get_local_size(world_size)
    world_size = check_int(world_size, "world_size", 1)
    local_size = check_int(local_size, "local_size", 1, what=f"a positive divisor of world_size {world_size}")
    if world_size % local_size:
        raise ValueError(f"local_size must be a positive divisor of world_size {world_size}, got {local_size!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    shardable = sharder.shardable_parameters(module)
    unknown = sorted(set(per_param_sharding) - set(shardable))
    if unknown:
        raise ValueError(f"unknown tables {unknown}: {type(module).__name__} has tables {sorted(shardable)}")
    missing = [name for name in shardable if name not in per_param_sharding]
    if missing:
        raise ValueError(f"tables {missing} have no sharding: every table of the module needs one")
    supported = sharder.sharding_types(device_type)
    plan = EmbeddingModuleShardingPlan()
    for name, generate in per_param_sharding.items():
        try:
            sharding = generate(shardable[name], local_size, world_size, device_type, sharder)
        except ValueError as err:
            raise ValueError(f"table {name!r}: {err}") from None
        if sharding.sharding_type not in supported:
            raise ValueError(
                f"table {name!r}: {type(sharder).__name__} does not support {sharding.sharding_type} on "
                f"{device_type} (supported: {supported})"
            )
        kernels = sharder.compute_kernels(sharding.sharding_type, device_type)
        if sharding.compute_kernel not in kernels:
            raise ValueError(
                f"table {name!r}: compute kernel {sharding.compute_kernel!r} is not supported for "
                f"{sharding.sharding_type} on {device_type} (supported: {kernels})"
            )
        plan[name] = sharding
    return plan
