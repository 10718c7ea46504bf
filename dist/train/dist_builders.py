"""Config -> objects for the distributed job: the model sharded by DistributedModelParallel under the configured
plan and comm codecs, its dense optimizer, and a step runner over the configured train pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.dist.comm import get_local_size
from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
from tritonrec.dist.model_parallel import DistributedModelParallel
from tritonrec.dist.qcomm_codec import CommType
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs_registry
from tritonrec.dist.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from tritonrec.dist.train.builders import DENSE_OPTIMIZERS
from tritonrec.dist.train.config import OptimConfig, TrainConfig
from tritonrec.dist.train.job_config import PIPELINE_KINDS, PipelineConfig
from tritonrec.dist.train_pipeline import (
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)
from tritonrec.dist.train_pipeline.pipelines import backward
from tritonrec.dist.train_pipeline.utils import new_stream, to_device
from tritonrec.dist.types import ShardingEnv, ShardingPlan
from tritonrec.optim.keyed import in_backward_optimizer_filter

EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # where build_model puts the tables in DLRMTrain


def _table_generators(kind: str, tables: list[str], world: int, local: int) -> dict[str, Any]:
    if kind == "tw":
        return {t: table_wise(rank=i % world) for i, t in enumerate(tables)}
    if kind == "rw":
        return {t: row_wise() for t in tables}
    if kind == "cw":
        return {t: column_wise(ranks=list(range(world))) for t in tables}
    if kind == "twrw":
        hosts = world // local
        return {t: table_row_wise(host_index=i % hosts) for i, t in enumerate(tables)}
    if kind == "dp":
        return {t: data_parallel(compute_kernel="fused") for t in tables}
    raise ValueError(f"sharding.kind={kind!r} has no hand-written plan")


def check_column_wise(embedding_dims: set[int], world: int) -> None:
    """``sharding=cw`` gives each of the ``world`` ranks an equal column block: every dim must divide evenly (also
    checked before a distributed job spawns its ranks, from ``model.embedding_dim``)."""
    uneven = sorted(d for d in embedding_dims if d % world)
    if uneven:
        raise ValueError(
            f"sharding=cw gives every one of the {world} ranks an equal column block of each table, but "
            f"embedding_dim {uneven} is not divisible by {world}: use a world size dividing it, a "
            "model.embedding_dim divisible by the world size, or sharding=auto"
        )


def build_plan(model: nn.Module, cfg: TrainConfig, sharder: EmbeddingBagCollectionSharder, device: torch.device,
               env: ShardingEnv) -> ShardingPlan:  # fmt: skip
    """The plan ``cfg.sharding.kind`` names: the planner's (``auto``, identical on every rank) or one sharding type
    for every table."""
    ebc = model.get_submodule(EBC_PATH)
    world, local = env.world_size, get_local_size(env.world_size)
    if cfg.sharding.kind == "auto":
        from tritonrec.dist.planner import EmbeddingShardingPlanner, Topology

        topology = Topology(world, compute_device=device.type, local_world_size=local)
        planner = EmbeddingShardingPlanner(topology, batch_size=cfg.batch_size)
        if env.process_group is None:
            return planner.plan(model, [sharder])
        return planner.collective_plan(model, [sharder], env.process_group)
    configs = ebc.embedding_bag_configs()
    if cfg.sharding.kind == "cw":
        check_column_wise({c.embedding_dim for c in configs}, world)
    tables = [c.name for c in configs]
    generators = _table_generators(cfg.sharding.kind, tables, world, local)
    module_plan = construct_module_sharding_plan(ebc, generators, sharder, local, world, device.type)
    return ShardingPlan({EBC_PATH: module_plan})


def build_sharded_model(model: nn.Module, cfg: TrainConfig, device: torch.device) -> DistributedModelParallel:
    """``model`` (a DLRMTrain from build_model, on the CPU) sharded over the world by ``cfg.sharding``, with
    ``cfg.qcomm`` codecs on the embedding collectives and DDP over the dense layers."""
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    forward, backward_ = CommType(cfg.qcomm.forward), CommType(cfg.qcomm.backward)
    qcomms = QCommsConfig(forward_precision=forward, backward_precision=backward_)
    registry = get_qcomm_codecs_registry(qcomms, rank=env.rank)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    plan = build_plan(model, cfg, sharder, device, env)
    return DistributedModelParallel(model, env=env, device=device, plan=plan, sharders=[sharder])


def qcomm_unused(cfg: TrainConfig, plan: ShardingPlan) -> bool:
    """True when ``cfg.qcomm`` asks for a wire precision but no embedding collective would carry it: every table
    of ``plan`` is data-parallel (its lookups stay on the rank; its gradients are all-reduced in fp32)."""
    if (cfg.qcomm.forward, cfg.qcomm.backward) == ("fp32", "fp32"):
        return False
    shardings = [p for module in plan.plan.values() if isinstance(module, dict) for p in module.values()]
    return bool(shardings) and all(p.sharding_type == "data_parallel" for p in shardings)


def build_sharded_dense_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The torch optimizer of every parameter not updated inside the backward (the fused tables are)."""
    params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return DENSE_OPTIMIZERS[cfg.dense](params, lr=cfg.dense_lr, **dict(cfg.dense_kwargs))


class StepRunner:
    """One training step per :meth:`step` through the configured pipeline: ``base``, ``sparse_dist``, ``staged`` (a
    data-copy stage and the sparse input-dist stage; the forward, backward and optimizer step run here) or
    ``semi_sync``. :meth:`pause` gives the model its own forward back (evaluation between steps); the next step
    resumes.

    ``trained_steps``: the steps the job trained before this runner (a resume, or a restart after a checkpoint), so
    ``pipeline.start_batch`` counts the job's steps, not the runner's.
    """

    def __init__(self, pipeline: PipelineConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, trained_steps: int = 0) -> None:  # fmt: skip
        kind, host_prefetch = pipeline.kind, pipeline.host_prefetch
        self.kind = kind
        self._model, self._optimizer = model, optimizer
        self._sdd: SparseDataDistUtil | None = None
        self._seen_pipelined: list[str] = []
        self._pipeline: Any
        if kind == "base":
            self._pipeline = TrainPipelineBase(model, optimizer, device, host_prefetch=host_prefetch)
        elif kind == "sparse_dist":
            self._pipeline = TrainPipelineSparseDist(model, optimizer, device, host_prefetch=host_prefetch)
        elif kind == "semi_sync":
            start_batch = max(0, pipeline.start_batch - trained_steps)  # the pipeline counts its batches from 0
            self._pipeline = TrainPipelineSemiSync(model, optimizer, device, start_batch=start_batch,
                                                   stash_gradients=pipeline.stash_gradients, strict=True,
                                                   host_prefetch=host_prefetch)  # fmt: skip
        elif kind == "staged":
            self._sdd = SparseDataDistUtil(model, new_stream(device))
            copy_stream = new_stream(device)
            self._pipeline = StagedTrainPipeline([
                PipelineStage("data_copy", lambda batch: to_device(batch, device), copy_stream),
                PipelineStage("start_sparse_data_dist", self._sdd.start_sparse_data_dist, self._sdd.data_dist_stream,
                              fill_callback=self._sdd.wait_sdd_fill_callback),
            ], host_prefetch=host_prefetch)  # fmt: skip
        else:
            raise ValueError(f"pipeline.kind must be one of {list(PIPELINE_KINDS)}, got pipeline.kind={kind!r}")

    @property
    def restarts_at_checkpoint(self) -> bool:
        """Whether the job replaces this runner after each checkpoint (see :meth:`drain`): semi-sync's batch in
        flight holds a lookup of the tables before the step's update, which no checkpoint holds, so a resumed job
        could not look it up again; the job restarts the pipeline at every checkpoint instead, as a resume does."""
        return self.kind == "semi_sync"

    def step(self, batches: Iterator[Any]) -> Any:
        """Train one batch; returns the model's output ``(loss, logits, labels)``; StopIteration at the data's end."""
        if self._sdd is None:
            output = self._pipeline.progress(batches)
            self._seen_pipelined = self._seen_pipelined or list(getattr(self._pipeline, "pipelined_modules", []))
            return output
        self._sdd.attach()
        batch = self._pipeline.progress(batches)
        if batch is None:
            raise StopIteration
        self._model.train()
        self._optimizer.zero_grad()
        losses, output = self._model(batch)
        backward(losses)
        self._optimizer.step()
        self._seen_pipelined = self._seen_pipelined or self._sdd.pipelined_modules
        return output

    def drain(self) -> None:
        """Before a checkpoint; nothing for the pipelines other than semi-sync. A semi-sync runner takes no step
        after it (the job restarts or ends): the dense gradients stashed by its last step are applied now (with
        ``stash_gradients``), so the checkpoint holds every trained step's update, and its batches in flight are
        waited for (their collectives end on every rank before the next runner's start) and dropped."""
        if isinstance(self._pipeline, TrainPipelineSemiSync):
            self._pipeline.flush()

    @property
    def pipelined_modules(self) -> list[str]:
        """The sharded modules whose input dist the pipeline prefetched (empty for ``base`` or a fallback)."""
        return list(self._seen_pipelined)

    def pause(self) -> None:
        if self._sdd is not None:
            self._sdd.detach()
        elif isinstance(self._pipeline, TrainPipelineSparseDist):  # semi_sync too (a subclass)
            self._pipeline.detach()

    def close(self) -> None:
        self.pause()
        self._pipeline.close()


__all__ = [
    "EBC_PATH",
    "StepRunner",
    "build_plan",
    "build_sharded_dense_optimizer",
    "build_sharded_model",
    "check_column_wise",
    "qcomm_unused",
]
