"""``QuantEmbeddingCollection``: sequence (unpooled) lookups on INT8 / INT4 / INT2 (row-wise) and FP16 / FP32 tables
for inference (torchrec's quantized EC).

The storage is the quantized EBC's (:mod:`tritonrec.modules.quant_embedding_modules`): one flat buffer per data type,
every INT row with an fp16 scale and bias (``value = code * scale + bias`` in fp32), FP16 rows rounded to nearest,
FP32 rows as they are. The state dict is torchrec's quantized EC's in its ``quant_state_dict_split_scale_bias`` mode,
byte for byte: ``embeddings.<table>.weight`` (uint8 ``[rows, ceil(dim * bits / 8)]``) plus for INT tables
``.weight_qscale`` / ``.weight_qbias`` (fp16 ``[rows, 1]``); ``load_state_dict`` also takes torchrec's other layouts
(FBGEMM's fused rows, padded to any row alignment, see :mod:`tritonrec.modules.quant_state`).

A lookup of feature ``f`` (``N_f`` ids) is the quantized pooled lookup with ``N_f`` bags of one id each: the same
kernel, dequantization and bounds checks as the quantized EBC, and an output of exactly ``[N_f, D_f]`` (one launch
per feature, instead of one per data type padded to the longest feature). Rows are dequantized in fp32 and cast once
to ``output_dtype``. No autograd: this module is for inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    PoolingMode,
    QuantizedTables,
    TableBatchedLayout,
    TableSpec,
    quantized_pooled_lookup,
)
from tritonrec.kernels.embedding.quantized import has_scale_bias, row_bytes
from tritonrec.modules.embedding_configs import (
    QUANT_BITS,
    DataType,
    EmbeddingConfig,
    get_embedding_names_by_table,
)
from tritonrec.modules.embedding_modules import EmbeddingCollection
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.quant_embedding_modules import (
    _DATA_TYPE_NAMES,
    _build_quant_groups,
    _check_output_dtype,
    _QuantGroup,
    _types_from_qconfig,
)
from tritonrec.modules.quant_state import SCALE_BIAS_BYTES, normalize_table_state, split_fused_rows
from tritonrec.modules.table_batched import TableBatchedCollection, validate_tables

DEFAULT_ROW_ALIGNMENT = 16  # FBGEMM's TBE default; only torchrec's fused state-dict rows are padded to it


def _normalize_loaded_state(module: QuantEmbeddingCollection, state_dict: dict, prefix: str, *_: object) -> None:
    """Load pre-hook: torchrec's layouts -> ours, with errors naming the key (as the quantized EBC's)."""
    for config in module.embedding_configs():
        bits = QUANT_BITS[config.data_type]
        table_prefix = f"{prefix}embeddings.{config.name}."
        normalize_table_state(state_dict, table_prefix, config.num_embeddings, config.embedding_dim, bits)


def _draw(config: EmbeddingConfig) -> torch.Tensor:
    """``config.init_fn``'s draw of a ``[rows, dim]`` fp32 table."""
    table = torch.empty(config.num_embeddings, config.embedding_dim)
    with torch.no_grad():
        drawn = config.init_fn(table)
    return table if drawn is None else drawn


def _single_feature_layouts(group: _QuantGroup) -> list[TableBatchedLayout]:
    """For each slot of the group: a one-table, one-feature SUM layout, so ``N_f`` one-id bags give ``[N_f, D]``."""
    layout = group.tables.layout
    out = []
    for name, t in zip(layout.feature_names, layout.feature_tables, strict=True):
        spec = layout.tables[t]
        out.append(TableBatchedLayout([TableSpec(spec.num_rows, spec.dim, PoolingMode.SUM, spec.name)], [0], [name]))
    return out


def _table_of(group: _QuantGroup, t: int, layout: TableBatchedLayout) -> QuantizedTables:
    """Table ``t`` of the group as :class:`QuantizedTables` of its own (views of the group's flat storage)."""
    scale, bias = group.tables.table_scale_bias(t)
    return QuantizedTables(layout, group.tables.bits, group.tables.table_codes(t).reshape(-1), scale, bias)


class QuantEmbeddingCollection(TableBatchedCollection):
    """Sequence embeddings of row-wise quantized tables (see module docstring).

    Args (torchrec's):
        tables: ``EmbeddingConfig`` per table with ``data_type`` FP32, FP16, INT8, INT4 or INT2 (mixed: one table
            batch per data type); tables may have different dims (torchrec's requires one dim).
        device: where the tables live.
        need_indices: also return each feature's ids as the output JaggedTensor's ``weights``.
        output_dtype: float32, float16 or bfloat16 (rows dequantized in fp32, cast once).
        table_name_to_quantized_weights: ``{table: (codes uint8 [rows, >= row bytes], scale_shift uint8 [rows, 4] |
            None)}`` as torchrec's ``quantize_state_dict`` builds them; tables not named start as their ``init_fn``
            draw, quantized. Prefer :meth:`from_float`.
        register_tbes, cache_features_order: torchrec's FBGEMM-module options; accepted, nothing to do here.
        quant_state_dict_split_scale_bias: accepted; the state dict is always the split layout (what torchrec's
            sharded inference modules save), and ``load_state_dict`` takes either.
        row_alignment: the fused rows' alignment in torchrec's other layout; our rows are not padded (a positive
            int, checked; loading takes fused rows of any padding).
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        cache_features_order: bool = False,
        *,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
        _float_weights: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(bounds_check, backend)
        self._output_dtype = _check_output_dtype(output_dtype)
        self._embedding_configs = validate_tables(tables, EmbeddingConfig, type(self).__name__)
        for config in self._embedding_configs:
            if config.data_type not in QUANT_BITS:
                raise ValueError(
                    f"table {config.name!r}: QuantEmbeddingCollection needs data_type {_DATA_TYPE_NAMES}, got "
                    f"{config.data_type}"
                )
        if isinstance(row_alignment, bool) or not isinstance(row_alignment, int) or row_alignment < 1:
            raise ValueError(f"row_alignment must be a positive int, got row_alignment={row_alignment!r}")
        self.row_alignment = row_alignment
        self.register_tbes = bool(register_tbes)
        self._need_indices = bool(need_indices)
        quantized = dict(table_name_to_quantized_weights or {})
        unknown = sorted(set(quantized) - {c.name for c in self._embedding_configs})
        if unknown:
            raise ValueError(f"table_name_to_quantized_weights names tables the module does not have: {unknown}")
        if quantized and _float_weights is None:  # no init_fn draw for tables whose bytes are given
            _float_weights = [
                torch.zeros(c.num_embeddings, c.embedding_dim) if c.name in quantized else _draw(c)
                for c in self._embedding_configs
            ]
        self.embeddings = nn.ModuleDict()
        self._quant_groups = _build_quant_groups(
            self._embedding_configs, self.embeddings, device, _float_weights, pooled=False
        )
        self._feature_layouts = [_single_feature_layouts(g) for g in self._quant_groups]
        # torchrec's order: data-type groups in first-appearance order, tables in config order within a group
        self._embedding_names = [n for g in self._quant_groups for n in g.feature_names]
        for name, (codes, scale_shift) in quantized.items():
            self._copy_quantized(name, codes, scale_shift)
        self.register_load_state_dict_pre_hook(_normalize_loaded_state)

    def _copy_quantized(self, name: str, codes: torch.Tensor, scale_shift: torch.Tensor | None) -> None:
        """Write torchrec's ``(codes, scale_shift)`` bytes of table ``name`` into the flat storage."""
        where = f"table_name_to_quantized_weights[{name!r}]"
        for group in self._quant_groups:
            for t, spec in enumerate(group.tables.layout.tables):
                if spec.name != name:
                    continue
                width = row_bytes(spec.dim, group.tables.bits)
                ok = isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and codes.ndim == 2
                if not ok or codes.shape[0] != spec.num_rows or codes.shape[1] < width:
                    got = f"{codes.dtype} {list(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes)
                    raise ValueError(f"{where}: codes must be uint8 [{spec.num_rows}, >= {width}], got {got}")
                views = group.views(t)
                if has_scale_bias(group.tables.bits):
                    header = (spec.num_rows, SCALE_BIAS_BYTES)
                    if not isinstance(scale_shift, torch.Tensor) or tuple(scale_shift.shape) != header:
                        raise ValueError(f"{where}: scale_shift must be uint8 {list(header)}, got {scale_shift!r}")
                    fused = torch.cat([scale_shift.to(torch.uint8), codes], dim=1)
                    parts = split_fused_rows(fused, width)
                else:
                    parts = (codes[:, :width],)
                with torch.no_grad():
                    for view, part in zip(views, parts, strict=False):
                        view.copy_(part)

    @classmethod
    def from_float(
        cls,
        module: EmbeddingCollection,
        data_type: DataType | Mapping[str, DataType] | None = None,
        *,
        output_dtype: torch.dtype | None = None,
        bounds_check: BoundsCheckMode | None = None,
        backend: Backend | None = None,
        use_precomputed_fake_quant: bool = False,
    ) -> QuantEmbeddingCollection:
        """Quantize a float :class:`EmbeddingCollection` (its tables, weights, ``need_indices`` and device).

        ``data_type`` / ``output_dtype`` as :meth:`QuantEmbeddingBagCollection.from_float`: one data type or
        ``{table: DataType}``, else ``module.qconfig``'s weight dtype (per table from its ``per_table_weight_dtype``)
        and activation dtype, else INT8 / float32. ``use_precomputed_fake_quant`` is accepted and ignored."""
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(f"module must be an EmbeddingCollection, got {type(module).__name__}")
        names = [c.name for c in module.embedding_configs()]
        data_types, output_dtype = _types_from_qconfig(module, names, data_type, output_dtype)
        configs = [dataclasses.replace(c, data_type=data_types[c.name]) for c in module.embedding_configs()]
        return cls(
            configs,
            module.device,
            module.need_indices(),
            output_dtype,
            bounds_check=module.bounds_check if bounds_check is None else bounds_check,
            backend=module.backend if backend is None else backend,
            _float_weights=[module.embeddings[c.name].weight for c in configs],
        )

    def _ensure_packed(self) -> None:
        if torch.compiler.is_compiling():  # see TableBatchedCollection._ensure_packed
            return
        for group in getattr(self, "_quant_groups", []):
            if not group.is_packed():
                group.repack()

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """``features`` -> ``{embedding name: JaggedTensor(values [N_f, D_f] of output_dtype, lengths [B])}``, keyed
        in torchrec's order: by data-type group (as the state dict), then table order (the float EC's order when all
        tables share a data type)."""
        if (leaf := fx_leaf_call(self, features)) is not None:
            return leaf  # type: ignore[return-value]
        self._ensure_packed()
        result: dict[str, JaggedTensor] = {}
        for group, layouts in zip(self._quant_groups, self._feature_layouts, strict=True):
            inputs = self._group_inputs(features, group, False)  # type: ignore[arg-type]
            spans, batch = inputs.value_offsets, features.stride()
            assert spans is not None
            for f, (name, layout) in enumerate(zip(group.feature_names, layouts, strict=True)):
                ids = inputs.values[spans[f] : spans[f + 1]]
                one_id_bags = torch.arange(ids.numel() + 1, dtype=inputs.offsets.dtype, device=ids.device)
                rows = quantized_pooled_lookup(
                    _table_of(group, group.tables.layout.feature_tables[f], layout),
                    ids,
                    one_id_bags,
                    bounds_check=self.bounds_check,
                    backend=self.backend,
                )
                result[name] = JaggedTensor(
                    values=rows.to(self._output_dtype),
                    lengths=inputs.lengths[f * batch : (f + 1) * batch],
                    weights=ids if self._need_indices else None,
                )
        return {name: result[name] for name in self._embedding_names}

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output (embedding) names, in config order (torchrec's API)."""
        return get_embedding_names_by_table(self._embedding_configs)

    def embedding_dim(self) -> int:
        """The common dim when all tables share one (torchrec's API); raises when they differ."""
        dims = {c.embedding_dim for c in self._embedding_configs}
        if len(dims) != 1:
            raise ValueError(f"tables have different dims {sorted(dims)}; read each table's embedding_dim instead")
        return dims.pop()

    def need_indices(self) -> bool:
        return self._need_indices

    def output_dtype(self) -> torch.dtype:
        """The output rows' dtype (torchrec's ``output_dtype()``)."""
        return self._output_dtype

    @property
    def device(self) -> torch.device:
        return self._quant_groups[0].tables.codes.device

    def copy(self, device: torch.device) -> QuantEmbeddingCollection:
        """``self``, unmoved (torchrec's ``ModuleNoCopyMixin``, as the quantized EBC). Move with ``.to(device)``."""
        return self

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """Every table dequantized to ``[rows, dim]`` fp32 (what the lookups compute with)."""
        self._ensure_packed()
        return {
            spec.name: group.tables.dequantized(t)
            for group in self._quant_groups
            for t, spec in enumerate(group.tables.layout.tables)
        }


__all__ = ["QuantEmbeddingCollection"]
