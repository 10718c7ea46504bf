"""Where every table lives in a table-batched weight buffer, and which table every feature reads.

A table-batched lookup sees a list of tables, each ``(num_rows, dim, pooling)``, packed one after another into ONE
flat weight buffer (table ``t`` holds elements ``[weight_offsets[t], weight_offsets[t + 1])`` as a row-major
``[num_rows, dim]`` block). The layout never assumes it owns whole tables: a row-wise shard is just a table with
fewer rows (its indices already local) and a column-wise shard a table with fewer columns. Several features may read
one table (``feature_tables``).

Rows also get a global number (``row_offsets[t] + r``), the key the backward sorts on; per-row optimizer state (rowwise
Adagrad momentum) lives at that global row, per-element state (Adam) at the weight's own element offset, so a shard's
optimizer state is laid out exactly like its weights.

Bounds checking: an index outside ``[0, num_rows)`` of its table is handled by :class:`BoundsCheckMode` (FBGEMM's
names). Whatever the mode, the kernels and twins never touch memory outside the indexed table.
"""

from __future__ import annotations

import enum
import itertools
import json
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from tritonrec.kernels.checks import check_int, merge_spans, spans_out_of_range
from tritonrec.kernels.runs import repeat_runs


class PoolingMode(enum.IntEnum):
    """How a bag's rows combine. MEAN = SUM followed by a per-bag divisor (the local bag length unless the caller
    passes its own, e.g. the global length under row-wise sharding). NONE = no pooling (sequence lookup)."""

    SUM = 0
    MEAN = 1
    NONE = 2


class BoundsCheckMode(enum.Enum):
    """What an index outside ``[0, num_rows)`` does.

    * FATAL   - raise ``ValueError`` naming the feature, the table, the index and the bound (default).
    * WARNING - warn once per layout (i.e. per module), then treat the row as zero: it adds nothing to its bag, its
      sequence row is zero, and it receives no gradient or update.
    * IGNORE  - no check and no warning (no device sync); the row is still treated as zero, so memory stays safe.
    """

    FATAL = "FATAL"
    WARNING = "WARNING"
    IGNORE = "IGNORE"


@dataclass(frozen=True)
class TableSpec:
    """One table (or one shard of a table) in a table-batched buffer."""

    num_rows: int
    dim: int
    pooling: PoolingMode = PoolingMode.SUM
    name: str = ""

    def __post_init__(self) -> None:
        label = f"table {self.name!r}" if self.name else "table"
        object.__setattr__(self, "num_rows", check_int(self.num_rows, "num_rows", 0, context=label))  # frozen
        object.__setattr__(self, "dim", check_int(self.dim, "dim", 1, context=label))
        if not isinstance(self.pooling, PoolingMode):
            raise TypeError(f"{label}: pooling must be a PoolingMode, got pooling={self.pooling!r}")


@dataclass(frozen=True)
class LayoutTensors:
    """Per-feature and per-table metadata on one device, read by the kernels.

    Per feature ``f`` (int64 unless noted): ``feature_weight_offsets`` (where its table starts in the flat buffer),
    ``feature_row_offsets`` (its table's first global row), ``feature_rows``, ``feature_dims`` (int32),
    ``feature_out_offsets`` (int32 ``[F + 1]``, its first output column), ``feature_mean`` (int32, 1 for MEAN).
    Per table ``t``: ``table_weight_offsets``, ``table_row_offsets`` (``[T + 1]``), ``table_dims`` (int32).
    """

    feature_weight_offsets: torch.Tensor
    feature_row_offsets: torch.Tensor
    feature_rows: torch.Tensor
    feature_dims: torch.Tensor
    feature_out_offsets: torch.Tensor
    feature_mean: torch.Tensor
    table_weight_offsets: torch.Tensor
    table_row_offsets: torch.Tensor
    table_dims: torch.Tensor


def _cumsum(sizes: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: complete cumulative sum of host ints."""
    return list(accumulate(sizes, initial=0))


_INT32_MAX = 2**31 - 1


def _check_int32_columns(layout: TableBatchedLayout) -> None:
    """The kernels index columns (table dims, output column offsets) in int32: refuse layouts past that."""
    for t, table in enumerate(layout.tables):
        if table.dim > _INT32_MAX:
            raise ValueError(
                f"{layout.table_label(t)} has dim {table.dim}, more columns than the kernels index in int32 "
                f"({_INT32_MAX}); shard it column-wise into narrower tables"
            )
    if layout.feature_out_offsets[-1] > _INT32_MAX:
        raise ValueError(
            f"the pooled output would be {layout.feature_out_offsets[-1]} columns wide (the dims of its "
            f"{layout.num_features} features), more than the kernels index in int32 ({_INT32_MAX}); split the tables "
            "over several collections or shard them column-wise"
        )


class TableBatchedLayout:
    """Tables packed into one flat buffer, and the feature -> table map. Host ints plus cached device tensors.

    ``feature_tables[f]`` is the table feature ``f`` reads; ``feature_names`` only serve error messages. The pooled
    output of a batch is ``[B, total_dim]`` with feature ``f`` at columns ``feature_out_offsets[f]:... + dim``.
    ``op_key`` is the string that stands for the layout in ``torch.ops.tritonrec`` calls (see
    :func:`layout_from_op_key`).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_tables: Sequence[int],
        feature_names: Sequence[str] | None = None,
    ) -> None:
        if not tables:
            raise ValueError("tables must hold at least one TableSpec, got an empty list")
        for i, table in enumerate(tables):
            if not isinstance(table, TableSpec):
                raise TypeError(f"tables[{i}] must be a TableSpec, got {type(table).__name__}")
        what = f"a table index in [0, {len(tables)})"
        feature_tables = [
            check_int(t, f"feature_tables[{f}]", 0, len(tables) - 1, what=what) for f, t in enumerate(feature_tables)
        ]
        if feature_names is not None and len(feature_names) != len(feature_tables):
            raise ValueError(
                f"feature_names has {len(feature_names)} names for {len(feature_tables)} features (feature_tables)"
            )
        self.tables: tuple[TableSpec, ...] = tuple(tables)
        self.feature_tables: tuple[int, ...] = tuple(feature_tables)
        self.feature_names: tuple[str, ...] = (
            tuple(feature_names) if feature_names is not None else tuple(f"feature {f}" for f in feature_tables)
        )
        self.table_weight_offsets = _cumsum([t.num_rows * t.dim for t in self.tables])
        self.table_row_offsets = _cumsum([t.num_rows for t in self.tables])
        self.feature_dims = [self.tables[t].dim for t in self.feature_tables]
        self.feature_out_offsets = _cumsum(self.feature_dims)
        _check_int32_columns(self)
        self.warned_out_of_bounds = False
        self._device_cache: dict[torch.device, LayoutTensors] = {}
        self.op_key = _register_layout(self)

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def num_features(self) -> int:
        return len(self.feature_tables)

    @property
    def num_weights(self) -> int:
        """Elements of the flat weight buffer (and of per-element optimizer state)."""
        return self.table_weight_offsets[-1]

    @property
    def num_rows(self) -> int:
        """Rows over all tables (the size of per-row optimizer state)."""
        return self.table_row_offsets[-1]

    @property
    def total_dim(self) -> int:
        """Width of the pooled output, ``sum(dim)`` over features."""
        return self.feature_out_offsets[-1]

    @property
    def max_dim(self) -> int:
        return max(t.dim for t in self.tables)

    def table_label(self, table: int) -> str:
        name = self.tables[table].name
        return f"table {table} ({name!r})" if name else f"table {table}"

    def table_view(self, flat: torch.Tensor, table: int) -> torch.Tensor:
        """Table ``table`` of a flat ``[num_weights]`` buffer as a ``[num_rows, dim]`` view."""
        spec = self.tables[table]
        start = self.table_weight_offsets[table]
        return flat[start : start + spec.num_rows * spec.dim].view(spec.num_rows, spec.dim)

    def tensors(self, device: torch.device) -> LayoutTensors:
        """The metadata on ``device`` (built once per device)."""
        device = torch.device(device)
        cached = self._device_cache.get(device)
        if cached is None:
            ft = self.feature_tables

            def i64(values: Sequence[int]) -> torch.Tensor:
                return torch.tensor(list(values), dtype=torch.int64, device=device)

            def i32(values: Sequence[int]) -> torch.Tensor:
                return torch.tensor(list(values), dtype=torch.int32, device=device)

            cached = LayoutTensors(
                feature_weight_offsets=i64([self.table_weight_offsets[t] for t in ft]),
                feature_row_offsets=i64([self.table_row_offsets[t] for t in ft]),
                feature_rows=i64([self.tables[t].num_rows for t in ft]),
                feature_dims=i32(self.feature_dims),
                feature_out_offsets=i32(self.feature_out_offsets),
                feature_mean=i32([int(self.tables[t].pooling == PoolingMode.MEAN) for t in ft]),
                table_weight_offsets=i64(self.table_weight_offsets),
                table_row_offsets=i64(self.table_row_offsets),
                table_dims=i32([t.dim for t in self.tables]),
            )
            self._device_cache[device] = cached
        return cached

    def __setstate__(self, state: dict) -> None:
        """Copies (``copy``, ``deepcopy``, unpickling) are new layouts: they get an op key of their own."""
        self.__dict__.update(state)
        self.op_key = _register_layout(self)

    def __repr__(self) -> str:
        tables = ", ".join(f"{t.name or i}:{t.num_rows}x{t.dim}/{t.pooling.name}" for i, t in enumerate(self.tables))
        return f"TableBatchedLayout(tables=[{tables}], feature_tables={list(self.feature_tables)})"


# Ops take a layout as a string (op schemas hold no Python objects): a per-instance token, so each layout keeps its
# own warn-once flag and device tensors, plus the full description, so an exported graph rebuilds the layout in a
# process where the original object does not exist.
_LAYOUT_TOKENS = itertools.count()
_LIVE_LAYOUTS: weakref.WeakValueDictionary[str, TableBatchedLayout] = weakref.WeakValueDictionary()


def _register_layout(layout: TableBatchedLayout) -> str:
    description = {
        "tables": [[t.num_rows, t.dim, int(t.pooling), t.name] for t in layout.tables],
        "feature_tables": list(layout.feature_tables),
        "feature_names": list(layout.feature_names),
    }
    key = f"{next(_LAYOUT_TOKENS)}:{json.dumps(description, separators=(',', ':'))}"
    _LIVE_LAYOUTS[key] = layout
    return key


def layout_from_op_key(key: str) -> TableBatchedLayout:
    """The layout whose :attr:`TableBatchedLayout.op_key` is ``key`` (rebuilt from the key if it no longer lives)."""
    layout = _LIVE_LAYOUTS.get(key)
    if layout is None:
        description = json.loads(key.split(":", 1)[1])
        tables = [
            TableSpec(rows, dim, PoolingMode(pooling), name) for rows, dim, pooling, name in description["tables"]
        ]
        layout = TableBatchedLayout(tables, description["feature_tables"], description["feature_names"])
        _LIVE_LAYOUTS[key] = layout
    return layout


def value_features(feature_value_offsets: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[N]`` int64: the feature of each value, from the per-feature value spans ``[F + 1]`` (host ints)."""
    counts = torch.tensor([b - a for a, b in itertools.pairwise(feature_value_offsets)], device=device)
    total = feature_value_offsets[-1] - feature_value_offsets[0] if len(feature_value_offsets) else 0
    return repeat_runs(torch.arange(counts.numel(), device=device), counts, total)


def feature_value_offsets(offsets: torch.Tensor, num_features: int, batch_size: int) -> list[int]:
    """``[F + 1]`` host ints: where each feature's values start in a key-major batch with bag ``offsets [F*B+1]``."""
    if batch_size == 0:
        return [0] * (num_features + 1)
    return offsets[::batch_size].tolist()


def check_bounds(
    layout: TableBatchedLayout, indices: torch.Tensor, feature_value_offsets: Sequence[int], mode: BoundsCheckMode
) -> bool:
    """Apply ``mode`` to ``indices``; feature ``f`` owns ``indices[feature_value_offsets[f]:...[f + 1]]``.

    Returns True when every index was checked and is in range, so lookups may skip masking; False when the mode is
    IGNORE (nothing checked) or WARNING found out-of-range indices (after warning). FATAL raises ``ValueError`` on
    the first out-of-range index. The check is one min / max reduction per run of adjacent features with one row
    count, and one host read; only on failure is each feature checked alone.
    """
    if not isinstance(mode, BoundsCheckMode):
        raise TypeError(f"bounds_check must be a BoundsCheckMode, got bounds_check={mode!r}")
    if mode == BoundsCheckMode.IGNORE:
        return False
    offsets = feature_value_offsets
    rows = [layout.tables[table].num_rows for table in layout.feature_tables]
    per_feature = [(offsets[f], offsets[f + 1], rows[f]) for f in range(len(rows))]
    if not spans_out_of_range(indices, merge_spans(per_feature)):  # features sharing a row count: one reduction
        return True
    bad_features = [f for f in range(len(rows)) if spans_out_of_range(indices, per_feature[f : f + 1])]
    feature = bad_features[0]
    table = layout.feature_tables[feature]
    start, end = feature_value_offsets[feature], feature_value_offsets[feature + 1]
    values = indices[start:end]
    position = int(((values < 0) | (values >= layout.tables[table].num_rows)).nonzero()[0].item())
    message = (
        f"index out of bounds: feature {layout.feature_names[feature]!r} (reading {layout.table_label(table)}) has "
        f"index {int(values[position].item())} at value {position} of the feature, outside [0, "
        f"{layout.tables[table].num_rows})"
    )
    if mode == BoundsCheckMode.FATAL:
        raise ValueError(message)
    if not layout.warned_out_of_bounds:
        layout.warned_out_of_bounds = True
        bad = sum(
            int(((v < 0) | (v >= layout.tables[layout.feature_tables[f]].num_rows)).sum())
            for f in bad_features
            for v in [indices[feature_value_offsets[f] : feature_value_offsets[f + 1]]]
        )
        warnings.warn(
            f"{message}; {bad} out-of-range index(es) in this batch are treated as zero rows "
            "(BoundsCheckMode.WARNING warns once per module)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
