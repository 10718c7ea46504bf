"""``QuantEmbeddingBagCollection``: INT8 / INT4 / INT2 (row-wise) and FP16 / FP32 tables for inference (torchrec's
quantized EBC).

``QuantEmbeddingBagCollection.from_float(ebc, data_type=DataType.INT8)`` quantizes a trained (float)
EmbeddingBagCollection; every row of an INT table keeps an fp16 scale and bias and the pooled kernel dequantizes
inside the lookup (``code * scale + bias``, accumulated in fp32); FP16 tables store the weights rounded to fp16, FP32
ones as they are. Tables may mix data types (one table batch per type). The state dict is torchrec's quantized EBC's,
byte for byte (:mod:`tritonrec.modules.quant_state`): ``embedding_bags.<table>.weight`` (uint8 ``[rows, ceil(dim *
bits / 8)]``), plus for INT tables ``.weight_qscale`` and ``.weight_qbias`` (fp16 ``[rows, 1]``); ``load_state_dict``
also takes torchrec's other layouts. The buffers are views of one flat buffer per data type, re-packed before a
forward if ``.to()`` or ``load_state_dict(assign=True)`` replaced them. No autograd: this module is for inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    QuantizedTables,
    quantize_rowwise,
    quantized_pooled_lookup,
)
from tritonrec.modules.embedding_configs import (
    QUANT_BITS,
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    get_embedding_names,
)
from tritonrec.modules.embedding_modules import EmbeddingBagCollection
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.quant_state import buffer_names, normalize_table_state
from tritonrec.modules.table_batched import (
    TableBatchedCollection,
    group_layout,
    pooled_column_order,
    validate_tables,
)

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch.ao qconfig weight dtypes (torchrec's from_float reads module.qconfig) -> our data types
_QCONFIG_DATA_TYPES = {
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP16,
    torch.quint8: DataType.INT8,
    torch.qint8: DataType.INT8,  # torchrec maps all three 8-bit dtypes to INT8 (its default is torch.int8)
    torch.int8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
}
_DATA_TYPE_NAMES = "FP32, FP16, INT8, INT4 or INT2"


@dataclass
class _QuantGroup:
    """Tables of one data type: their flat storage and the per-table modules holding buffer views."""

    tables: QuantizedTables
    modules: list[nn.Module]
    source_features: tuple[str, ...]  # the KJT key each slot reads (slots are labelled by embedding name)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.tables.layout.feature_names

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return buffer_names(self.tables.bits)

    def views(self, t: int) -> tuple[torch.Tensor, ...]:
        """Table ``t``'s codes ``[rows, row_bytes]`` and (INT tables) scale / bias ``[rows, 1]`` (torchrec's shapes)."""
        scale, bias = self.tables.table_scale_bias(t)
        return (self.tables.table_codes(t), scale.unsqueeze(1), bias.unsqueeze(1))[: len(self.buffer_names)]

    def bind(self) -> None:
        """(Re)register each table's buffers as views of the flat storage."""
        for t, module in enumerate(self.modules):
            for name, view in zip(self.buffer_names, self.views(t), strict=True):
                module.register_buffer(name, view)

    def is_packed(self) -> bool:
        return all(
            getattr(module, name).data_ptr() == view.data_ptr() and getattr(module, name).device == view.device
            for t, module in enumerate(self.modules)
            for name, view in zip(self.buffer_names, self.views(t), strict=True)
            if view.numel()
        )

    def repack(self) -> None:
        """Gather the modules' current buffers into new flat storage (after a device move or assignment)."""
        codes = torch.cat([m.weight.reshape(-1) for m in self.modules])
        scale, bias = self.tables.scale[:0], self.tables.bias[:0]  # FP16 / FP32 tables have none
        if "weight_qscale" in self.buffer_names:
            scale = torch.cat([m.weight_qscale.reshape(-1) for m in self.modules])
            bias = torch.cat([m.weight_qbias.reshape(-1) for m in self.modules])
        # .float() / .double() cast the fp16 scale / bias buffers too (torchrec's keep working): fp16 holds them exactly
        self.tables = QuantizedTables(
            self.tables.layout,
            self.tables.bits,
            codes,
            scale.to(codes.device, torch.float16),
            bias.to(codes.device, torch.float16),
        )
        self.bind()


def _normalize_loaded_state(module: QuantEmbeddingBagCollection, state_dict: dict, prefix: str, *_: object) -> None:
    """Load pre-hook: torchrec's formats and our earlier ``[rows]`` scale / bias -> ours, with named errors."""
    for config in module.embedding_bag_configs():
        table_prefix = f"{prefix}embedding_bags.{config.name}."
        bits = QUANT_BITS[config.data_type]
        normalize_table_state(state_dict, table_prefix, config.num_embeddings, config.embedding_dim, bits)


def _check_output_dtype(output_dtype: object) -> torch.dtype:
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {_OUTPUT_DTYPES}, got output_dtype={output_dtype!r}")
    return output_dtype  # type: ignore[return-value]


def _qconfig_data_type(weight_dtype: object, where: str) -> DataType:
    if weight_dtype not in _QCONFIG_DATA_TYPES:
        raise ValueError(f"{where} must be one of {list(_QCONFIG_DATA_TYPES)}, got {weight_dtype}")
    return _QCONFIG_DATA_TYPES[weight_dtype]  # type: ignore[index]


def _types_from_qconfig(
    module: nn.Module,
    names: list[str],
    data_type: DataType | Mapping[str, DataType] | None,
    output_dtype: torch.dtype | None,
) -> tuple[dict[str, DataType], torch.dtype]:
    """Each table (of ``names``)'s data type and the output dtype: ``data_type`` (one for all tables, or per table
    name) / ``output_dtype``, else (as torchrec) ``module.qconfig``'s weight dtype (``per_table_weight_dtype`` first,
    as torchrec's ``QuantConfig``) / activation dtype, else INT8 / fp32. Shared with the quantized EC."""
    qconfig = getattr(module, "qconfig", None)
    if output_dtype is None and qconfig is not None:
        output_dtype = qconfig.activation().dtype
    default, per_table = DataType.INT8, {}
    if data_type is not None and not isinstance(data_type, Mapping):
        default = data_type  # one data type for every table: the qconfig's weight dtypes are not read
    elif qconfig is not None:
        default = _qconfig_data_type(qconfig.weight().dtype, "module.qconfig: weight dtype")
        for name, dtype in (getattr(qconfig, "per_table_weight_dtype", None) or {}).items():
            per_table[name] = _qconfig_data_type(dtype, f"module.qconfig.per_table_weight_dtype[{name!r}]")
    if isinstance(data_type, Mapping):
        unknown = sorted(set(data_type) - set(names))
        if unknown:
            raise ValueError(f"data_type names tables the module does not have: {unknown} (tables: {names})")
        per_table.update(data_type)
    types = {name: per_table.get(name, default) for name in names}
    for name, table_type in types.items():
        if table_type not in QUANT_BITS:
            raise ValueError(
                f"data_type must be DataType {_DATA_TYPE_NAMES}, got data_type={table_type!r} for table {name!r}"
            )
    return types, torch.float32 if output_dtype is None else output_dtype


def _build_quant_groups(
    configs: list[BaseEmbeddingConfig],
    container: nn.ModuleDict,
    device: torch.device | str | None,
    float_weights: list[torch.Tensor] | None,
    pooled: bool,
) -> list[_QuantGroup]:
    """One :class:`_QuantGroup` per data type (first-appearance order) holding ``float_weights[i]`` (else each
    config's ``init_fn`` draw) quantized, and one child module per table in ``container`` (shared with the EC)."""
    by_bits: dict[int, list[int]] = {}
    for i, config in enumerate(configs):
        by_bits.setdefault(QUANT_BITS[config.data_type], []).append(i)
    groups = []
    for bits, positions in by_bits.items():
        group_configs = [configs[i] for i in positions]
        layout, sources = group_layout(configs, positions, pooled=pooled)
        floats = []
        for i, config in zip(positions, group_configs, strict=True):
            if float_weights is not None:
                floats.append(float_weights[i].detach().to(device=device, dtype=torch.float32))
            else:
                table = torch.empty(config.num_embeddings, config.embedding_dim, device=device)
                with torch.no_grad():
                    drawn = config.init_fn(table)
                floats.append(table if drawn is None else drawn)
        modules = []
        for config in group_configs:
            container[config.name] = nn.Module()
            modules.append(container[config.name])
        group = _QuantGroup(QuantizedTables.from_float(layout, floats, bits), modules, sources)
        group.bind()
        groups.append(group)
    return groups


class QuantEmbeddingBagCollection(TableBatchedCollection):
    """Pooled lookups on row-wise quantized tables (see module docstring).

    ``tables`` carry ``data_type`` FP32, FP16, INT8, INT4 or INT2 (mixed: one table batch per data type); weights
    start as each table's ``init_fn`` draw, quantized.
    Prefer :meth:`from_float` to quantize a trained collection. ``output_dtype``: the pooled output's dtype
    (float32, float16 or bfloat16; accumulated in fp32 and cast once, as FBGEMM's TBE).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
        output_dtype: torch.dtype = torch.float32,
        _float_weights: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(bounds_check, backend)
        self._output_dtype = _check_output_dtype(output_dtype)
        self._embedding_bag_configs = validate_tables(tables, EmbeddingBagConfig, type(self).__name__)
        for config in self._embedding_bag_configs:
            if config.data_type not in QUANT_BITS:
                raise ValueError(
                    f"table {config.name!r}: QuantEmbeddingBagCollection needs data_type {_DATA_TYPE_NAMES}, got "
                    f"{config.data_type}"
                )
        self._is_weighted = bool(is_weighted)
        self.embedding_bags = nn.ModuleDict()
        self._quant_groups = _build_quant_groups(
            self._embedding_bag_configs, self.embedding_bags, device, _float_weights, pooled=True
        )
        self._embedding_names = get_embedding_names(self._embedding_bag_configs)
        self._lengths_per_embedding = [c.embedding_dim for c in self._embedding_bag_configs for _ in c.feature_names]
        self._column_order = pooled_column_order(
            [(g.feature_names, g.tables.layout.feature_dims) for g in self._quant_groups], self._embedding_names
        )
        self.register_load_state_dict_pre_hook(_normalize_loaded_state)

    @classmethod
    def from_float(
        cls,
        module: EmbeddingBagCollection,
        data_type: DataType | Mapping[str, DataType] | None = None,
        *,
        output_dtype: torch.dtype | None = None,
        bounds_check: BoundsCheckMode | None = None,
        backend: Backend | None = None,
        use_precomputed_fake_quant: bool = False,
    ) -> QuantEmbeddingBagCollection:
        """Quantize a float :class:`EmbeddingBagCollection` (its tables, weights, weighting and device).

        ``data_type``: one for every table, or ``{table name: DataType}`` for some (the others take the default).
        ``data_type`` / ``output_dtype`` default to ``module.qconfig``'s weight (``torch.quint8`` -> INT8,
        ``torch.quint4x2`` -> INT4, ``torch.quint2x4`` -> INT2, ``torch.float16`` -> FP16, ``torch.float32`` -> FP32;
        per table from its ``per_table_weight_dtype`` as torchrec's ``QuantConfig``) and activation dtypes when it
        has one (torchrec's way, which lets ``torch.ao.quantization.quantize_dynamic`` swap modules), else INT8 /
        float32.
        ``use_precomputed_fake_quant`` is accepted and ignored, as torchrec does."""
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"module must be an EmbeddingBagCollection, got {type(module).__name__}")
        names = [c.name for c in module.embedding_bag_configs()]
        data_types, output_dtype = _types_from_qconfig(module, names, data_type, output_dtype)
        configs = [dataclasses.replace(c, data_type=data_types[c.name]) for c in module.embedding_bag_configs()]
        weights = [module.embedding_bags[c.name].weight for c in configs]
        return cls(
            configs,
            module.is_weighted(),
            module.device,
            bounds_check=module.bounds_check if bounds_check is None else bounds_check,
            backend=module.backend if backend is None else backend,
            output_dtype=output_dtype,
            _float_weights=weights,
        )

    def _ensure_packed(self) -> None:
        if torch.compiler.is_compiling():  # see TableBatchedCollection._ensure_packed
            return
        for group in getattr(self, "_quant_groups", []):
            if not group.is_packed():
                group.repack()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features`` -> ``KeyedTensor`` ``[B, sum(D)]`` of :meth:`output_dtype`, as the float collection."""
        if (leaf := fx_leaf_call(self, features)) is not None:
            return leaf  # type: ignore[return-value]
        self._ensure_packed()
        outputs = []
        for group in self._quant_groups:
            inputs = self._group_inputs(features, group, self._is_weighted, False)  # type: ignore[arg-type]
            outputs.append(
                quantized_pooled_lookup(
                    group.tables,
                    inputs.values,
                    inputs.offsets,
                    inputs.weights,
                    bounds_check=self.bounds_check,
                    backend=self.backend,
                )
            )
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        values = values.to(self._output_dtype)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def output_dtype(self) -> torch.dtype:
        """The pooled output's dtype (torchrec's ``output_dtype()``)."""
        return self._output_dtype

    def copy(self, device: torch.device) -> QuantEmbeddingBagCollection:
        """``self``, unmoved: torchrec's ``ModuleNoCopyMixin`` (a model-parallel copy of an inference model keeps
        its quantized tables where they are). Move with ``.to(device)``."""
        return self

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """Every table dequantized to ``[rows, dim]`` fp32 (what the lookups compute with)."""
        self._ensure_packed()
        out = {}
        for group in self._quant_groups:
            for t, spec in enumerate(group.tables.layout.tables):
                out[spec.name] = group.tables.dequantized(t)
        return out


__all__ = ["QuantEmbeddingBagCollection", "quantize_rowwise"]
