"""Hand-written plans (torchrec's ``torchrec.distributed.sharding_plan`` names): per-table generators and
:func:`construct_module_sharding_plan`, plus :func:`calculate_shard_sizes_and_offsets`, which the planner shares.

Example (2 ranks)::

    plan = construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=1), "t1": row_wise(), "t2": column_wise(size_per_rank=[24, 8])},
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

from tritonrec.dist.sharding_plan_checks import (
    check_column_widths,
    check_device_types,
    check_one_host_ranks,
    check_plan_tables,
    check_rank,
    check_row_buckets,
    check_row_wise_args,
    check_sharder,
    check_supported,
    check_world_sizes,
    column_blocks,
    host_ranks,
    row_blocks,
    uneven_column_blocks,
    uneven_row_blocks,
)
from tritonrec.dist.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)

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
        sizes = row_blocks(rows, parts)
        starts = [sum(sizes[:p]) for p in range(parts)]
        return [[n, dim] for n in sizes], [[s, 0] for s in starts]
    if num_column_shards is None or num_column_shards < 1:
        raise ValueError(f"{kind.value} needs num_column_shards >= 1, got {num_column_shards!r}")
    widths = column_blocks(dim, num_column_shards)
    if kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        return [[rows, w] for w in widths], [[0, c * widths[0]] for c in range(num_column_shards)]
    sizes, offsets = [], []  # GRID: column block c is row-wise over one node's local ranks
    row_sizes = row_blocks(rows, local_world_size)
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
    column_widths: Sequence[int] | None = None,
    devices: Sequence[str] | None = None,
    row_sizes: Sequence[int] | None = None,
) -> ParameterSharding:
    """``column_widths``: uneven column blocks (column-wise only) instead of ``num_column_shards`` equal ones;
    ``row_sizes``: uneven row blocks (row-wise only), block ``p`` on rank ``p``; ``devices``: per shard, the device
    type its placement names instead of ``device_type``."""
    if param.dim() != 2:
        raise ValueError(f"only 2-D [rows, dim] tables can be sharded, got shape {tuple(param.shape)}")
    ranks = [check_rank(rank, world_size, "rank") for rank in ranks]
    rows, dim = param.shape
    if column_widths is not None:
        sizes, offsets = uneven_column_blocks(rows, dim, column_widths)
    elif row_sizes is not None:
        sizes, offsets = uneven_row_blocks(rows, dim, row_sizes, world_size)
    else:
        sizes, offsets = calculate_shard_sizes_and_offsets(rows, dim, world_size, local_size, kind, num_column_shards)
    if len(sizes) != len(ranks):
        raise ValueError(f"{kind.value} makes {len(sizes)} shards but {len(ranks)} ranks were given: {list(ranks)}")
    devices = [device_type] * len(ranks) if devices is None else list(devices)
    spec = None
    if kind != ShardingType.DATA_PARALLEL:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=o, shard_sizes=s, placement=placement(d, r, local_size))
                for s, o, r, d in zip(sizes, offsets, ranks, devices, strict=True)
            ]
        )
    kernel = compute_kernel or _default_kernel(sharder, kind.value, device_type)
    return ParameterSharding(kind.value, kernel, list(ranks), spec)


def data_parallel(compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Replicate the table on every rank (gradients all-reduced). The default kernel is dense (torchrec's), or fused
    for a table updated inside the backward: one that ``apply_optimizer_in_backward`` gave an optimizer, or a table of
    a fused collection (both carry ``_in_backward_optimizers``; the dense kernel would silently drop their optimizer
    and hand the table to the dense one)."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = list(range(world_size))
        kernel = compute_kernel or EmbeddingComputeKernel.DENSE.value
        if compute_kernel is None and hasattr(param, "_in_backward_optimizers"):
            kernel = _default_kernel(sharder, ShardingType.DATA_PARALLEL.value, device_type)
        return _sharding(param, ShardingType.DATA_PARALLEL, ranks, local_size, world_size, device_type, sharder, kernel)

    return generate


def table_wise(rank: int, device: str | None = None, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """The whole table on ``rank``; ``device`` (a device type, e.g. ``"cpu"``) names the placement's device instead
    of the plan's ``device_type`` (torchrec's inference use: a table kept in host memory). Our sharded modules read
    only the placement's rank: the shard lives on the module's device whatever ``device`` says."""
    check_device_types(None if device is None else [device], "device", single=True)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        kind, devices = ShardingType.TABLE_WISE, None if device is None else [device]
        return _sharding(
            param, kind, [rank], local_size, world_size, device_type, sharder, compute_kernel, devices=devices
        )

    return generate


def row_wise(
    sizes_placement: tuple[list[int], str | list[str]] | None = None,
    compute_kernel: str | None = None,
    num_buckets: int | None = None,
) -> ParameterShardingGenerator:
    """Row ranges on every rank: ``ceil(rows / world_size)`` rows per block (trailing blocks may be empty), or
    ``sizes_placement=(rows per rank, device type)``: uneven blocks, ``sizes[p]`` rows on rank ``p`` (one count per
    rank, non-negative, summing to the table's rows; a rank may hold none), the placement naming the device type
    (one string, or one per rank; as for :func:`table_wise`'s ``device``, the shard lives on the module's device).
    The row-wise input dist then bucketizes ids by the blocks' row boundaries.

    ``num_buckets`` (torchrec's managed-collision buckets; it must divide the rows and be >= ``world_size``): whole
    buckets per rank, ``num_buckets // world_size`` each and one more on the first ``num_buckets % world_size`` ranks,
    as torchrec lays them out; where that is not the ceil layout the blocks are uneven, as with ``sizes_placement``.
    """
    rows, devices, num_buckets = check_row_wise_args(sizes_placement, num_buckets)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        uneven_rows = {"devices": devices, "row_sizes": rows}
        if num_buckets is not None:
            uneven_rows["row_sizes"] = check_row_buckets(param.shape[0], world_size, num_buckets)
        kind, ranks = ShardingType.ROW_WISE, list(range(world_size))
        return _sharding(
            param, kind, ranks, local_size, world_size, device_type, sharder, compute_kernel, **uneven_rows
        )

    return generate


def column_wise(
    ranks: Sequence[int] | None = None,
    size_per_rank: Sequence[int] | None = None,
    compute_kernel: str | None = None,
    device_types: Sequence[str] | None = None,
) -> ParameterShardingGenerator:
    """Column blocks of the table (torchrec's ``column_wise``).

    * ``ranks`` only: ``len(ranks)`` equal blocks, block ``i`` on ``ranks[i]`` (a rank may hold several blocks).
    * ``size_per_rank``: uneven blocks of these widths (each >= 1, summing to the table's dim), block ``i`` on rank
      ``i`` as torchrec places them, or on ``ranks[i]`` when ``ranks`` is given too (then of the same length).
    * ``device_types``: per block, the device type its placement names (default: the plan's ``device_type``; as
      for :func:`table_wise`'s ``device``, the shard lives on the module's device whatever it says).
    """
    ranks = None if ranks is None else list(ranks)
    widths = check_column_widths(ranks, size_per_rank)
    devices = check_device_types(device_types, "device_types")

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        placed = ranks if ranks is not None else list(range(len(widths or ())))
        if devices is not None and len(devices) != len(placed):
            raise ValueError(f"device_types={devices} must name one device type per column block ({len(placed)})")
        return _sharding(
            param,
            ShardingType.COLUMN_WISE,
            placed,
            local_size,
            world_size,
            device_type,
            sharder,
            compute_kernel,
            len(placed),
            column_widths=widths,
            devices=devices,
        )

    return generate


def table_row_wise(host_index: int, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Row-wise over the ``local_size`` ranks of host ``host_index``."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = host_ranks(host_index, local_size, world_size)
        return _sharding(
            param, ShardingType.TABLE_ROW_WISE, ranks, local_size, world_size, device_type, sharder, compute_kernel
        )

    return generate


def table_column_wise(ranks: Sequence[int], compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Column-wise over ``ranks``, which must all sit on one host."""
    ranks = list(ranks)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        checked = check_one_host_ranks(ranks, local_size, world_size)
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
        ranks = [r for h in host_indexes for r in host_ranks(h, local_size, world_size)]
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
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
        QuantEmbeddingCollectionSharder(),
        ManagedCollisionEmbeddingBagCollectionSharder(),
        ManagedCollisionEmbeddingCollectionSharder(),
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
    check_sharder(sharder, module)
    if world_size is None:
        world_size = dist.get_world_size()
    if local_size is None:
        local_size = get_local_size(world_size)
    world_size, local_size = check_world_sizes(world_size, local_size)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    shardable = sharder.shardable_parameters(module)
    check_plan_tables(per_param_sharding, shardable, type(module).__name__)
    plan = EmbeddingModuleShardingPlan()
    for name, generate in per_param_sharding.items():
        try:
            sharding = generate(shardable[name], local_size, world_size, device_type, sharder)
        except ValueError as err:
            raise ValueError(f"table {name!r}: {err}") from None
        check_supported(name, sharding, sharder, device_type)
        plan[name] = sharding
    return plan
