"""``QuantEmbeddingBagCollection``: row-wise INT8 / INT4 tables for inference (torchrec's quantized EBC).

``QuantEmbeddingBagCollection.from_float(ebc, data_type=DataType.INT8)`` quantizes a trained (float)
EmbeddingBagCollection; every row keeps an fp16 scale and bias and the pooled kernel dequantizes inside the lookup
(``code * scale + bias``, accumulated in fp32). Buffers follow torchrec's names:
``embedding_bags.<table>.weight`` (uint8 codes ``[rows, ceil(dim * bits / 8)]``), ``.weight_qscale`` and
``.weight_qbias`` (fp16 ``[rows]``); they are views of one flat buffer per bit width, re-packed before a forward if
``.to()`` or ``load_state_dict(assign=True)`` replaced them. No autograd: this module is for inference.
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
    pooling_type_to_pooling_mode,
)
from tritonrec.modules.embedding_modules import EmbeddingBagCollection
from tritonrec.modules.table_batched import TableBatchedCollection, pooled_column_order, validate_tables

_BUFFERS = ("weight", "weight_qscale", "weight_qbias")


@dataclass
class _QuantGroup:
    """Tables of one bit width: their quantized flat storage and the per-table modules holding buffer views."""

    tables: QuantizedTables
    modules: list[nn.Module]

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.tables.layout.feature_names

    def views(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.tables.table_codes(t), *self.tables.table_scale_bias(t))

    def bind(self) -> None:
        """(Re)register each table's buffers as views of the flat storage."""
        for t, module in enumerate(self.modules):
            for name, view in zip(_BUFFERS, self.views(t), strict=True):
                module.register_buffer(name, view)

    def is_packed(self) -> bool:
        return all(
            getattr(module, name).data_ptr() == view.data_ptr() and getattr(module, name).device == view.device
            for t, module in enumerate(self.modules)
            for name, view in zip(_BUFFERS, self.views(t), strict=True)
            if view.numel()
        )

    def repack(self) -> None:
        """Gather the modules' current buffers into new flat storage (after a device move or assignment)."""
        codes = torch.cat([m.weight.reshape(-1) for m in self.modules])
        scale = torch.cat([m.weight_qscale.reshape(-1) for m in self.modules])
        bias = torch.cat([m.weight_qbias.reshape(-1) for m in self.modules])
        self.tables = QuantizedTables(self.tables.layout, self.tables.bits, codes, scale, bias)
        self.bind()


class QuantEmbeddingBagCollection(TableBatchedCollection):
    """Pooled lookups on row-wise quantized tables (see module docstring).

    ``tables`` carry ``data_type`` INT8 or INT4; weights start as each table's ``init_fn`` draw, quantized.
    Prefer :meth:`from_float` to quantize a trained collection.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
        _float_weights: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(bounds_check, backend)
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
        self._embedding_names = [f for config in self._embedding_bag_configs for f in config.feature_names]
        self._lengths_per_embedding = [c.embedding_dim for c in self._embedding_bag_configs for _ in c.feature_names]
        self._column_order = pooled_column_order(
            [(g.feature_names, g.tables.layout.feature_dims) for g in self._quant_groups], self._embedding_names
        )

    def _build(self, device: torch.device | str | None, float_weights: list[torch.Tensor] | None) -> list[_QuantGroup]:
        by_bits: dict[int, list[int]] = {}
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
            layout = TableBatchedLayout(specs, feature_tables, [f for c in configs for f in c.feature_names])
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
            group = _QuantGroup(QuantizedTables.from_float(layout, floats, bits), modules)
            group.bind()
            groups.append(group)
        return groups

    @classmethod
    def from_float(
        cls,
        module: EmbeddingBagCollection,
        data_type: DataType = DataType.INT8,
        *,
        bounds_check: BoundsCheckMode | None = None,
        backend: Backend | None = None,
    ) -> QuantEmbeddingBagCollection:
        """Quantize a float :class:`EmbeddingBagCollection` (its tables, weights, weighting and device)."""
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"module must be an EmbeddingBagCollection, got {type(module).__name__}")
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
            _float_weights=weights,
        )

    def _ensure_packed(self) -> None:
        for group in getattr(self, "_quant_groups", []):
            if not group.is_packed():
                group.repack()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features`` -> ``KeyedTensor`` ``[B, sum(D)]`` fp32, as :class:`EmbeddingBagCollection`."""
        self._ensure_packed()
        outputs = []
        for group in self._quant_groups:
            inputs = self._group_inputs(features, group, self._is_weighted)  # type: ignore[arg-type]
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
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """Every table dequantized to ``[rows, dim]`` fp32 (what the lookups compute with)."""
        self._ensure_packed()
        out = {}
        for group in self._quant_groups:
            for t, spec in enumerate(group.tables.layout.tables):
                out[spec.name] = group.tables.dequantized(t)
        return out


__all__ = ["QuantEmbeddingBagCollection", "quantize_rowwise"]
