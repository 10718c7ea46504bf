"""``QuantEmbeddingBagCollection``: row-wise INT8 / INT4 tables for inference (torchrec's quantized EBC).

``QuantEmbeddingBagCollection.from_float(ebc, data_type=DataType.INT8)`` quantizes a trained (float)
EmbeddingBagCollection; every row keeps an fp16 scale and bias and the pooled kernel dequantizes inside the lookup
(``code * scale + bias``, accumulated in fp32). The state dict is torchrec's quantized EBC's, byte for byte
(:mod:`tritonrec.modules.quant_state`): ``embedding_bags.<table>.weight`` (uint8 codes ``[rows, ceil(dim * bits /
8)]``), ``.weight_qscale`` and ``.weight_qbias`` (fp16 ``[rows, 1]``); ``load_state_dict`` also takes torchrec's
other layouts. The buffers are views of one flat buffer per bit width, re-packed before a forward if ``.to()`` or
``load_state_dict(assign=True)`` replaced them. No autograd: this module is for inference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    QuantizedTables,
    TableBatchedLayout,
    TableSpec,
    quantize_rowwise,
    quantized_pooled_lookup,
)
from tritonrec.modules.embedding_configs import (
    QUANT_BITS,
    DataType,
    EmbeddingBagConfig,
    get_embedding_names,
    get_embedding_names_by_table,
    pooling_type_to_pooling_mode,
)
from tritonrec.modules.embedding_modules import EmbeddingBagCollection
from tritonrec.modules.quant_state import BUFFER_NAMES, normalize_table_state
from tritonrec.modules.table_batched import TableBatchedCollection, pooled_column_order, validate_tables

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch.ao qconfig weight dtypes (torchrec's from_float reads module.qconfig) -> our data types
_QCONFIG_DATA_TYPES = {torch.quint8: DataType.INT8, torch.quint4x2: DataType.INT4}


@dataclass
class _QuantGroup:
    """Tables of one bit width: their quantized flat storage and the per-table modules holding buffer views."""

    tables: QuantizedTables
    modules: list[nn.Module]
    source_features: tuple[str, ...]  # the KJT key each slot reads (slots are labelled by embedding name)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.tables.layout.feature_names

    def views(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Table ``t``'s codes ``[rows, row_bytes]`` and scale / bias ``[rows, 1]`` (torchrec's shapes)."""
        scale, bias = self.tables.table_scale_bias(t)
        return self.tables.table_codes(t), scale.unsqueeze(1), bias.unsqueeze(1)

    def bind(self) -> None:
        """(Re)register each table's buffers as views of the flat storage."""
        for t, module in enumerate(self.modules):
            for name, view in zip(BUFFER_NAMES, self.views(t), strict=True):
                module.register_buffer(name, view)

    def is_packed(self) -> bool:
        return all(
            getattr(module, name).data_ptr() == view.data_ptr() and getattr(module, name).device == view.device
            for t, module in enumerate(self.modules)
            for name, view in zip(BUFFER_NAMES, self.views(t), strict=True)
            if view.numel()
        )

    def repack(self) -> None:
        """Gather the modules' current buffers into new flat storage (after a device move or assignment)."""
        codes = torch.cat([m.weight.reshape(-1) for m in self.modules])
        scale = torch.cat([m.weight_qscale.reshape(-1) for m in self.modules])
        bias = torch.cat([m.weight_qbias.reshape(-1) for m in self.modules])
        self.tables = QuantizedTables(self.tables.layout, self.tables.bits, codes, scale, bias)
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


def _types_from_qconfig(
    module: nn.Module, data_type: DataType | None, output_dtype: torch.dtype | None
) -> tuple[DataType, torch.dtype]:
    """``data_type`` / ``output_dtype``, else (as torchrec) ``module.qconfig``'s weight / activation dtypes, else
    INT8 / fp32."""
    qconfig = getattr(module, "qconfig", None)
    if data_type is None and qconfig is not None:
        weight_dtype = qconfig.weight().dtype
        if weight_dtype not in _QCONFIG_DATA_TYPES:
            raise ValueError(f"module.qconfig: weight dtype must be torch.quint8 or torch.quint4x2, got {weight_dtype}")
        data_type = _QCONFIG_DATA_TYPES[weight_dtype]
    if output_dtype is None and qconfig is not None:
        output_dtype = qconfig.activation().dtype
    return DataType.INT8 if data_type is None else data_type, torch.float32 if output_dtype is None else output_dtype


class QuantEmbeddingBagCollection(TableBatchedCollection):
    """Pooled lookups on row-wise quantized tables (see module docstring).

    ``tables`` carry ``data_type`` INT8 or INT4; weights start as each table's ``init_fn`` draw, quantized.
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
                    f"table {config.name!r}: QuantEmbeddingBagCollection needs data_type INT8 or INT4, got "
                    f"{config.data_type}"
                )
        self._is_weighted = bool(is_weighted)
        self.embedding_bags = nn.ModuleDict()
        self._quant_groups = self._build(device, _float_weights)
        self._embedding_names = get_embedding_names(self._embedding_bag_configs)
        self._lengths_per_embedding = [c.embedding_dim for c in self._embedding_bag_configs for _ in c.feature_names]
        self._column_order = pooled_column_order(
            [(g.feature_names, g.tables.layout.feature_dims) for g in self._quant_groups], self._embedding_names
        )
        self.register_load_state_dict_pre_hook(_normalize_loaded_state)

    def _build(self, device: torch.device | str | None, float_weights: list[torch.Tensor] | None) -> list[_QuantGroup]:
        by_bits: dict[int, list[int]] = {}
        embedding_names = get_embedding_names_by_table(self._embedding_bag_configs)
        for i, config in enumerate(self._embedding_bag_configs):
            by_bits.setdefault(QUANT_BITS[config.data_type], []).append(i)
        groups = []
        for bits, positions in by_bits.items():
            configs = [self._embedding_bag_configs[i] for i in positions]
            specs = [
                TableSpec(c.num_embeddings, c.embedding_dim, pooling_type_to_pooling_mode(c.pooling), c.name)
                for c in configs
            ]
            feature_tables = [local for local, c in enumerate(configs) for _ in c.feature_names]
            layout = TableBatchedLayout(specs, feature_tables, [n for i in positions for n in embedding_names[i]])
            floats = []
            for i, config in zip(positions, configs, strict=True):
                if float_weights is not None:
                    floats.append(float_weights[i].detach().to(device=device, dtype=torch.float32))
                else:
                    table = torch.empty(config.num_embeddings, config.embedding_dim, device=device)
                    with torch.no_grad():
                        drawn = config.init_fn(table)
                    floats.append(table if drawn is None else drawn)
            modules = []
            for config in configs:
                self.embedding_bags[config.name] = nn.Module()
                modules.append(self.embedding_bags[config.name])
            sources = tuple(f for c in configs for f in c.feature_names)
            group = _QuantGroup(QuantizedTables.from_float(layout, floats, bits), modules, sources)
            group.bind()
            groups.append(group)
        return groups

    @classmethod
    def from_float(
        cls,
        module: EmbeddingBagCollection,
        data_type: DataType | None = None,
        *,
        output_dtype: torch.dtype | None = None,
        bounds_check: BoundsCheckMode | None = None,
        backend: Backend | None = None,
        use_precomputed_fake_quant: bool = False,
    ) -> QuantEmbeddingBagCollection:
        """Quantize a float :class:`EmbeddingBagCollection` (its tables, weights, weighting and device).

        ``data_type`` / ``output_dtype`` default to ``module.qconfig``'s weight (``torch.quint8`` -> INT8,
        ``torch.quint4x2`` -> INT4) and activation dtypes when it has one (torchrec's way, which lets
        ``torch.ao.quantization.quantize_dynamic`` swap modules), else INT8 / float32.
        ``use_precomputed_fake_quant`` is accepted and ignored, as torchrec does."""
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"module must be an EmbeddingBagCollection, got {type(module).__name__}")
        data_type, output_dtype = _types_from_qconfig(module, data_type, output_dtype)
        if data_type not in QUANT_BITS:
            raise ValueError(f"data_type must be DataType.INT8 or DataType.INT4, got data_type={data_type!r}")
        configs = [dataclasses.replace(c, data_type=data_type) for c in module.embedding_bag_configs()]
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
