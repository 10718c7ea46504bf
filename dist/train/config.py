"""Typed configs of the training job, one dataclass per component, registered in hydra's ConfigStore.

The YAML files under ``configs/`` pick a schema through their defaults list (``configs/model/dlrm_small.yaml`` starts
from ``model/dlrm_schema``), so hydra type-checks every value and rejects unknown keys when composing. The groups:

* ``model/``: :class:`DLRMConfig` (``dlrm_small``, ``dlrm_dcn``);
* ``data/``: :class:`SyntheticDataConfig`, :class:`CriteoTSVDataConfig`, :class:`CriteoNPYDataConfig`;
* ``optim/``: :class:`OptimConfig` (``adagrad``, ``adam``, ``sgd``);
* ``sharding/``, ``pipeline/``, ``qcomm/``, ``logger/`` and the ``dist`` field: :mod:`.job_config`;
* ``experiment/``: global overrides naming one combination of the above plus its schedule.

``run(cfg)`` (:mod:`tritonrec.dist.train.run`, wrapped by ``scripts/train.py``) accepts a composed DictConfig or a
:class:`TrainConfig` built in Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from tritonrec.dist.train.config_checks import (
    check_data,
    check_model,
    check_optim,
    check_top_level,
    reject_unknown_keys,
)
from tritonrec.dist.train.job_config import (
    DistConfig,
    LoggerConfig,
    PipelineConfig,
    QCommConfig,
    ShardingConfig,
    check_job_configs,
    register_job_configs,
)
from tritonrec.kernels.checks import check_int


@dataclass
class DLRMConfig:
    """The model: a DLRM over one fused embedding table per sparse feature."""

    arch: str = "dlrm"  # "dlrm" (dot-product interaction) or "dlrm_dcn" (low-rank DCNv2 interaction)
    embedding_dim: int = 16  # D, shared by every table
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])  # must end with embedding_dim
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 32, 1])  # last entry 1: one logit
    dcn_num_layers: int = 3  # cross layers (dlrm_dcn only)
    dcn_low_rank_dim: int = 16  # rank of each cross layer's weight (dlrm_dcn only)
    pooling: str = "SUM"  # bag pooling of every table: "SUM" or "MEAN"
    backend: str = "auto"  # embedding kernels: "auto" (Triton on CUDA, torch twin on CPU), "triton" or "torch"


@dataclass
class SyntheticDataConfig:
    """Seeded synthetic stream (tritonrec.data.synthetic): Zipf ids, labels from a hidden logistic model."""

    kind: str = "synthetic"
    num_sparse_features: int = 26  # F
    num_embeddings: int = 5_000  # id range (table rows) of every sparse feature ...
    num_embeddings_per_feature: list[int] | None = None  # ... or one per feature (overrides the two fields above)
    num_dense: int = 13  # Dd
    zipf_alpha: float = 1.1  # id skew: P(rank r) ~ (r + 1) ** -zipf_alpha
    pooling: str = "poisson"  # bag length distribution: "fixed", "poisson" or "uniform"
    pooling_factor: float = 1.0  # mean bag length
    min_pooling: int = 0  # bag length bounds of "poisson" / "uniform" (0 allows empty bags)
    max_pooling: int = 8
    num_samples: int | None = None  # training stream length; None streams forever (no epochs)
    num_eval_samples: int = 16_384  # held-out samples (an independent stream of the same hidden model)
    signal_std: float = 2.0  # std of the hidden logit: larger is easier to learn
    dense_share: float = 0.25  # share of the hidden logit's variance carried by dense features
    seed: int = 0  # fixes the hidden model and the samples
    chunk_size: int | None = None  # samples per generated chunk; None: 4096 in one process, the per-rank batch size
    # across ranks (rank r of W draws chunks r, r + W, ...: see tritonrec.dist.train.distributed)


@dataclass
class CriteoTSVDataConfig:
    """Raw Criteo TSV files (tritonrec.data.criteo): label, 13 counts, 26 hex ids per line."""

    kind: str = "criteo_tsv"
    paths: list[str] = MISSING  # training files, read in order (.gz allowed)
    eval_paths: list[str] = field(default_factory=list)  # held-out files; empty: no held-out evaluation
    num_embeddings: int = 100_000  # hash size of every categorical feature ...
    num_embeddings_per_feature: list[int] | None = None  # ... or 26 sizes
    malformed: str = "error"  # malformed lines: "error" (stop, naming file and line) or "skip" (count them)


@dataclass
class CriteoNPYDataConfig:
    """Preprocessed Criteo days (tritonrec.data.criteo_npy): ``{prefix}_dense.npy`` and ``_labels.npy``, with the ids
    key-major and hashed (``_ids``, ``_id_lengths``, ``_id_index``, ``_num_embeddings``, as ``criteo_tsv_to_npy(...,
    num_embeddings=...)`` writes them) or in torchrec's rows layout (``_sparse``, raw ids hashed per read)."""

    kind: str = "criteo_npy"
    prefixes: list[str] = MISSING  # training days, read in order
    eval_prefixes: list[str] = field(default_factory=list)  # held-out days; empty: no held-out evaluation
    num_embeddings: int = 100_000  # hash size of every categorical feature ...
    num_embeddings_per_feature: list[int] | None = None  # ... or one size per feature


@dataclass
class OptimConfig:
    """Optimizers: a fused one for the embedding tables (runs inside the backward) and a torch one for the rest."""

    sparse: str = "EXACT_ROWWISE_ADAGRAD"  # fused rule: EXACT_SGD, EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD or ADAM
    sparse_lr: float = 0.05
    sparse_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. eps, weight_decay, betas
    dense: str = "adagrad"  # torch.optim rule of the dense parameters: "adagrad", "adam" or "sgd"
    dense_lr: float = 0.05
    dense_kwargs: dict[str, Any] = field(default_factory=dict)  # extra torch.optim arguments


@dataclass
class TrainConfig:
    """The job: what to train on what, for how long, and where results go."""

    model: DLRMConfig = field(default_factory=DLRMConfig)
    data: Any = MISSING  # one of the data configs above, chosen by the data/ group
    optim: OptimConfig = field(default_factory=OptimConfig)
    name: str = "train"  # experiment name, recorded in metrics.json
    steps: int = 400  # optimizer steps (one batch each)
    batch_size: int = 512  # per rank in a distributed job
    drop_remainder: bool = False  # drop an epoch's short last batch instead of padding and masking it
    eval_every: int = 100  # steps between held-out evaluations (0: only after the last step)
    eval_batch_size: int = 4096
    log_every: int = 20  # steps between progress-bar updates (loss, AUROC, NE, samples/s)
    # samples in the running training AUROC (scored before their update) and window NE (the latest whole steps
    # within it, at least one: torchrec's NE window drops whole batches)
    train_auroc_window: int = 8192
    checkpoint_every: int = 0  # steps between checkpoints (0: only after the last step)
    resume: str | None = None  # checkpoint to resume from: a step_*.pt file (one process) or step_*/ folder (ranks)
    seed: int = 0  # torch seed: model initialisation
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    num_threads: int = 0  # torch intra-op threads while the job runs; 0 keeps torch's default
    output_dir: str | None = None  # where results go; the hydra run dir under scripts/train.py
    progress: bool = True  # show the tqdm bar
    plot: bool = True  # write curves.png (needs matplotlib, the "plot" extra)
    dist: DistConfig = field(default_factory=DistConfig)  # processes: dist.nproc=2 spawns 2 ranks
    sharding: ShardingConfig = field(default_factory=ShardingConfig)  # sharding/ group (distributed job)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # pipeline/ group (distributed job)
    qcomm: QCommConfig = field(default_factory=QCommConfig)  # qcomm/ group (distributed job)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # logger/ group


DATA_CONFIGS: dict[str, type] = {
    "synthetic": SyntheticDataConfig,
    "criteo_tsv": CriteoTSVDataConfig,
    "criteo_npy": CriteoNPYDataConfig,
}


def register_configs() -> None:
    """Store the schemas that the YAML files under ``configs/`` extend (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(group="model", name="dlrm_schema", node=DLRMConfig)
    store.store(group="optim", name="optim_schema", node=OptimConfig)
    for kind, node in DATA_CONFIGS.items():
        store.store(group="data", name=f"{kind}_schema", node=node)
    register_job_configs(store)


_POSITIVE_FIELDS = ("steps", "batch_size", "eval_batch_size", "log_every", "train_auroc_window")
_NON_NEGATIVE_FIELDS = ("eval_every", "checkpoint_every", "seed", "num_threads")


def as_train_config(cfg: object) -> TrainConfig:
    """A composed DictConfig or a TrainConfig -> a checked :class:`TrainConfig` whose ``data`` is one of the data
    dataclasses (a plain mapping is accepted too and typed by its ``kind``). Every field is checked here, once, before
    any folder is made or rank spawned (:mod:`.config_checks`)."""
    if isinstance(cfg, DictConfig):
        reject_unknown_keys(cfg)
        cfg = OmegaConf.to_object(cfg)
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig or a composed DictConfig, got {type(cfg).__name__}")
    if isinstance(cfg.data, str) and cfg.data == MISSING:
        raise ValueError(
            "data is missing: pick a data config, e.g. `data=synthetic` on the command line (the files in "
            "configs/data/), or TrainConfig(data=SyntheticDataConfig(...)) in Python"
        )
    if isinstance(cfg.data, Mapping):
        kind = cfg.data.get("kind")
        if kind not in DATA_CONFIGS:
            raise ValueError(f"data.kind must be one of {sorted(DATA_CONFIGS)}, got {kind!r}")
        fields = {f.name for f in dataclasses.fields(DATA_CONFIGS[kind])}
        unknown = sorted(str(k) for k in cfg.data if k not in fields)
        if unknown:
            raise ValueError(f"unknown data field(s) {unknown} for data.kind={kind!r}; its fields are {sorted(fields)}")
        cfg.data = DATA_CONFIGS[kind](**cfg.data)
    if not isinstance(cfg.data, tuple(DATA_CONFIGS.values())):
        raise TypeError(f"data must be one of the data configs {sorted(DATA_CONFIGS)}, got {type(cfg.data).__name__}")
    for name in _POSITIVE_FIELDS:
        setattr(cfg, name, check_int(getattr(cfg, name), name, 1))
    for name in _NON_NEGATIVE_FIELDS:
        setattr(cfg, name, check_int(getattr(cfg, name), name, 0))
    check_top_level(cfg)
    check_device(cfg.device)
    check_job_configs(cfg.dist, cfg.sharding, cfg.pipeline, cfg.qcomm, cfg.logger)
    check_data(cfg.data)
    check_model(cfg.model)
    check_optim(cfg.optim)
    return cfg


def check_device(name: object) -> torch.device:
    """``TrainConfig.device`` as a torch device this machine has (a CUDA device needs CUDA, and its index a GPU)."""
    try:
        device = torch.device(name)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), got device={name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={name!r} needs CUDA, which this torch ({torch.__version__}) cannot use on this machine: set "
                "device=cpu (the `device` field of TrainConfig, or `device=cpu` on the command line)"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device={name!r} but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}): set "
                "device to one of them"
            )
    return device
