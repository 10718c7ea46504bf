"""Argument checks of the hand-written plan generators in :mod:`tritonrec.dist.sharding_plan`.

Each helper raises ``ValueError`` (``NotAnIntError`` for a non-integer) naming the argument and the offending value;
:func:`~tritonrec.dist.sharding_plan.construct_module_sharding_plan` prefixes the table's name. The row and column
block layouts live here too, because the checks compare a requested layout against them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tritonrec.dist.types import EmbeddingComputeKernel, ModuleSharder, ParameterSharding
from tritonrec.kernels.checks import check_int

__all__ = [
    "check_column_widths",
    "check_device_types",
    "check_one_host_ranks",
    "check_plan_tables",
    "check_rank",
    "check_row_buckets",
    "check_row_wise_args",
    "check_sharder",
    "check_supported",
    "check_world_sizes",
    "column_blocks",
    "host_ranks",
    "row_blocks",
    "uneven_column_blocks",
    "uneven_row_blocks",
]


def row_blocks(rows: int, parts: int) -> list[int]:
    """Rows per part with ``ceil(rows / parts)`` per block (the block size ``block_bucketize`` divides by), so the
    trailing parts may be short or empty: 10 rows in 4 -> [3, 3, 3, 1]; 5 in 4 -> [2, 2, 1, 0]; 1 in 2 -> [1, 0]."""
    block = -(-rows // parts) if rows else 0
    return [max(0, min(block, rows - block * p)) for p in range(parts)]


def column_blocks(dim: int, parts: int) -> list[int]:
    """``parts`` equal column widths of a ``dim``-wide table; ``ValueError`` unless ``parts`` divides ``dim``."""
    if dim % parts:
        raise ValueError(f"{parts} column shards do not divide the embedding dim {dim} (dim % shards must be 0)")
    return [dim // parts] * parts


def uneven_column_blocks(rows: int, dim: int, widths: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Per block ``[rows, width]`` sizes and ``[0, first column]`` offsets; ``widths`` must sum to ``dim``."""
    if sum(widths) != dim:
        raise ValueError(
            f"size_per_rank={list(widths)} sums to {sum(widths)} columns; it must sum to the embedding dim {dim}"
        )
    starts = itertools.accumulate(widths[:-1], initial=0)
    return [[rows, w] for w in widths], [[0, c] for c in starts]


def uneven_row_blocks(
    rows: int, dim: int, sizes: Sequence[int], world_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Per rank ``[sizes[p], dim]`` sizes and ``[first row, 0]`` offsets (``row_wise(sizes_placement=...)``);
    ``sizes`` must hold one row count per rank and sum to ``rows``."""
    if len(sizes) != world_size:
        raise ValueError(
            f"sizes_placement gives {len(sizes)} row counts {list(sizes)}; row_wise needs one per rank "
            f"(world_size {world_size})"
        )
    if sum(sizes) != rows:
        raise ValueError(
            f"sizes_placement={list(sizes)} sums to {sum(sizes)} rows; it must sum to the table's {rows} rows"
        )
    starts = itertools.accumulate(sizes[:-1], initial=0)
    return [[n, dim] for n in sizes], [[r, 0] for r in starts]


def check_row_wise_args(
    sizes_placement: tuple[Sequence[int], str | Sequence[str]] | None, num_buckets: int | None
) -> tuple[list[int] | None, list[str] | None, int | None]:
    """``row_wise``'s arguments -> ``(rows per rank, device type per rank, num_buckets)``: ``sizes_placement`` is
    ``(non-negative row counts, one device type or one per count)``, and excludes ``num_buckets``."""
    if num_buckets is not None:
        num_buckets = check_int(num_buckets, "num_buckets", 1)
    if sizes_placement is None:
        return None, None, num_buckets
    if isinstance(sizes_placement, str) or not isinstance(sizes_placement, Sequence) or len(sizes_placement) != 2:
        hint = " (a compute kernel name? pass compute_kernel=)" if isinstance(sizes_placement, str) else ""
        raise ValueError(
            f"sizes_placement must be (rows per rank, device type), got sizes_placement={sizes_placement!r}{hint}"
        )
    sizes, device = sizes_placement
    if isinstance(sizes, str) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"sizes_placement[0] must be a non-empty list of row counts per rank, got {sizes!r}")
    rows = [check_int(n, "sizes_placement", 0, what="a list of non-negative row counts") for n in sizes]
    if isinstance(device, str) or not isinstance(device, Sequence):
        devices = check_device_types([device], "sizes_placement[1]", single=True) or []
        devices = devices * len(rows)
    else:
        devices = check_device_types(device, "sizes_placement[1]") or []
        if len(devices) != len(rows):
            raise ValueError(
                f"sizes_placement[1]={devices} must name one device type per row count ({len(rows)}: {rows})"
            )
    if num_buckets is not None:
        raise ValueError(f"row_wise takes sizes_placement or num_buckets, got both (num_buckets={num_buckets})")
    return rows, devices, num_buckets


def check_rank(rank: int, world_size: int, what: str) -> int:
    """``rank`` as an int in ``[0, world_size)``; the error names the argument ``what``."""
    return check_int(rank, what, 0, world_size - 1, what=f"a rank in [0, world_size={world_size})")


def check_device_types(device_types: Sequence[str] | None, name: str, single: bool = False) -> list[str] | None:
    """Device type names (``"cpu"``, ``"cuda"``); a compute kernel name there is an argument in the wrong place
    (torchrec's ``table_wise(rank, device, compute_kernel)`` puts ``device`` second). ``single``: the argument
    ``name`` is one string, passed here as ``[it]`` (the error shows the string)."""
    if device_types is None:
        return None
    kernels = {k.value for k in EmbeddingComputeKernel}
    given = device_types[0] if single else device_types
    if isinstance(device_types, str) or not all(isinstance(d, str) and d and d not in kernels for d in device_types):
        hint = " (a compute kernel name: pass compute_kernel=)" if set(map(str, device_types)) & kernels else ""
        raise ValueError(f"{name} must name device types such as 'cpu' or 'cuda', got {name}={given!r}{hint}")
    for device in device_types:
        try:
            torch.device(device)
        except RuntimeError:  # torch's own message lists its device types but names no argument
            raise ValueError(
                f"{name} must name device types such as 'cpu' or 'cuda', got {name}={given!r} ({device!r} is not a "
                "torch device type)"
            ) from None
    return list(device_types)


def check_row_buckets(rows: int, world_size: int, num_buckets: int) -> list[int] | None:
    """torchrec's bucketed row layout: ``num_buckets // W`` whole buckets of ``rows // num_buckets`` rows per rank, the
    first ``num_buckets % W`` ranks one more. Returns the rows per rank, or ``None`` where that is the ceil layout
    (``ceil(rows / W)`` per rank, what a plain ``row_wise()`` sends)."""
    if num_buckets < world_size:
        raise ValueError(f"num_buckets={num_buckets} must be >= world_size {world_size}: a bucket cannot be split")
    if rows % num_buckets:
        raise ValueError(f"num_buckets={num_buckets} must divide the table's {rows} rows")
    bucket = rows // num_buckets
    per_rank, extra = divmod(num_buckets, world_size)
    bucketed = [bucket * (per_rank + (r < extra)) for r in range(world_size)]
    return None if bucketed == row_blocks(rows, world_size) else bucketed


def check_column_widths(ranks: list[int] | None, size_per_rank: Sequence[int] | None) -> list[int] | None:
    """``column_wise``'s ``ranks`` / ``size_per_rank``: the uneven block widths (``None`` for equal blocks over
    ``ranks``); each width a positive int, one per rank when both are given, and at least one of the two given."""
    if ranks is not None and not ranks:
        raise ValueError("column_wise needs at least one rank, got ranks=[]")
    if size_per_rank is None:
        if ranks is None:
            raise ValueError("column_wise needs ranks= or size_per_rank=, got neither")
        return None
    if isinstance(size_per_rank, (str, int)):
        raise ValueError(f"size_per_rank must be a list of column counts, got size_per_rank={size_per_rank!r}")
    widths = [check_int(w, "size_per_rank", 1, what="a list of positive column counts") for w in size_per_rank]
    if not widths:
        raise ValueError("column_wise needs at least one column block, got size_per_rank=[]")
    if ranks is not None and len(ranks) != len(widths):
        raise ValueError(
            f"ranks={ranks} and size_per_rank={widths} must have the same length (block i goes on ranks[i])"
        )
    return widths


def host_ranks(host_index: int, local_size: int, world_size: int) -> list[int]:
    """The ``local_size`` consecutive ranks of host ``host_index`` (checked to be a host of the world)."""
    hosts = world_size // local_size
    what = f"a host index in [0, {hosts}) (world_size {world_size} / local_size {local_size} = {hosts} hosts)"
    host_index = check_int(host_index, "host_index", 0, hosts - 1, what=what)
    return list(range(host_index * local_size, (host_index + 1) * local_size))


def check_one_host_ranks(ranks: Sequence[int], local_size: int, world_size: int) -> list[int]:
    """``table_column_wise``'s ``ranks``: at least one, each a rank of the world, all on one host."""
    if not ranks:
        raise ValueError("table_column_wise needs at least one rank, got ranks=[]")
    checked = [check_rank(rank, world_size, "rank") for rank in ranks]
    hosts = {rank // local_size for rank in checked}
    if len(hosts) != 1:
        raise ValueError(f"table_column_wise ranks {list(ranks)} span hosts {sorted(hosts)}; they must share one host")
    return checked


def check_world_sizes(world_size: int, local_size: int) -> tuple[int, int]:
    """``(world_size, local_size)`` as ints: a positive world size and a positive divisor of it."""
    world_size = check_int(world_size, "world_size", 1)
    local_size = check_int(local_size, "local_size", 1, what=f"a positive divisor of world_size {world_size}")
    if world_size % local_size:
        raise ValueError(f"local_size must be a positive divisor of world_size {world_size}, got {local_size!r}")
    return world_size, local_size


def check_plan_tables(per_param_sharding: Mapping[str, object], shardable: Mapping[str, object], module: str) -> None:
    """Every shardable table of ``module`` (its type name) named exactly once in ``per_param_sharding``."""
    unknown = sorted(set(per_param_sharding) - set(shardable))
    if unknown:
        raise ValueError(f"unknown tables {unknown}: {module} has tables {sorted(shardable)}")
    missing = [name for name in shardable if name not in per_param_sharding]
    if missing:
        raise ValueError(f"tables {missing} have no sharding: every table of the module needs one")


def check_sharder(sharder: object, module: nn.Module) -> None:
    """``TypeError`` unless ``sharder`` is a :class:`ModuleSharder` of ``module``'s type."""
    if not isinstance(sharder, ModuleSharder):
        raise TypeError(f"sharder must be a ModuleSharder, got {type(sharder).__name__}")
    if not isinstance(module, sharder.module_type):
        raise TypeError(f"{type(sharder).__name__} shards {sharder.module_type.__name__}, got {type(module).__name__}")


def check_supported(name: str, sharding: ParameterSharding, sharder: ModuleSharder[Any], device_type: str) -> None:
    """Table ``name``'s sharding type and compute kernel must be ones ``sharder`` offers on ``device_type``."""
    supported = sharder.sharding_types(device_type)
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
