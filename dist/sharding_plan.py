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

import itertools
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
    column_widths: Sequence[int] | None = None,
    devices: Sequence[str] | None = None,
) -> ParameterSharding:
    """``column_widths``: uneven column blocks (column-wise only) instead of ``num_column_shards`` equal ones;
    ``devices``: per shard, the device type its placement names instead of ``device_type``."""
    if param.dim() != 2:
        raise ValueError(f"only 2-D [rows, dim] tables can be sharded, got shape {tuple(param.shape)}")
    ranks = [_check_rank(rank, world_size, "rank") for rank in ranks]
    rows, dim = param.shape
    if column_widths is None:
        sizes, offsets = calculate_shard_sizes_and_offsets(rows, dim, world_size, local_size, kind, num_column_shards)
    else:
        sizes, offsets = _uneven_column_blocks(rows, dim, column_widths)
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


def _uneven_column_blocks(rows: int, dim: int, widths: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    if sum(widths) != dim:
        raise ValueError(
            f"size_per_rank={list(widths)} sums to {sum(widths)} columns; it must sum to the embedding dim {dim}"
        )
    starts = itertools.accumulate(widths[:-1], initial=0)
    return [[rows, w] for w in widths], [[0, c] for c in starts]


def _check_device_types(device_types: Sequence[str] | None, name: str) -> list[str] | None:
    """Device type names (``"cpu"``, ``"cuda"``); a compute kernel name there is an argument in the wrong place
    (torchrec's ``table_wise(rank, device, compute_kernel)`` puts ``device`` second)."""
    if device_types is None:
        return None
    kernels = {k.value for k in EmbeddingComputeKernel}
    given = device_types[0] if name == "device" else device_types
    if isinstance(device_types, str) or not all(isinstance(d, str) and d and d not in kernels for d in device_types):
        hint = " (a compute kernel name: pass compute_kernel=)" if set(map(str, device_types)) & kernels else ""
        raise ValueError(f"{name} must name device types such as 'cpu' or 'cuda', got {name}={given!r}{hint}")
    return list(device_types)


def data_parallel(compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """Replicate the table on every rank (gradients all-reduced)."""

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        ranks = list(range(world_size))
        kernel = compute_kernel or EmbeddingComputeKernel.DENSE.value
        return _sharding(param, ShardingType.DATA_PARALLEL, ranks, local_size, world_size, device_type, sharder, kernel)

    return generate


def table_wise(rank: int, device: str | None = None, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """The whole table on ``rank``; ``device`` (a device type, e.g. ``"cpu"``) names the placement's device instead
    of the plan's ``device_type`` (torchrec's inference use: a table kept in host memory). Our sharded modules read
    only the placement's rank: the shard lives on the module's device whatever ``device`` says."""
    _check_device_types(None if device is None else [device], "device")

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        devices = None if device is None else [device]
        return _sharding(
            param,
            ShardingType.TABLE_WISE,
            [rank],
            local_size,
            world_size,
            device_type,
            sharder,
            compute_kernel,
            devices=devices,
        )

    return generate


def row_wise(
    sizes_placement: tuple[list[int], str | list[str]] | None = None,
    compute_kernel: str | None = None,
    num_buckets: int | None = None,
) -> ParameterShardingGenerator:
    """Row ranges on every rank (``ceil(rows / world_size)`` rows per block; trailing blocks may be empty).

    torchrec's other two arguments are checked, not ignored: ``sizes_placement`` (uneven row blocks for inference)
    is refused, because our row-wise input dist sends every rank a ``ceil(rows / world_size)`` block; ``num_buckets``
    (managed-collision buckets, whole buckets per rank) is accepted where its layout is that same one (``rows``
    divisible by ``num_buckets``, ``num_buckets`` by ``world_size``) and refused otherwise.
    """
    if sizes_placement is not None:
        hint = " (a compute kernel name? pass compute_kernel=)" if isinstance(sizes_placement, str) else ""
        raise ValueError(
            f"row_wise(sizes_placement={sizes_placement!r}) is not supported{hint}: uneven row blocks need a "
            "per-rank block bucketizer, and our row-wise input dist sends every rank a ceil(rows / world_size) "
            "block; use row_wise() or column_wise(size_per_rank=...)"
        )
    if num_buckets is not None:
        num_buckets = check_int(num_buckets, "num_buckets", 1)

    def generate(param, local_size, world_size, device_type, sharder):  # type: ignore[no-untyped-def]
        if num_buckets is not None:
            _check_row_buckets(param.shape[0], world_size, num_buckets)
        ranks = list(range(world_size))
        return _sharding(
            param, ShardingType.ROW_WISE, ranks, local_size, world_size, device_type, sharder, compute_kernel
        )

    return generate


def _check_row_buckets(rows: int, world_size: int, num_buckets: int) -> None:
    """torchrec's bucketed row layout (``num_buckets // W`` whole buckets per rank, the first ``num_buckets % W``
    ranks one more) must be the ceil layout the input dist implements."""
    if num_buckets < world_size:
        raise ValueError(f"num_buckets={num_buckets} must be >= world_size {world_size}: a bucket cannot be split")
    if rows % num_buckets:
        raise ValueError(f"num_buckets={num_buckets} must divide the table's {rows} rows")
    bucket = rows // num_buckets
    per_rank, extra = divmod(num_buckets, world_size)
    bucketed = [bucket * (per_rank + (r < extra)) for r in range(world_size)]
    ceil_blocks = _row_blocks(rows, world_size)
    if bucketed != ceil_blocks:
        raise ValueError(
            f"num_buckets={num_buckets} places rows {bucketed} on the {world_size} ranks, but our row-wise input dist "
            f"sends ceil(rows / world_size) blocks {ceil_blocks}; use a num_buckets that world_size divides"
        )


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
    if ranks is not None and not ranks:
        raise ValueError("column_wise needs at least one rank, got ranks=[]")
    widths = None
    if size_per_rank is not None:
        if isinstance(size_per_rank, (str, int)):
            raise ValueError(f"size_per_rank must be a list of column counts, got size_per_rank={size_per_rank!r}")
        widths = [check_int(w, "size_per_rank", 1, what="a list of positive column counts") for w in size_per_rank]
        if not widths:
            raise ValueError("column_wise needs at least one column block, got size_per_rank=[]")
        if ranks is not None and len(ranks) != len(widths):
            raise ValueError(
                f"ranks={ranks} and size_per_rank={widths} must have the same length (block i goes on ranks[i])"
            )
    elif ranks is None:
        raise ValueError("column_wise needs ranks= or size_per_rank=, got neither")
    devices = _check_device_types(device_types, "device_types")

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
