"""``EmbeddingBagCollection`` and ``EmbeddingCollection`` (torchrec's modules), on the table-batched kernels.

* ``EmbeddingBagCollection(tables, is_weighted=False, device=None)``: ``forward(kjt) -> KeyedTensor`` of
  ``[B, sum(D)]`` with keys = embedding names in table order. Parameters ``embedding_bags.<table>.weight``.
* ``EmbeddingCollection(tables, device=None)``: ``forward(kjt) -> dict[embedding name, JaggedTensor]`` whose
  values are ``[N_f, D_f]`` rows; tables may have different dims. Parameters ``embeddings.<table>.weight``.

Embedding names follow torchrec: a feature read by one table keeps its name, a feature read by several tables
(a shared feature) is ``f"{feature}@{table}"`` in each, and each of those tables looks up the same KJT key's ids.

Tables of one storage dtype share a flat buffer and a single kernel launch. Outputs are fp32 (rows are
accumulated in fp32 whatever the storage dtype). Gradients reach the per-table parameters (dense, or sparse COO
rows with ``sparse=True``), so any torch optimizer can train them; see ``fused_embedding_modules`` for optimizers
that run inside the backward.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.embedding import (
    BoundsCheckMode,
    FusedOptimizerState,
    pooled_embedding_lookup,
    sequence_embedding_lookup,
    split_sequence_output,
)
from tritonrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    get_embedding_names,
    get_embedding_names_by_table,
)
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.table_batched import (
    TableBatchedCollection,
    TableGroup,
    build_groups,
    pooled_column_order,
    validate_tables,
)


def _embedding_bag_for(config: EmbeddingBagConfig, view: torch.Tensor) -> nn.EmbeddingBag:
    mode = "mean" if config.pooling == PoolingType.MEAN else "sum"
    return nn.EmbeddingBag(
        config.num_embeddings, config.embedding_dim, mode=mode, include_last_offset=True, _weight=view
    )


def _embedding_for(config: EmbeddingConfig, view: torch.Tensor) -> nn.Embedding:
    return nn.Embedding(config.num_embeddings, config.embedding_dim, _weight=view)


def _reset_tables(
    module: TableBatchedCollection, configs: list[EmbeddingBagConfig] | list[EmbeddingConfig], container: nn.ModuleDict
) -> None:
    """Re-draw each table's ``weight [num_embeddings, embedding_dim]`` in place with its config's ``init_fn``
    (torchrec's ``reset_parameters``); nothing to draw on ``meta``. Parameters stay views of the flat buffers."""
    if module.device.type == "meta":
        return
    module._ensure_packed()
    with torch.no_grad():
        for config in configs:
            weight = container[config.name].weight
            drawn = config.init_fn(weight)
            if drawn is not None and drawn is not weight:
                weight.copy_(drawn)


class EmbeddingBagCollection(TableBatchedCollection):
    """Pooled embeddings of several tables (see module docstring).

    Args:
        tables: one ``EmbeddingBagConfig`` per table; several features may share a table.
        is_weighted: pool with the KJT's weights as per-sample weights.
        device: where the tables live.
        sparse: give the parameters sparse COO gradients (only the touched rows) instead of dense ones.
        bounds_check: what an index outside its table does (``BoundsCheckMode.FATAL`` raises).
        backend: ``"auto"`` (Triton on CUDA, torch twin elsewhere), ``"triton"`` or ``"torch"``.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        sparse: bool = False,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
    ) -> None:
        super().__init__(bounds_check, backend)
        self._embedding_bag_configs = validate_tables(tables, EmbeddingBagConfig, type(self).__name__)
        self._is_weighted = bool(is_weighted)
        self._sparse = bool(sparse)
        self.embedding_bags = nn.ModuleDict()
        self._groups = build_groups(self._embedding_bag_configs, device, _embedding_bag_for, self.embedding_bags, True)
        self._embedding_names = get_embedding_names(self._embedding_bag_configs)
        self._lengths_per_embedding = [
            config.embedding_dim for config in self._embedding_bag_configs for _ in config.feature_names
        ]
        self._column_order = pooled_column_order(
            [(g.feature_names, g.layout.feature_dims) for g in self._groups], self._embedding_names
        )

    def _fused_state(self, group_index: int) -> FusedOptimizerState | None:
        return None

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features`` (KJT over at least this module's feature names) -> ``KeyedTensor`` ``[B, sum(D)]`` keyed by
        the embedding names."""
        if (leaf := fx_leaf_call(self, features)) is not None:
            return leaf  # type: ignore[return-value]
        self._ensure_packed()
        outputs = [self._lookup(features, i, group) for i, group in enumerate(self._groups)]
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values)

    def _lookup(self, features: KeyedJaggedTensor, group_index: int, group: TableGroup) -> torch.Tensor:
        inputs = self._group_inputs(features, group, self._is_weighted, need_value_offsets=False)
        return pooled_embedding_lookup(
            group.weights,
            group.layout,
            inputs.values,
            inputs.offsets,
            inputs.weights,
            table_weights=group.params,
            sparse_grad=self._sparse,
            fused=self._fused_state(group_index),
            bounds_check=self.bounds_check,
            backend=self.backend,
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def reset_parameters(self) -> None:
        """Re-initialise every table from its config's ``init_fn`` (torchrec's API; a no-op on ``meta``)."""
        _reset_tables(self, self._embedding_bag_configs, self.embedding_bags)

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._groups[0].weights.device


class EmbeddingCollection(TableBatchedCollection):
    """Sequence (unpooled) embeddings of several tables; tables may have different dims.

    Args as :class:`EmbeddingBagCollection` (no ``is_weighted``), plus ``need_indices``: also return each
    feature's indices as the output JaggedTensor's weights (torchrec's option).
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        sparse: bool = False,
        bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
        backend: Backend = "auto",
    ) -> None:
        super().__init__(bounds_check, backend)
        self._embedding_configs = validate_tables(tables, EmbeddingConfig, type(self).__name__)
        self._need_indices = bool(need_indices)
        self._sparse = bool(sparse)
        self.embeddings = nn.ModuleDict()
        self._groups = build_groups(self._embedding_configs, device, _embedding_for, self.embeddings, False)
        self._embedding_names = [n for names in self.embedding_names_by_table() for n in names]

    def _fused_state(self, group_index: int) -> FusedOptimizerState | None:
        return None

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """``features`` -> ``{embedding name: JaggedTensor(values [N_f, D_f], lengths of its feature)}`` in table
        order."""
        if (leaf := fx_leaf_call(self, features)) is not None:
            return leaf  # type: ignore[return-value]
        self._ensure_packed()
        result: dict[str, JaggedTensor] = {}
        for i, group in enumerate(self._groups):
            inputs = self._group_inputs(features, group, False)
            flat = sequence_embedding_lookup(
                group.weights,
                group.layout,
                inputs.values,
                inputs.value_offsets,
                table_weights=group.params,
                sparse_grad=self._sparse,
                fused=self._fused_state(i),
                bounds_check=self.bounds_check,
                backend=self.backend,
            )
            rows_per_feature = split_sequence_output(flat, group.layout, inputs.value_offsets)
            batch = features.stride()
            for f, (name, rows) in enumerate(zip(group.feature_names, rows_per_feature, strict=True)):
                span = slice(inputs.value_offsets[f], inputs.value_offsets[f + 1])
                result[name] = JaggedTensor(
                    values=rows,
                    lengths=inputs.lengths[f * batch : (f + 1) * batch],
                    weights=inputs.values[span] if self._need_indices else None,
                )
        return {name: result[name] for name in self._embedding_names}

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output (embedding) names, in config order (torchrec's API)."""
        return get_embedding_names_by_table(self._embedding_configs)

    def reset_parameters(self) -> None:
        """Re-initialise every table from its config's ``init_fn`` (torchrec's API; a no-op on ``meta``)."""
        _reset_tables(self, self._embedding_configs, self.embeddings)

    def embedding_dim(self) -> int:
        """The common dim when all tables share one (torchrec's API); raises when they differ."""
        dims = {c.embedding_dim for c in self._embedding_configs}
        if len(dims) != 1:
            raise ValueError(f"tables have different dims {sorted(dims)}; read each table's embedding_dim instead")
        return dims.pop()

    def need_indices(self) -> bool:
        return self._need_indices

    @property
    def device(self) -> torch.device:
        return self._groups[0].weights.device
