"""Training utilities of the hydra-configured jobs: typed configs (:mod:`.config`), config -> objects
(:mod:`.builders`), the train step, evaluation and history (:mod:`.loop`), AUROC (:mod:`.metrics`), NE through
``tritonrec.metrics`` (:mod:`.ne`), checkpoints (:mod:`.checkpoint`) and result files (:mod:`.report`), wired into
the job ``run(cfg)`` (:mod:`.run`: one process, torchrun ranks or spawned ranks; :mod:`.single`,
:mod:`.distributed`). ``scripts/train.py`` wraps ``run`` in hydra."""

from tritonrec.dist.train.builders import DataSources, build_data, build_dense_optimizer, build_model, build_tables
from tritonrec.dist.train.checkpoint import load_checkpoint, save_checkpoint
from tritonrec.dist.train.config import (
    CriteoNPYDataConfig,
    CriteoTSVDataConfig,
    DLRMConfig,
    OptimConfig,
    SyntheticDataConfig,
    TrainConfig,
    as_train_config,
    register_configs,
)
from tritonrec.dist.train.loop import TrainHistory, evaluate, iterate_batches, train_step
from tritonrec.dist.train.metrics import AUROCMetric, auroc
from tritonrec.dist.train.run import run

__all__ = [
    "AUROCMetric",
    "CriteoNPYDataConfig",
    "CriteoTSVDataConfig",
    "DLRMConfig",
    "DataSources",
    "OptimConfig",
    "SyntheticDataConfig",
    "TrainConfig",
    "TrainHistory",
    "as_train_config",
    "auroc",
    "build_data",
    "build_dense_optimizer",
    "build_model",
    "build_tables",
    "evaluate",
    "iterate_batches",
    "load_checkpoint",
    "register_configs",
    "run",
    "save_checkpoint",
    "train_step",
]
