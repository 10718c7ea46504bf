"""State dict of :class:`~tritonrec.dist.quant_embeddingbag.ShardedQuantEmbeddingBagCollection`: torchrec 1.8's
sharded quantized EBC layout (``torchrec.distributed.quant_state``): entries ``embedding_bags.<table>.weight``,
``.weight_qscale`` and ``.weight_qbias`` shaped as the unsharded module's (:mod:`tritonrec.modules.quant_state`):

* ``weight``: a table in one shard (table-wise), the shard's codes themselves; else a ``ShardedTensorBase`` of the
  global ``[rows, row_bytes]`` codes (offsets and sizes in bytes: a column block at column ``c`` starts at byte
  ``c * bits / 8``);
* ``weight_qscale`` / ``weight_qbias`` (INT tables; FP16 / FP32 ones have only ``weight``): column-wise, a list with
  each column block's ``[rows, 1]`` copy (every block keeps its rows' scale and bias); else as ``weight``, of the
  global ``[rows, 1]``.

Every shard is a view of the live lookup storage, so loading copies in place. ``load_state_dict`` takes such a
state dict from a module of the same plan (shards are matched by offsets and sizes, as torchrec does) or an
unsharded one in any format the unsharded module loads, of which each shard keeps its slice. ``ShardedTensorBase``
here has no process group (one process holds every shard): read it with ``local_shards()`` and ``metadata()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorBase,
    ShardedTensorMetadata,
    ShardMetadata,
)
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from tritonrec.dist.sharding.common import ShardedTable, ShardSpec
from tritonrec.dist.types import EmbeddingComputeKernel, ShardingType
from tritonrec.kernels.embedding import QuantizedTables
from tritonrec.kernels.embedding.quantized import row_bytes
from tritonrec.modules.embedding_configs import QUANT_BITS
from tritonrec.modules.quant_state import BUFFER_NAMES, buffer_names, normalize_table_state


@dataclass
class QuantShardView:
    """One shard of a table in the lookup storage: codes ``[rows, row_bytes(cols)]`` uint8, scale / bias
    ``[rows, 1]`` fp16 (views), and where its bytes sit in the table's ``[rows, row_bytes(dim)]`` codes."""

    spec: ShardSpec
    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    byte_offset: int

    @staticmethod
    def of(tables: QuantizedTables, t: int, spec: ShardSpec) -> QuantShardView:
        scale, bias = tables.table_scale_bias(t)
        offset = spec.col_offset * tables.bits // 8
        return QuantShardView(spec, tables.table_codes(t), scale.unsqueeze(1), bias.unsqueeze(1), offset)

    def tensor(self, name: str) -> torch.Tensor:
        return {"weight": self.codes, "weight_qscale": self.scale, "weight_qbias": self.bias}[name]

    def region(self, name: str) -> tuple[list[int], list[int]]:
        """Offsets and sizes of this shard's ``name`` tensor in the table's global one."""
        rows = self.spec.row_offset
        if name == "weight":
            return [rows, self.byte_offset], list(self.codes.shape)
        return [rows, 0], list(self.scale.shape)


def _sharded(views: list[QuantShardView], name: str, size: list[int]) -> ShardedTensorBase:
    shards = [
        Shard(v.tensor(name), ShardMetadata(*v.region(name), f"rank:{v.spec.rank}/{v.codes.device}"))
        for v in views
        if v.tensor(name).numel()
    ]
    dtype = torch.uint8 if name == "weight" else torch.float16
    metadata = ShardedTensorMetadata([s.metadata for s in shards], torch.Size(size), TensorProperties(dtype=dtype))
    return ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, metadata)


def _column_wise(table: ShardedTable) -> bool:
    return table.sharding_type == ShardingType.COLUMN_WISE.value


def table_state(table: ShardedTable, views: list[QuantShardView], bits: int) -> dict[str, Any]:
    """``{"weight": ..., "weight_qscale": ..., "weight_qbias": ...}`` for ``table`` (``views`` in shard order)."""
    rows = table.config.num_embeddings
    out: dict[str, Any] = {}
    for name in buffer_names(bits):
        if name != "weight" and _column_wise(table):
            out[name] = [v.tensor(name) for v in views]
        elif len(views) == 1:
            out[name] = views[0].tensor(name)
        else:
            out[name] = _sharded(
                views, name, [rows, row_bytes(table.config.embedding_dim, bits) if name == "weight" else 1]
            )
    return out


def _check_block(key: str, block: Any, target: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(block, torch.Tensor) or block.dtype != target.dtype or block.shape != target.shape:
        got = f"{block.dtype} {list(block.shape)}" if isinstance(block, torch.Tensor) else type(block).__name__
        raise ValueError(f"{key}: {where} must be {target.dtype} {list(target.shape)}, got {got}")
    return block


def _source_block(key: str, source: Any, view: QuantShardView, name: str, index: int) -> torch.Tensor:
    """What ``view``'s ``name`` tensor loads from ``source`` (a full tensor, a ShardedTensorBase or a list)."""
    target = view.tensor(name)
    offsets, sizes = view.region(name)
    if isinstance(source, ShardedTensorBase):
        for shard in source.local_shards():
            if shard.metadata.shard_offsets == offsets and shard.metadata.shard_sizes == sizes:
                return _check_block(key, shard.tensor, target, f"the local shard at {offsets}")
        raise ValueError(
            f"{key}: the ShardedTensor has no local shard at offsets {offsets} of sizes {sizes}; load a state dict "
            "of the same plan, or an unsharded one"
        )
    if isinstance(source, list):
        if index >= len(source):
            raise ValueError(f"{key}: a list of {len(source)} tensors, this table has {index + 1} or more shards")
        return _check_block(key, source[index], target, f"entry {index}")
    rows = slice(offsets[0], offsets[0] + sizes[0])
    return _check_block(key, source[rows, offsets[1] : offsets[1] + sizes[1]], target, f"its block at {offsets}")


def table_copies(
    state_dict: Mapping[str, Any], prefix: str, table: ShardedTable, views: list[QuantShardView], bits: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """The ``(target, source)`` copies that load ``table`` from ``state_dict`` (checked, not yet done) and its
    missing keys. Unsharded entries are first brought to our format (torchrec's layouts, ``[rows]`` scale)."""
    config = table.config
    full = {
        prefix + name: state_dict[prefix + name]
        for name in BUFFER_NAMES
        if prefix + name in state_dict
        and isinstance(state_dict[prefix + name], torch.Tensor)
        and not isinstance(state_dict[prefix + name], ShardedTensorBase)
    }
    normalize_table_state(full, prefix, config.num_embeddings, config.embedding_dim, bits)
    copies, missing = [], []
    for name in buffer_names(bits):
        key = prefix + name
        source = full.get(key, state_dict.get(key))
        if source is None:
            missing.append(key)
            continue
        for index, view in enumerate(views):
            if view.tensor(name).numel():
                copies.append((view.tensor(name), _source_block(key, source, view, name, index)))
    return copies, missing


def global_sharded_state(
    table: ShardedTable, local: list[QuantShardView], name: str, bits: int, device: str, pg: Any
) -> ShardedTensor:
    """``name`` of ``table`` as a ShardedTensor over ``pg``: every rank's shard in the metadata, this rank's as local
    shards (live views)."""
    dim, rows = table.config.embedding_dim, table.config.num_embeddings
    codes = name == "weight"

    def region(spec: Any) -> tuple[list[int], list[int]]:
        if codes:
            return [spec.row_offset, spec.col_offset * bits // 8], [spec.rows, row_bytes(spec.cols, bits)]
        return [spec.row_offset, 0], [spec.rows, 1]

    # placements name global ranks (torch matches them with dist.get_rank()); shards are numbered by group rank
    metadata = [
        ShardMetadata(*region(s), f"rank:{dist.get_global_rank(pg, s.rank)}/{device}") for s in table.shards if s.rows
    ]
    by_region = {tuple(region(v.spec)[0]): v.tensor(name) for v in local if v.spec.rows}
    shards = [Shard(by_region[tuple(m.shard_offsets)], m) for m in metadata if tuple(m.shard_offsets) in by_region]
    size = torch.Size([rows, row_bytes(dim, bits) if codes else 1])
    properties = TensorProperties(dtype=torch.uint8 if codes else torch.float16)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, size, properties), process_group=pg
    )


def local_quant_views(
    tables: list[ShardedTable], shardings: Any
) -> list[tuple[ShardedTable, list[QuantShardView], int]]:
    """Each table with this rank's shard views (shard order, from the quantized lookups' ``views``) and its bit
    width: what :func:`save_quant_tables` / :func:`load_quant_tables` read."""
    views: dict[str, list[tuple[int, QuantShardView]]] = {t.name: [] for t in tables}
    for sharding in shardings:
        for shard, view in sharding.lookup.views:
            views[shard.table.name].append((shard.shard_index, view))
    return [
        (t, [v for _, v in sorted(views[t.name], key=lambda kv: kv[0])], QUANT_BITS[t.config.data_type]) for t in tables
    ]


def save_quant_tables(
    destination: dict,
    prefix: str,
    attribute: str,
    tables: list[tuple[ShardedTable, list[QuantShardView], int]],
    device_type: str,
    pg: Any,
) -> None:
    """A process-group-sharded quantized collection's ``_save_to_state_dict``: each table's buffers under
    ``{prefix}{attribute}.{table}.`` as ShardedTensors over ``pg``; a column-wise table's scale / bias as the list of
    this rank's blocks' copies (every block holds the full rows' scale and bias)."""
    for table, views, bits in tables:
        for name in buffer_names(bits):
            key = f"{prefix}{attribute}.{table.name}.{name}"
            if name != "weight" and table.sharding_type == ShardingType.COLUMN_WISE.value:
                destination[key] = [v.tensor(name) for v in views]
            else:
                destination[key] = global_sharded_state(table, views, name, bits, device_type, pg)


def load_quant_tables(
    state_dict: Mapping[str, Any],
    prefix: str,
    attribute: str,
    tables: list[tuple[ShardedTable, list[QuantShardView], int]],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
) -> None:
    """A sharded quantized collection's ``_load_from_state_dict``: ``tables`` are ``(table, this rank's views,
    bits)``, their entries under ``{prefix}{attribute}.{table}.`` (``attribute``: ``embedding_bags`` /
    ``embeddings``). Every table's entries are checked first (``ValueError`` naming the key), then copied into the
    shards; with ``strict``, any other key under ``prefix`` is unexpected."""
    copies, expected = [], set()
    for table, views, bits in tables:
        table_prefix = f"{prefix}{attribute}.{table.name}."
        expected.update(table_prefix + name for name in buffer_names(bits))
        table_copy, missing = table_copies(state_dict, table_prefix, table, views, bits)
        copies += table_copy
        missing_keys.extend(missing)
    if strict:
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
    with torch.no_grad():
        for target, source in copies:
            if target.data_ptr() != source.data_ptr():
                target.copy_(source)


def check_quant_plan(plan: Mapping[str, Any], supported: Sequence[str], tables: str) -> None:
    """Every table of ``plan`` (table -> ParameterSharding) has a sharding type in ``supported`` and the ``quant``
    compute kernel; else a ``ValueError`` naming the table (``tables``: "tables" / "sequence tables")."""
    for name, sharding in plan.items():
        if sharding.sharding_type not in supported:
            raise ValueError(
                f"table {name!r}: sharding type {sharding.sharding_type} is not supported for quantized {tables} "
                f"(supported: {list(supported)})"
            )
        if sharding.compute_kernel != EmbeddingComputeKernel.QUANT.value:
            raise ValueError(
                f"table {name!r}: compute_kernel must be 'quant' for a quantized table, got {sharding.compute_kernel!r}"
            )


class ProcessGroupQuantState:
    """Mixed in before ``ShardedModule`` by the process-group-sharded quantized EC and EBC: their accessors and their
    state dict, each table's buffers under ``{prefix}{_state_attribute}.{table}.`` as ShardedTensors over the group.
    The class sets ``_tables``, ``_shardings``, ``_output_dtype``, ``_device`` and ``_env``."""

    _state_attribute: ClassVar[str]  # "embeddings" (EC) / "embedding_bags" (EBC): torchrec's key segment
    _tables: list[ShardedTable]
    _shardings: list[Any]
    _output_dtype: torch.dtype
    _device: torch.device
    _env: Any

    def output_dtype(self) -> torch.dtype:
        """The output's dtype, the unsharded module's."""
        return self._output_dtype

    def copy(self, device: torch.device) -> Any:
        """``self`` (torchrec's ``ModuleNoCopyMixin``): the shards already sit on their devices."""
        return self

    def sharded_tables(self) -> list[ShardedTable]:
        return self._tables

    @property
    def shardings(self) -> list:
        return list(self._shardings)

    def _local_views(self) -> list[tuple[ShardedTable, list[QuantShardView], int]]:
        return local_quant_views(self._tables, self._shardings)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        pg = self._env.process_group
        save_quant_tables(destination, prefix, self._state_attribute, self._local_views(), self._device.type, pg)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Checks every table's entries first (``ValueError`` naming the key), then copies into this rank's shards."""
        load_quant_tables(
            state_dict, prefix, self._state_attribute, self._local_views(), strict, missing_keys, unexpected_keys
        )


__all__ = [
    "ProcessGroupQuantState",
    "QuantShardView",
    "check_quant_plan",
    "global_sharded_state",
    "load_quant_tables",
    "local_quant_views",
    "save_quant_tables",
    "table_copies",
    "table_state",
]
