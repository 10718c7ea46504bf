"""What every embedding collection shares: tables grouped by storage dtype into flat buffers, per-table parameters
that are views into those buffers, and routing of a KeyedJaggedTensor's features to their group.

Each group is one :class:`~tritonrec.kernels.embedding.TableBatchedLayout` and one flat weight buffer, so a forward
is one kernel launch per dtype group. The per-table ``nn.EmbeddingBag`` / ``nn.Embedding`` children exist for
torchrec's state-dict keys (``embedding_bags.<table>.weight``) and for plain torch optimizers; their ``weight``
parameters alias the flat buffer. Anything that replaces parameter storage (``.to()``, ``.half()``,
``load_state_dict(assign=True)``) is repaired before the next forward by re-packing the parameters into a new flat
buffer (same Parameter objects, so optimizers keep working).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import BoundsCheckMode, PoolingMode, TableBatchedLayout, TableSpec
from tritonrec.kernels.embedding.storage import empty_table_storage
from tritonrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    data_type_to_dtype,
    get_embedding_names_by_table,
    pooling_type_to_pooling_mode,
)


@dataclass
class TableGroup:
    """Tables sharing one storage dtype: their config positions, layout, flat buffer and per-table modules."""

    table_positions: list[int]
    layout: TableBatchedLayout
    weights: torch.Tensor
    modules: list[nn.Module]
    source_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.source_features:  # no shared features: each slot reads the KJT key it is named after
            self.source_features = self.layout.feature_names

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The slots' embedding names (``feature@table`` for a shared feature): the output keys."""
        return self.layout.feature_names

    @property
    def params(self) -> list[nn.Parameter]:
        """The tables' current ``weight`` parameters (read each time: ``load_state_dict(assign=True)`` replaces
        the Parameter objects)."""
        return [m.weight for m in self.modules]


@dataclass
class GroupInputs:
    """One group's slice of a KJT: ``values [N_g]``, ``offsets [F_g * B + 1]``, optional ``weights [N_g]``,
    ``lengths [F_g * B]`` and the per-feature value spans ``value_offsets [F_g + 1]`` (host ints; ``None`` when not
    asked for, which saves pooled lookups a host read)."""

    values: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    lengths: torch.Tensor
    value_offsets: list[int] | None


def validate_tables(tables: object, config_type: type, module_name: str) -> list[BaseEmbeddingConfig]:
    """Configs of the right type and unique non-empty table names, each listing a feature at most once. A feature
    may feed several tables (torchrec's shared features, see :func:`get_embedding_names_by_table`)."""
    if not isinstance(tables, (list, tuple)) or not tables:
        raise ValueError(f"{module_name} needs a non-empty list of {config_type.__name__}, got tables={tables!r}")
    seen_tables: set[str] = set()
    for i, config in enumerate(tables):
        if not isinstance(config, config_type):
            raise TypeError(f"tables[{i}] must be an {config_type.__name__}, got {type(config).__name__}")
        if not config.name:
            raise ValueError(f"tables[{i}] needs a name (it keys the state dict), got name={config.name!r}")
        if config.name in seen_tables:
            raise ValueError(f"table names must be unique, got {config.name!r} twice")
        seen_tables.add(config.name)
        repeated = sorted({f for f in config.feature_names if config.feature_names.count(f) > 1})
        if repeated:
            # torchrec would give both slots the name f"{feature}@{table}": duplicate output keys
            raise ValueError(
                f"table {config.name!r} lists features {repeated} more than once in feature_names="
                f"{config.feature_names!r}; a table reads each feature once"
            )
    return list(tables)


def group_layout(
    tables: Sequence[BaseEmbeddingConfig], positions: Sequence[int], pooled: bool
) -> tuple[TableBatchedLayout, tuple[str, ...]]:
    """The layout of the tables at ``positions`` (one table batch) and the KJT key each of its slots reads. Slots are
    labelled by embedding name (``feature@table`` for a feature several of ``tables`` read, so labels stay unique)
    while the source features repeat a shared feature once per table reading it."""
    embedding_names = get_embedding_names_by_table(tables)
    specs, feature_tables, slot_names, source_features = [], [], [], []
    for local, pos in enumerate(positions):
        config = tables[pos]
        pooling = pooling_type_to_pooling_mode(config.pooling) if pooled else PoolingMode.NONE
        specs.append(TableSpec(config.num_embeddings, config.embedding_dim, pooling, config.name))
        feature_tables += [local] * len(config.feature_names)
        slot_names += embedding_names[pos]
        source_features += config.feature_names
    return TableBatchedLayout(specs, feature_tables, slot_names), tuple(source_features)


def build_groups(
    tables: Sequence[BaseEmbeddingConfig],
    device: torch.device | str | None,
    make_table_module: Callable[[BaseEmbeddingConfig, torch.Tensor], nn.Module],
    container: nn.ModuleDict,
    pooled: bool,
) -> list[TableGroup]:
    """Group tables by dtype (first-appearance order), allocate and initialise each flat buffer, and register one
    child module per table in ``container`` whose ``weight`` is that table's view."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, config in enumerate(tables):
        by_dtype.setdefault(data_type_to_dtype(config.data_type), []).append(i)
    groups, modules = [], {}
    for dtype, positions in by_dtype.items():
        layout, source_features = group_layout(tables, positions, pooled)
        flat = empty_table_storage(layout.num_weights, dtype, device)
        for local, pos in enumerate(positions):
            view = layout.table_view(flat, local)
            if flat.device.type != "meta":
                with torch.no_grad():
                    initialised = tables[pos].init_fn(view)
                    if initialised is not None and initialised is not view:
                        view.copy_(initialised)
            modules[pos] = make_table_module(tables[pos], view)
        group_modules = [modules[pos] for pos in positions]
        groups.append(TableGroup(positions, layout, flat, group_modules, source_features))
    for pos in range(len(tables)):  # registered in table order, so state-dict keys follow the configs
        container[tables[pos].name] = modules[pos]
    return groups


def repack(group: TableGroup) -> None:
    """Make the group's parameters views of one flat buffer again (after something replaced their storage)."""
    layout, params = group.layout, group.params
    first = params[0]
    for t, p in enumerate(params):
        if p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"tables of one dtype group must share dtype and device, got {layout.table_label(t)} as {p.dtype} on "
                f"{p.device} but {layout.table_label(0)} as {first.dtype} on {first.device}"
            )
    flat = empty_table_storage(layout.num_weights, first.dtype, first.device)
    with torch.no_grad():
        for t, p in enumerate(params):
            view = layout.table_view(flat, t)
            view.copy_(p.data)
            p.data = view
    group.weights = flat


def is_packed(group: TableGroup) -> bool:
    """Whether every parameter still aliases its table's place in the group's flat buffer."""
    flat, layout = group.weights, group.layout
    base, size = flat.data_ptr(), flat.element_size()
    for t, p in enumerate(group.params):
        if p.dtype != flat.dtype or p.device != flat.device:
            return False
        if p.numel() and p.data_ptr() != base + layout.table_weight_offsets[t] * size:
            return False
    return True


def pooled_column_order(
    groups: Sequence[tuple[Sequence[str], Sequence[int]]], embedding_names: Sequence[str]
) -> torch.Tensor | None:
    """Columns of the concatenated per-group pooled outputs (``(slot embedding names, feature_dims)`` per group;
    names unique over the groups) listed in ``embedding_names`` order, as an int64 index tensor; ``None`` when the
    concatenation is already in that order. Built from one span per slot (never a Python list per column: tables
    may be millions of columns wide)."""
    starts, dims, position = {}, {}, 0
    for names, group_dims in groups:
        for name, dim in zip(names, group_dims, strict=True):
            starts[name], dims[name] = position, dim
            position += dim
    spans = [(starts[name], dims[name]) for name in embedding_names]
    expected = 0
    for start, dim in spans:
        if start != expected:
            break
        expected += dim
    else:
        if expected == position:
            return None
    return torch.cat([torch.arange(start, start + dim, dtype=torch.int64) for start, dim in spans])


def _repack_after_load(module: TableBatchedCollection, incompatible_keys: object) -> None:
    module._ensure_packed()


class TableBatchedCollection(nn.Module):
    """Base of the embedding collections: owns the groups and turns a KJT into per-group kernel inputs."""

    def __init__(self, bounds_check: BoundsCheckMode, backend: Backend) -> None:
        super().__init__()
        if not isinstance(bounds_check, BoundsCheckMode):
            raise TypeError(f"bounds_check must be a BoundsCheckMode, got bounds_check={bounds_check!r}")
        self.bounds_check = bounds_check
        self.backend: Backend = backend
        self._groups: list[TableGroup] = []
        # load_state_dict(assign=True) replaces the parameters: re-pack at once, not only at the next eager forward
        self.register_load_state_dict_post_hook(_repack_after_load)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._ensure_packed()
        return self

    def __setstate__(self, state: dict) -> None:
        """``deepcopy`` / unpickling clone each Parameter on its own: re-pack the copies into one buffer again."""
        super().__setstate__(state)
        self._ensure_packed()

    def _ensure_packed(self) -> bool:
        """Re-pack every group whose parameters no longer alias its flat buffer; True if any was re-packed.

        Not while dynamo traces (it cannot read addresses): a compiled forward relies on ``.to()`` and
        ``load_state_dict`` having re-packed already (both do, see ``_apply`` and the load hook)."""
        if torch.compiler.is_compiling():
            return False
        repacked = False
        for group in self._groups:
            if not is_packed(group):
                repack(group)
                repacked = True
        return repacked

    def _group_inputs(
        self, features: KeyedJaggedTensor, group: TableGroup, need_weights: bool, need_value_offsets: bool = True
    ) -> GroupInputs:
        """The KJT's tensors restricted to (and ordered like) the group's slots' source features (a shared feature
        read by several of the group's tables is gathered once per table); no copy when the KJT already is. Built
        from per-key slices (not ``KJT.permute``) so gradients flow back to the KJT's weights."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        if features.variable_stride_per_key():
            raise ValueError(
                f"{type(self).__name__} needs one batch size for all keys; got a variable-stride KJT with "
                f"stride_per_key={features.stride_per_key()}"
            )
        weights = features.weights_or_none() if need_weights else None
        if need_weights and weights is None:
            raise ValueError(f"{type(self).__name__} was built with is_weighted=True but features has no weights")
        names = list(group.source_features)
        if features.keys() == names:
            value_offsets = features.offset_per_key() if need_value_offsets else None
            return GroupInputs(features.values(), features.offsets(), weights, features.lengths(), value_offsets)
        index = features.index_per_key()
        missing = [n for n in dict.fromkeys(names) if n not in index]  # a shared feature: named once
        if missing:
            raise ValueError(f"features is missing keys {missing} (it has {features.keys()})")
        order = [index[n] for n in names]
        value_spans = features.offset_per_key()
        batch = features.stride()
        lengths = features.lengths()

        def gather(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[value_spans[i] : value_spans[i + 1]] for i in order])

        group_lengths = torch.cat([lengths[i * batch : (i + 1) * batch] for i in order])
        offsets = torch.zeros(group_lengths.numel() + 1, dtype=group_lengths.dtype, device=group_lengths.device)
        torch.cumsum(group_lengths, dim=0, out=offsets[1:])
        spans = [0]
        for i in order:
            spans.append(spans[-1] + value_spans[i + 1] - value_spans[i])
        return GroupInputs(
            gather(features.values()), offsets, None if weights is None else gather(weights), group_lengths, spans
        )
