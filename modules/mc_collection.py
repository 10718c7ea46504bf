"""``ManagedCollisionCollection`` (torchrec's): one managed-collision module per table, remapping a KJT's raw ids
to table rows before an embedding lookup. Re-exported by :mod:`tritonrec.modules.mc_modules` (torchrec's path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.kernels.checks import check_tensor
from tritonrec.modules.embedding_configs import BaseEmbeddingConfig
from tritonrec.modules.fx_leaf import fx_leaf_call
from tritonrec.modules.mc_base import ManagedCollisionModule


class ManagedCollisionCollection(nn.Module):
    """One managed-collision module per table; remaps a KJT's ids before an embedding lookup.

    Args:
        managed_collision_modules: ``{table name: ManagedCollisionModule}``, one per config.
        embedding_configs: the tables (their ``num_embeddings`` must equal the module's ``output_size()``); a
            table's features are remapped together by its module.
        need_preprocess: kept for torchrec's API.

    ``forward(kjt) -> kjt`` keyed by the configs' feature names in config order (other keys are dropped, as in
    torchrec), lengths/weights/strides unchanged, values replaced by rows.
    """

    def __init__(
        self,
        managed_collision_modules: dict[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
        need_preprocess: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(managed_collision_modules, dict):
            raise TypeError(f"managed_collision_modules must be a dict, got {type(managed_collision_modules).__name__}")
        for table, module in managed_collision_modules.items():
            if not isinstance(module, ManagedCollisionModule):
                raise TypeError(
                    f"managed_collision_modules[{table!r}] must be a ManagedCollisionModule, "
                    f"got {type(module).__name__}"
                )
        configs = list(embedding_configs)
        for config in configs:
            if not isinstance(config, BaseEmbeddingConfig):
                raise TypeError(f"embedding_configs must hold embedding configs, got {type(config).__name__}")
            if config.name not in managed_collision_modules:
                raise ValueError(f"table {config.name!r} is not present in managed_collision_modules")
            if managed_collision_modules[config.name].output_size() != config.num_embeddings:
                raise ValueError(
                    f"table {config.name!r}: managed collision module output_size() "
                    f"{managed_collision_modules[config.name].output_size()} != num_embeddings {config.num_embeddings}"
                )
        extra = sorted(set(managed_collision_modules) - {config.name for config in configs})
        if extra:
            raise ValueError(f"managed_collision_modules has tables without an embedding config: {extra}")
        self._feature_names = [feature for config in configs for feature in config.feature_names]
        if len(set(self._feature_names)) != len(self._feature_names):
            raise ValueError(f"a feature may feed one managed-collision table only, got {self._feature_names}")
        self._managed_collision_modules = nn.ModuleDict(managed_collision_modules)
        self._embedding_configs = embedding_configs
        self.need_preprocess = need_preprocess
        self._table_to_features = {config.name: list(config.feature_names) for config in configs}
        self._feature_to_table = {f: t for t, features in self._table_to_features.items() for f in features}
        self._table_feature_splits = [len(features) for features in self._table_to_features.values()]

    def embedding_configs(self) -> Sequence[BaseEmbeddingConfig]:
        return self._embedding_configs

    def table_to_number_buckets(self) -> dict[str, int]:
        return {table: module.buckets() for table, module in self._managed_collision_modules.items()}

    def forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
        """Raw-id KJT -> row KJT (see the class docstring). The features are gathered per key (views, no permute
        kernel) in config order; each table's features go through its module as one id stream."""
        if (leaf := fx_leaf_call(self, features, mutate_miss_lengths)) is not None:
            return leaf  # type: ignore[return-value]
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        check_tensor(features.values(), "features.values()", ndim=1, integer=True)
        keys = features.keys()
        missing = [f for f in self._feature_names if f not in keys]
        if missing:
            raise ValueError(f"features is missing the managed-collision feature(s) {missing}; it has keys {keys}")
        per_feature = {f: features[f] for f in self._feature_names}
        remapped: list[torch.Tensor] = []
        remapped_lengths: list[torch.Tensor] = []  # a module may drop ids (hash ZCH with disable_fallback)
        weighted = features.weights_or_none() is not None
        remapped_weights: list[torch.Tensor] = []  # the module sees the weights, so it can keep them aligned
        for table, table_features in self._table_to_features.items():
            parts = [per_feature[f] for f in table_features]
            ids = JaggedTensor(
                values=torch.cat([p.values() for p in parts]),
                lengths=torch.cat([p.lengths() for p in parts]),
                weights=torch.cat([p.weights() for p in parts]) if weighted else None,
            )
            module = self._managed_collision_modules[table]
            if getattr(module, "_per_feature", False) and len({p.lengths().numel() for p in parts}) > 1:
                raise ValueError(
                    f"table {table!r}: PER_FEATURE_TTL_EVICTION tells a table's features apart by equal blocks of "
                    f"bags, but its features {table_features} have {[p.lengths().numel() for p in parts]} bags "
                    "(a variable batch per feature): give them one batch size"
                )
            out = module({table: ids}, mutate_miss_lengths=mutate_miss_lengths)[table]
            remapped.append(out.values())
            remapped_lengths.append(out.lengths())
            if weighted:
                remapped_weights.append(out.weights())
        weights = (torch.cat(remapped_weights) if remapped_weights else features.weights()[:0]) if weighted else None
        strides = features.stride_per_key_per_rank()
        inverse = features.inverse_indices_or_none()
        if inverse is not None:  # keep the rows of the keys that remain
            rows = [i for i, k in enumerate(inverse[0]) if k in per_feature]
            inverse = ([inverse[0][i] for i in rows], inverse[1][rows])
        return KeyedJaggedTensor(
            keys=self._feature_names,
            values=torch.cat(remapped) if remapped else features.values()[:0],
            lengths=torch.cat(remapped_lengths) if remapped_lengths else features.lengths()[:0],
            weights=weights,
            stride=features.stride(),
            stride_per_key_per_rank=[strides[keys.index(f)] for f in self._feature_names] if strides else None,
            inverse_indices=inverse,
        )

    def evict(self) -> dict[str, torch.Tensor | None]:
        return {table: module.evict() for table, module in self._managed_collision_modules.items()}

    def open_slots(self) -> dict[str, torch.Tensor]:
        return {table: module.open_slots() for table, module in self._managed_collision_modules.items()}
