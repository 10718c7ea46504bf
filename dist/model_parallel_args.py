"""The arguments of :class:`~tritonrec.dist.model_parallel.DistributedModelParallel` that need more than a type test:
the sharding env (default: the default process group's), the ``sharders`` list, and which of the sharders covers a
module. Kept apart so the DMP module holds the wrapper itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from tritonrec.dist.types import ModuleSharder, ShardingEnv


def resolve_env(env: ShardingEnv | None) -> ShardingEnv:
    if env is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedModelParallel needs a process group: call torch.distributed.init_process_group first, "
                "or pass env=ShardingEnv(...)"
            )
        return ShardingEnv.from_process_group(dist.group.WORLD)
    if not isinstance(env, ShardingEnv):
        raise TypeError(f"env must be a ShardingEnv, got {type(env).__name__}")
    return env


def check_sharders(sharders: object) -> list[ModuleSharder[nn.Module]]:
    if not isinstance(sharders, (list, tuple)):
        raise TypeError(f"sharders must be a list of ModuleSharder, got {type(sharders).__name__}")
    for sharder in sharders:
        if not isinstance(sharder, ModuleSharder):
            raise TypeError(f"sharders must hold ModuleSharder instances, got {type(sharder).__name__}")
    return list(sharders)


def sharder_for(module: nn.Module, sharders: Mapping[type, ModuleSharder[Any]]) -> ModuleSharder[Any] | None:
    """The sharder of exactly this module's type, else the first whose type it subclasses (the planner's rule)."""
    if type(module) in sharders:
        return sharders[type(module)]
    return next((s for t, s in sharders.items() if isinstance(module, t)), None)


def _offers_dense(sharder: ModuleSharder[Any], compute_device: str) -> bool:
    from tritonrec.dist.types import EmbeddingComputeKernel

    dense = EmbeddingComputeKernel.DENSE.value
    return any(dense in sharder.compute_kernels(t, compute_device) for t in sharder.sharding_types(compute_device))


def dense_only_constraints(
    module: nn.Module, sharders: Mapping[type, ModuleSharder[Any]], compute_device: str
) -> dict[str, Any]:
    """Planner constraints for DistributedModelParallel's default plan: the dense compute kernel only, for every table
    of a sharded module that has no optimizer to fuse (a plain module, no ``optimizer`` in its sharder's
    ``fused_params``, and no optimizer applied in backward to the table). Its tables then train with the caller's
    optimizer, as the unsharded module's would; the planner would otherwise pick the fused kernel, which has no update
    to apply (torchrec's falls back to FBGEMM's SGD at lr 0.01, silently; ours raised). A module whose sharder offers
    no dense kernel on ``compute_device`` (the quantized collections: inference tables, nothing to update) is left
    unconstrained."""
    from tritonrec.dist.planner.enumerators import fused_optimizer_type
    from tritonrec.dist.planner.types import ParameterConstraints
    from tritonrec.dist.types import EmbeddingComputeKernel

    constraints: dict[str, Any] = {}
    for child in module.modules():
        sharder = sharder_for(child, sharders)
        if sharder is None or fused_optimizer_type(sharder, child) is not None:
            continue
        if not _offers_dense(sharder, compute_device):
            continue
        for table, param in sharder.shardable_parameters(child).items():
            if fused_optimizer_type(sharder, child, param) is None:  # no optimizer applied in backward either
                constraints[table] = ParameterConstraints(compute_kernels=[EmbeddingComputeKernel.DENSE.value])
    return constraints
