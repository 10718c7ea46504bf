"""Typed configs of the distributed side of the training job: how many processes (``dist``), how the tables are
sharded (``sharding/``), which train pipeline runs the steps (``pipeline/``), the wire precision of the embedding
collectives (``qcomm/``) and where the step series go (``logger/``). Each is a field of
:class:`~tritonrec.dist.train.config.TrainConfig`; the groups' YAML files extend the schemas registered here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from tritonrec.kernels.checks import check_int

SHARDING_KINDS = ("auto", "tw", "rw", "cw", "twrw", "dp")
PIPELINE_KINDS = ("base", "sparse_dist", "staged", "semi_sync")
QCOMM_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "mx4")
LOGGER_KINDS = ("none", "csv", "tensorboard")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class DistConfig:
    """Processes of the job. ``nproc=1`` is the single-process job; ``nproc=N`` spawns N local ranks itself, or,
    under ``torchrun --nproc_per_node N``, checks that torchrun started N (torchrun alone decides otherwise)."""

    nproc: int = 1
    backend: str = "auto"  # "auto": nccl on CUDA, gloo on CPU
    timeout_s: int = 600  # process-group timeout: a rank stuck this long in a collective fails the job


@dataclass
class ShardingConfig:
    """How the embedding tables are placed over the ranks."""

    kind: str = "auto"  # auto (the planner), tw (table-wise, round robin), rw, cw (every rank a column block), twrw, dp


@dataclass
class PipelineConfig:
    """The train pipeline of the distributed job (tritonrec.dist.train_pipeline)."""

    kind: str = "sparse_dist"  # base, sparse_dist (input dist of batch i+1 during batch i), staged, semi_sync
    host_prefetch: int = 2  # host batches a background thread produces ahead (0: none)
    # semi_sync only (TrainPipelineSemiSync): the steps before start_batch train synchronously (torchrec's default
    # 900), the later ones look up batch i+1's embeddings before batch i's update (one step stale)
    start_batch: int = 900
    stash_gradients: bool = False  # semi_sync only: from start_batch on, the dense update applies a step late


@dataclass
class QCommConfig:
    """Wire precision of the embedding collectives (QCommsConfig): fp32 (none), fp16, bf16, fp8, int8, mx4."""

    forward: str = "fp32"
    backward: str = "fp32"


@dataclass
class LoggerConfig:
    """Where the step, eval and throughput series go besides metrics.json: none, csv (``series.csv`` in the output
    folder) or tensorboard (``tensorboard/`` event files; needs the ``tensorboard`` extra)."""

    kind: str = "none"


def register_job_configs(store: ConfigStore) -> None:
    store.store(group="sharding", name="sharding_schema", node=ShardingConfig)
    store.store(group="pipeline", name="pipeline_schema", node=PipelineConfig)
    store.store(group="qcomm", name="qcomm_schema", node=QCommConfig)
    store.store(group="logger", name="logger_schema", node=LoggerConfig)


def _one_of(value: object, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {name}={value!r}")


def _int_at_least(value: object, minimum: int, name: str) -> None:
    check_int(value, name, minimum, what=f"an int >= {minimum}")


def check_semi_sync_options(pipeline: PipelineConfig) -> None:
    """``start_batch`` a non-negative int and ``stash_gradients`` a bool, changed from their defaults only under
    ``pipeline=semi_sync`` (no other pipeline reads them: a silently ignored option would hide a mistake)."""
    _int_at_least(pipeline.start_batch, 0, "pipeline.start_batch")
    if not isinstance(pipeline.stash_gradients, bool):
        raise TypeError(f"pipeline.stash_gradients must be a bool, got pipeline.stash_gradients="
                        f"{pipeline.stash_gradients!r}")  # fmt: skip
    if pipeline.kind == "semi_sync":
        return
    for name in ("start_batch", "stash_gradients"):
        value = getattr(pipeline, name)
        if value != getattr(PipelineConfig, name):
            raise ValueError(
                f"pipeline.{name}={value!r} applies to pipeline=semi_sync only, and pipeline.kind="
                f"{pipeline.kind!r}: choose pipeline=semi_sync, or leave pipeline.{name} at its default "
                f"{getattr(PipelineConfig, name)!r}"
            )


def check_job_configs(dist: DistConfig, sharding: ShardingConfig, pipeline: PipelineConfig, qcomm: QCommConfig,
                      logger: LoggerConfig) -> None:  # fmt: skip
    """Every field of the distributed configs, named in the error (before any output folder is made)."""
    _int_at_least(dist.nproc, 1, "dist.nproc")
    _int_at_least(dist.timeout_s, 1, "dist.timeout_s")
    _one_of(dist.backend, BACKENDS, "dist.backend")
    _one_of(sharding.kind, SHARDING_KINDS, "sharding.kind")
    _one_of(pipeline.kind, PIPELINE_KINDS, "pipeline.kind")
    _int_at_least(pipeline.host_prefetch, 0, "pipeline.host_prefetch")
    check_semi_sync_options(pipeline)
    _one_of(qcomm.forward, QCOMM_PRECISIONS, "qcomm.forward")
    _one_of(qcomm.backward, QCOMM_PRECISIONS, "qcomm.backward")
    _one_of(logger.kind, LOGGER_KINDS, "logger.kind")


def distributed_only_choices(
    dist: DistConfig, sharding: ShardingConfig, pipeline: PipelineConfig, qcomm: QCommConfig
) -> list[str]:
    """The settings, changed from their defaults, that only the distributed job reads (e.g. ``["sharding=rw",
    "qcomm=int8/int8"]``), for the one-process job to say it does not apply them. Empty with ``dist.nproc > 1``."""
    if dist.nproc > 1:
        return []
    chosen = []
    if sharding.kind != ShardingConfig.kind:
        chosen.append(f"sharding={sharding.kind}")
    if any(getattr(pipeline, f.name) != f.default for f in dataclasses.fields(PipelineConfig)):
        chosen.append(f"pipeline={pipeline.kind}")
    if (qcomm.forward, qcomm.backward) != (QCommConfig.forward, QCommConfig.backward):
        chosen.append(f"qcomm={qcomm.forward}/{qcomm.backward}")
    return chosen


__all__ = [
    "DistConfig",
    "LoggerConfig",
    "PipelineConfig",
    "QCommConfig",
    "ShardingConfig",
    "check_job_configs",
    "check_semi_sync_options",
    "distributed_only_choices",
    "register_job_configs",
]
