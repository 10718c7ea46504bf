"""Config -> objects: the data sources, the model (DLRM over a FusedEmbeddingBagCollection) and the dense optimizer.

Each builder does one thing, so the staged pipeline and sharding (later) can replace one piece: a sharded job builds
the same tables and wraps the collection, a pipelined job consumes the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tritonrec.data.criteo import CriteoTSVSource, resolve_num_embeddings
from tritonrec.data.criteo_npy import CriteoNPYSource
from tritonrec.data.elements import ElementSource, ElementSpec
from tritonrec.data.synthetic import SyntheticRecSource
from tritonrec.dist.train.config import (
    CriteoNPYDataConfig,
    CriteoTSVDataConfig,
    DLRMConfig,
    OptimConfig,
    SyntheticDataConfig,
)
from tritonrec.dist.train.config_checks import ARCHS, DENSE_OPTIMIZERS, MODEL_BACKENDS, sparse_optimizer_kwargs
from tritonrec.kernels.checks import check_int
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, PoolingType
from tritonrec.modules.dlrm import DLRM, DLRM_DCN, DLRMTrain

BACKENDS = MODEL_BACKENDS


@dataclass
class DataSources:
    """The training stream, the held-out stream (None when the data config names none) and what their samples
    look like."""

    train: ElementSource
    eval: ElementSource | None
    element_spec: ElementSpec
    num_embeddings: Mapping[str, int]


def _table_sizes(cfg: SyntheticDataConfig | CriteoTSVDataConfig | CriteoNPYDataConfig, num_features: int) -> list[int]:
    sizes = cfg.num_embeddings if cfg.num_embeddings_per_feature is None else list(cfg.num_embeddings_per_feature)
    try:
        return resolve_num_embeddings(sizes, num_features)
    except ValueError as error:
        raise ValueError(f"data.num_embeddings / data.num_embeddings_per_feature: {error}") from None


def build_data(cfg: object, rank: int = 0, world_size: int = 1) -> DataSources:
    """The sources named by a data config (synthetic, Criteo TSV or Criteo npy); with ``rank`` / ``world_size``,
    this rank's shard of the training and held-out streams."""
    shard = {"rank": rank, "world_size": world_size}
    if isinstance(cfg, SyntheticDataConfig):
        sizes = _table_sizes(cfg, cfg.num_sparse_features)
        common = dict(
            num_embeddings=sizes, num_dense=cfg.num_dense, zipf_alpha=cfg.zipf_alpha, pooling=cfg.pooling,
            pooling_factor=cfg.pooling_factor, min_pooling=cfg.min_pooling, max_pooling=cfg.max_pooling,
            seed=cfg.seed, signal_std=cfg.signal_std, dense_share=cfg.dense_share, **shard,
        )  # fmt: skip
        if cfg.chunk_size is not None:
            common["chunk_size"] = cfg.chunk_size
        try:
            train: ElementSource = SyntheticRecSource(**common, num_samples=cfg.num_samples, stream=0)
            eval_source: ElementSource | None = None
            if cfg.num_eval_samples > 0:
                eval_source = SyntheticRecSource(**common, num_samples=cfg.num_eval_samples, stream=1)
        except ValueError as error:  # the source names its argument; the user set it as data.<field>
            raise ValueError(f"data: {error}") from None
    elif isinstance(cfg, CriteoTSVDataConfig):
        sizes = _table_sizes(cfg, 26)
        train = CriteoTSVSource(list(cfg.paths), sizes, cfg.malformed, **shard)
        eval_source = CriteoTSVSource(list(cfg.eval_paths), sizes, cfg.malformed, **shard) if cfg.eval_paths else None
    elif isinstance(cfg, CriteoNPYDataConfig):
        probe = CriteoNPYSource(list(cfg.prefixes), 1)
        sizes = _table_sizes(cfg, len(probe.element_spec.sparse_keys))
        train = CriteoNPYSource(list(cfg.prefixes), sizes, **shard)
        eval_source = CriteoNPYSource(list(cfg.eval_prefixes), sizes, **shard) if cfg.eval_prefixes else None
    else:
        raise TypeError(
            f"data must be a SyntheticDataConfig, CriteoTSVDataConfig or CriteoNPYDataConfig, got {type(cfg).__name__}"
        )
    return DataSources(train, eval_source, train.element_spec, train.num_embeddings)


def build_tables(num_embeddings: Mapping[str, int], cfg: DLRMConfig) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, named ``t_<feature>`` (torchrec's DLRM example naming)."""
    if cfg.pooling not in ("SUM", "MEAN"):
        raise ValueError(f"model.pooling must be 'SUM' or 'MEAN', got {cfg.pooling!r}")
    check_int(cfg.embedding_dim, "model.embedding_dim", 1)
    return [
        EmbeddingBagConfig(
            num_embeddings=rows,
            embedding_dim=cfg.embedding_dim,
            name=f"t_{feature}",
            feature_names=[feature],
            pooling=PoolingType[cfg.pooling],
        )
        for feature, rows in num_embeddings.items()
    ]


def build_model(
    cfg: DLRMConfig,
    sources: DataSources,
    optim: OptimConfig,
    device: torch.device | str = "cpu",
) -> DLRMTrain:
    """DLRMTrain over a FusedEmbeddingBagCollection whose tables update with ``optim.sparse`` in the backward."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"model.arch must be one of {ARCHS}, got {cfg.arch!r}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"model.backend must be one of {BACKENDS}, got {cfg.backend!r}")
    tables = build_tables(sources.num_embeddings, cfg)  # outside the try: its errors name model fields
    try:
        collection = FusedEmbeddingBagCollection(
            tables, optim.sparse, sparse_optimizer_kwargs(optim), device=device, backend=cfg.backend
        )
    except ValueError as error:
        raise ValueError(f"optim.sparse / optim.sparse_kwargs: {error}") from None
    layers = dict(
        embedding_bag_collection=collection,
        dense_in_features=sources.element_spec.dense_dim,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
        dense_device=device,
    )
    try:
        if cfg.arch == "dlrm":
            dlrm: DLRM = DLRM(**layers)
        else:
            dlrm = DLRM_DCN(**layers, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim)
    except ValueError as error:
        raise ValueError(f"model: {error}") from None
    return DLRMTrain(dlrm)


def embedding_collection(model: DLRMTrain) -> FusedEmbeddingBagCollection:
    """The fused collection inside a model from :func:`build_model`."""
    return model.model.sparse_arch.embedding_bag_collection


def dense_parameters(model: nn.Module, collection: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``model`` outside ``collection`` (the tables update in the backward, not in step())."""
    table_params = {id(p) for p in collection.parameters()}
    return [p for p in model.parameters() if id(p) not in table_params]


def build_dense_optimizer(model: DLRMTrain, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The torch optimizer of the dense parameters."""
    if cfg.dense not in DENSE_OPTIMIZERS:
        raise ValueError(f"optim.dense must be one of {sorted(DENSE_OPTIMIZERS)}, got {cfg.dense!r}")
    if not cfg.dense_lr > 0:
        raise ValueError(f"optim.dense_lr must be positive, got {cfg.dense_lr!r}")
    params = dense_parameters(model, embedding_collection(model))
    try:
        return DENSE_OPTIMIZERS[cfg.dense](params, lr=cfg.dense_lr, **dict(cfg.dense_kwargs))
    except TypeError as error:
        raise TypeError(
            f"optim.dense_kwargs={dict(cfg.dense_kwargs)!r} do not fit optim.dense={cfg.dense!r}: {error}"
        ) from None
