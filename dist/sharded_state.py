"""State dicts of sharded collections: what ``torch.distributed.checkpoint`` (DCP) saves and re-shards.

* ``state_dict()`` holds ``<container>.<table>.weight`` for every table on every rank: a ``ShardedTensor`` of the
  global ``[rows, dim]`` whose local shards are this rank's shards (views of the live weights, with their global
  offsets), or, for data-parallel tables, the local replica. DCP saves it, and loads into another module's
  ``state_dict()`` whatever its plan: it reads each local shard's region of the saved global tensor (re-sharding),
  in place.
* ``load_state_dict`` takes those ``ShardedTensor``\\ s (their local shards must cover this rank's shards: what DCP
  loaded into) or an unsharded module's full tensors, of which each rank keeps its slice.
* :func:`fused_optimizer_state_dict` / :func:`load_fused_optimizer_state_dict`: the fused optimizer state keyed by
  table (``momentum1``: per row ``[rows]`` for rowwise Adagrad, per element ``[rows, dim]`` for Adam and
  per-element Adagrad; ``momentum2``; ``step``), sharded like the weights; per-row state of column-split tables is
  saved once per row range and copied to the other column blocks after a load. The fused optimizer's own
  ``state_dict`` is the same state under parameter names (:mod:`tritonrec.dist.sharded_fused_optimizer`).
* :func:`gather_unsharded_state_dict`: the unsharded module's state dict, assembled on one rank (export).

Why ``ShardedTensor`` rather than ``DTensor``: a plan places arbitrary shards on arbitrary ranks (a whole table on
rank 1, column blocks on repeated ranks, grid blocks), which an ``EnumerableShardingSpec`` describes exactly; DCP
re-shards it on gloo/CPU (tested).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata

from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.sharding.common import ShardedTable, ShardSpec
from tritonrec.dist.types import EmbeddingComputeKernel, ShardingType


def _placement(rank: int, device: torch.device) -> str:
    return f"rank:{rank}/{device}"


def sharded_tensor(
    table: ShardedTable,
    local: list[tuple[ShardSpec, torch.Tensor]],
    pg: dist.ProcessGroup,
    device: torch.device,
    rowwise: bool = False,
) -> ShardedTensor:
    """A ``ShardedTensor`` of ``table``'s global ``[rows, dim]`` (``rowwise``: ``[rows]`` per-row state, one shard
    per row range, held by the first column block's holder) from this rank's ``(spec, tensor)`` pairs.
    Zero-size shards are left out."""
    rows, dim = table.config.num_embeddings, table.config.embedding_dim
    first_block = min(s.col_offset for s in table.shards)

    def meta(s: ShardSpec) -> ShardMetadata:
        # placements name global ranks; a module sharded over a sub-group (a tower's host) numbers its shards by
        # group rank
        where = _placement(dist.get_global_rank(pg, s.rank) if pg is not None else s.rank, device)
        if rowwise:
            return ShardMetadata([s.row_offset], [s.rows], where)
        return ShardMetadata([s.row_offset, s.col_offset], [s.rows, s.cols], where)

    def kept(s: ShardSpec) -> bool:
        return s.rows > 0 and s.cols > 0 and (not rowwise or s.col_offset == first_block)

    shards_meta = [meta(s) for s in table.shards if kept(s)]
    local_shards = [Shard(t, meta(s)) for s, t in local if kept(s)]
    dtype = local[0][1].dtype if local else table.dtype
    size = torch.Size([rows] if rowwise else [rows, dim])
    metadata = ShardedTensorMetadata(shards_meta, size, TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=pg)


def is_data_parallel(table: ShardedTable) -> bool:
    return table.sharding_type == ShardingType.DATA_PARALLEL.value


def table_shape(table: ShardedTable, rowwise: bool = False) -> tuple[int, ...]:
    """The global shape of ``table``'s weight (``rowwise``: of its per-row state)."""
    rows, dim = table.config.num_embeddings, table.config.embedding_dim
    return (rows,) if rowwise else (rows, dim)


def check_full_shape(name: str, source: Any, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``source`` (a full tensor or a ShardedTensor) has the table's global ``shape``:
    every rank checks the same sizes, so all load or all raise (a block check alone let a rank whose rows fit a
    table of another size load while the others raised, and a larger tensor load truncated)."""
    if isinstance(source, torch.Tensor) and tuple(source.size()) != tuple(shape):
        raise ValueError(
            f"{name}: the loaded tensor has shape {tuple(source.size())}, the table's is {tuple(shape)} (a different "
            "table size?)"
        )


def copy_into_shards(
    name: str,
    source: Any,
    local: list[tuple[ShardSpec, torch.Tensor]],
    rowwise: bool = False,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Copy ``source`` (a full tensor, or a ShardedTensor whose local shards cover ``local``) into each local shard;
    ``shape``: the table's global shape, which ``source`` must have (:func:`check_full_shape`)."""
    if shape is not None:
        check_full_shape(name, source, shape)
    with torch.no_grad():
        for spec, target in local:
            if target.numel() == 0:
                continue
            rows = slice(spec.row_offset, spec.row_offset + spec.rows)
            cols = slice(spec.col_offset, spec.col_offset + spec.cols)
            if isinstance(source, ShardedTensor):
                _copy_from_local_shards(name, source, spec, target, rowwise)
                continue
            if not isinstance(source, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor or ShardedTensor, got {type(source).__name__}")
            block = source[rows] if rowwise else source[rows, cols]
            if block.shape != target.shape:
                raise ValueError(
                    f"{name}: the loaded tensor of shape {tuple(source.shape)} has no {tuple(target.shape)} block at "
                    f"rows {spec.row_offset}, columns {spec.col_offset} (a different table size?)"
                )
            target.copy_(block)


def _overlaps(
    source: ShardedTensor, spec: ShardSpec, rowwise: bool
) -> Iterator[tuple[torch.Tensor, tuple[slice, ...]]]:
    """Each local shard of ``source`` overlapping shard ``spec``: the overlap in the source shard, and where it goes
    in ``spec``'s tensor (index slices)."""
    lo = (spec.row_offset,) if rowwise else (spec.row_offset, spec.col_offset)
    hi = (spec.row_offset + spec.rows,) if rowwise else (spec.row_offset + spec.rows, spec.col_offset + spec.cols)
    for shard in source.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if len(offsets) != len(lo):
            continue  # another rank of tensor: the size checks name it
        start = [max(a, o) for a, o in zip(lo, offsets, strict=True)]
        end = [min(b, o + n) for b, o, n in zip(hi, offsets, sizes, strict=True)]
        if any(e <= s for s, e in zip(start, end, strict=True)):
            continue
        src = shard.tensor[tuple(slice(s - o, e - o) for s, e, o in zip(start, end, offsets, strict=True))]
        yield src, tuple(slice(s - a, e - a) for s, e, a in zip(start, end, lo, strict=True))


def check_covered(name: str, source: ShardedTensor, spec: ShardSpec, rowwise: bool = False) -> None:
    """Raise ``ValueError`` unless the local shards of ``source`` cover shard ``spec`` (what a copy reads)."""
    covered = sum(src.numel() for src, _ in _overlaps(source, spec, rowwise))
    needed = spec.rows if rowwise else spec.rows * spec.cols
    if covered < needed:
        raise ValueError(
            f"{name}: the ShardedTensor's local shards cover {covered} of this rank's {needed} values; load a "
            "checkpoint of another sharding with torch.distributed.checkpoint, which re-shards into state_dict()"
        )


def _copy_from_local_shards(
    name: str, source: ShardedTensor, spec: ShardSpec, target: torch.Tensor, rowwise: bool
) -> None:
    """Fill ``target`` (shard ``spec``) from the overlapping local shards of ``source``."""
    check_covered(name, source, spec, rowwise)
    for src, index in _overlaps(source, spec, rowwise):
        dst = target[index]
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


def drop_internal_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """The comm modules' bookkeeping buffers are not state (the unsharded module has none)."""
    for key in [k for k in state_dict if k.startswith(prefix + "_shardings.")]:
        del state_dict[key]


def ignore_internal_keys(module: nn.Module, incompatible: Any) -> None:
    """Loading: the comm modules' buffers are not expected in a state dict."""
    missing = incompatible.missing_keys
    for key in [k for k in missing if "._shardings." in f".{k}" or k.startswith("_shardings.")]:
        missing.remove(key)


def save_table(
    table: ShardedTable,
    local: list[tuple[ShardSpec, torch.Tensor]],
    pg: dist.ProcessGroup,
    device: torch.device,
) -> Any:
    """What ``state_dict`` holds for ``table``: its ShardedTensor, or (data parallel) the local replica."""
    if is_data_parallel(table):
        return local[0][1]
    return sharded_tensor(table, local, pg, device)


# --------------------------------------------------------------------------------------------- fused optimizer state
def _state_views(module: Any) -> dict[str, list[tuple[ShardSpec, dict[str, torch.Tensor]]]]:
    """Table -> per local shard, its spec and its live fused state views."""
    optimizer = module.fused_optimizer
    out: dict[str, list[tuple[ShardSpec, dict[str, torch.Tensor]]]] = {}
    for name, shards in module.embedding_tables().items():
        for shard, weight in shards:
            state = optimizer.state.get(weight.weight)
            if state:
                out.setdefault(name, []).append((shard.spec, state))
    return out


def fused_optimizer_state_dict(module: Any) -> dict[str, dict[str, Any]]:
    """Fused optimizer state keyed by table: ``{table: {"momentum1": ShardedTensor | Tensor, "momentum2": ...,
    "step": Tensor}}`` (live views: DCP loads into them in place; then call :func:`load_fused_optimizer_state_dict`).
    ``step`` is present on the ranks holding a shard of the table."""
    views = _state_views(module)
    out: dict[str, dict[str, Any]] = {}
    for table in fused_tables(module):
        local = views.get(table.name, [])
        entry: dict[str, Any] = {}
        for key in fused_state_keys(module, table.name):
            pairs = [(spec, state[key]) for spec, state in local]
            if is_data_parallel(table):
                entry[key] = pairs[0][1]
            else:
                rowwise = key == "momentum1" and _rowwise(module, table.name)
                entry[key] = sharded_tensor(table, pairs, module.process_group, module.state_device, rowwise=rowwise)
        if local:
            entry["step"] = local[0][1]["step"]
        out[table.name] = entry
    return out


def fused_tables(module: Any) -> list[ShardedTable]:
    """The tables of ``module`` with fused optimizer state (compute kernel ``fused``), the same on every rank."""
    options = module.lookup_options
    return [
        t
        for t in module.sharded_tables()
        if t.sharding.compute_kernel == EmbeddingComputeKernel.FUSED.value and options.fused_of(t.name) is not None
    ]


def _rowwise(module: Any, table: str) -> bool:
    """Whether table ``table``'s fused rule keeps per-row state (rowwise Adagrad)."""
    fused = module.lookup_options.fused_of(table)
    return fused is not None and fused.optim.name == "EXACT_ROWWISE_ADAGRAD"


def _column_split_rowwise(module: Any) -> list[ShardedTable]:
    """The fused tables whose per-row state several column blocks share."""
    return [
        t
        for t in fused_tables(module)
        if _rowwise(module, t.name) and not is_data_parallel(t) and len({s.col_offset for s in t.shards}) > 1
    ]


def syncs_column_row_state(module: Any) -> bool:
    """Whether :func:`load_fused_optimizer_state_dict` sends per-row state between column blocks (a collective)."""
    return bool(_column_split_rowwise(module))


def fused_state_keys(module: Any, table: str) -> list[str]:
    """The per-row / per-element state names of table ``table``'s fused rule (``step`` aside)."""
    fused = module.lookup_options.fused_of(table)
    if fused is None:
        return []
    return {
        "EXACT_SGD": [],
        "EXACT_ROWWISE_ADAGRAD": ["momentum1"],
        "ADAM": ["momentum1", "momentum2"],
        "EXACT_ADAGRAD": ["momentum1"],
    }[fused.optim.name]


def load_fused_optimizer_state_dict(module: Any, state_dict: Mapping[str, Mapping[str, Any]]) -> None:
    """Copy a :func:`fused_optimizer_state_dict` (ShardedTensors DCP loaded into, or full tensors) into the live
    state; per-row state of column-split tables then goes from each row range's first column block to the others."""
    views = _state_views(module)
    for table in fused_tables(module):
        entry = state_dict.get(table.name)
        if entry is None:
            raise ValueError(f"the fused optimizer state dict has no entry for table {table.name!r}")
        for key in fused_state_keys(module, table.name):
            pairs = [(spec, state[key]) for spec, state in views.get(table.name, []) if state[key].numel()]
            first_block = min(s.col_offset for s in table.shards)
            rowwise = key == "momentum1" and _rowwise(module, table.name)
            own = [(s, t) for s, t in pairs if not rowwise or s.col_offset == first_block or is_data_parallel(table)]
            if key in entry:  # on every rank given it (a rank holding none of the table may get no entry)
                check_full_shape(f"{table.name}.{key}", entry[key], table_shape(table, rowwise))
            if own:  # else nothing of it here (no shard, or per-row state another column block loads)
                copy_into_shards(f"{table.name}.{key}", entry[key], own, rowwise=rowwise)
        if "step" in entry:
            for _, state in views.get(table.name, []):
                state["step"].copy_(torch.as_tensor(entry["step"]))
    _sync_column_row_state(module, views)


def _sync_column_row_state(module: Any, views: dict[str, list[tuple[ShardSpec, dict[str, torch.Tensor]]]]) -> None:
    """Per-row state is saved by the first column block of each row range: send it to the other column blocks."""
    pg = module.process_group
    me = pg.rank()
    ops, copies = [], []
    for table in _column_split_rowwise(module):
        first_block = min(s.col_offset for s in table.shards)
        mine = {s: state["momentum1"] for s, state in views.get(table.name, [])}
        for source in table.shards:
            if source.col_offset != first_block or source.rows == 0:
                continue
            for target in table.shards:
                if target.row_offset != source.row_offset or target.col_offset == first_block:
                    continue
                if source.rank == me and target.rank == me:
                    copies.append((mine[target], mine[source]))
                elif source.rank == me:
                    ops.append(dist.P2POp(dist.isend, mine[source].contiguous(), group=pg, group_peer=target.rank))
                elif target.rank == me:
                    ops.append(dist.P2POp(dist.irecv, mine[target], group=pg, group_peer=source.rank))
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                wait_for_work(work, "fused optimizer state sync", pg)


# ---------------------------------------------------------------------------------------------------------- gather
def gather_unsharded_state_dict(module: nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The unsharded module's state dict (full tensors, its key names), assembled on rank ``dst`` of the module's
    group (collective over that group: every rank of it must call it); ``None`` on the other ranks. The group is a
    :class:`DistributedModelParallel`'s process group (``env``), else its tables' group, else the world. Plain
    entries (data-parallel tables, other parameters) are taken from ``dst``'s own copy, those ``dst`` lacks (a
    tower-sharded module's interaction, which lives on its tower's host only) from the lowest rank holding them.

    One gather over the group of every rank's shards: tables may be ShardedTensors over different sub-groups (each
    tower's over its host's ranks), so neither one table's group nor one gather per table (the ranks hold different
    keys) would do; shard placements name global ranks."""
    state = module.state_dict()
    pg = getattr(getattr(module, "env", None), "process_group", None)
    if pg is None:  # a sharded module on its own: the group of its tables (every rank of it holds all of them)
        pg = next((v._process_group for v in state.values() if isinstance(v, ShardedTensor)), dist.group.WORLD)
    me, world = dist.get_rank(pg), dist.get_world_size(pg)
    if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < world:
        raise ValueError(f"dst must be a rank of the module's group (0..{world - 1}), got dst={dst!r}")
    root = dist.get_global_rank(pg, dst)
    # a list entry (a quantized column-wise table's scale / bias: this rank's blocks' copies of the full tensor, none
    # where the rank holds no block) counts as held by the ranks whose list is non-empty
    held = lambda v: not isinstance(v, list) or bool(v)
    plain_at_dst: list[Any] = [sorted(k for k, v in state.items() if held(v) and not isinstance(v, ShardedTensor))]
    dist.broadcast_object_list(plain_at_dst, src=root, group=pg)
    mine: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            pieces = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()]
            mine[key] = (tuple(value.size()), value.dtype, pieces)
        elif me != dst and key not in plain_at_dst[0] and held(value):
            mine[key] = (value[0] if isinstance(value, list) else value).detach().cpu().clone()
    gathered: list[Any] = [None] * world if me == dst else []
    dist.gather_object(mine, gathered if me == dst else None, dst=root, group=pg)
    if me != dst:
        return None
    out = {
        k: (v[0] if isinstance(v, list) else v).detach().clone()
        for k, v in state.items()
        if held(v) and not isinstance(v, ShardedTensor)
    }
    for rank_state in gathered:
        for key, value in rank_state.items():
            if isinstance(value, torch.Tensor):
                out.setdefault(key, value)
                continue
            size, dtype, pieces = value
            full = out.setdefault(key, torch.zeros(size, dtype=dtype))
            for offsets, tensor in pieces:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))] = tensor
    return out


__all__ = [
    "check_covered",
    "check_full_shape",
    "copy_into_shards",
    "drop_internal_keys",
    "fused_optimizer_state_dict",
    "fused_state_keys",
    "fused_tables",
    "gather_unsharded_state_dict",
    "ignore_internal_keys",
    "load_fused_optimizer_state_dict",
    "save_table",
    "sharded_tensor",
    "syncs_column_row_state",
]
