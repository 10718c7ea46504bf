"""``DistributedModelParallel``: shard a whole model by a plan, data-parallelise the rest (torchrec's names and
semantics).

Every module a sharder covers (an ``EmbeddingBagCollection`` by default) is replaced by its sharded module, placed
by ``plan`` (default: the planner's ``collective_plan``, identical on every rank); the remaining dense parameters are
wrapped in ``DistributedDataParallel`` by a :class:`DataParallelWrapper`. The model may be built on the ``meta``
device: each sharded module then allocates and initialises only this rank's shards (with the table's ``init_fn``),
and :meth:`DistributedModelParallel.init_parameters` materialises the dense parameters on ``device`` (DDP then
broadcasts rank 0's values), so a rank never holds the whole model.

Example (every rank)::

    model = DLRM(FusedEmbeddingBagCollection(tables, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, device="meta"),
                 dense_in_features=13, dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1],
                 dense_device="meta")
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))   # planned, sharded, DDP-wrapped
    print(dmp.plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), sgd_factory)
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])         # state keyed by parameter name
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.nn.parallel import DistributedDataParallel

from tritonrec.dist.comm import get_local_size
from tritonrec.dist.data_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    compressed_allreduce_hook,
    deterministic_allreduce_hook,
    join_name,
    sharded_parameter_names,
)
from tritonrec.dist.model_parallel_args import check_sharders, dense_only_constraints, resolve_env, sharder_for
from tritonrec.dist.module_tree import (
    apply_outside_sharded,
    load_into,
    move_outside,
    process_groups_not_copied,
    self_copying_modules,
)
from tritonrec.dist.sharded_fused_optimizer import HyperparamsOnlyOptimizer
from tritonrec.dist.sharding_plan import get_default_sharders
from tritonrec.dist.types import (
    EmbeddingModuleShardingPlan,
    FusedOptimizerModule,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)
from tritonrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "compressed_allreduce_hook",
    "deterministic_allreduce_hook",
    "get_module",
    "get_unwrapped_module",
]


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """``module`` without its DMP and DDP wrappers."""
    while isinstance(module, (DistributedModelParallel, DistributedDataParallel)):
        module = module._dmp_wrapped_module if isinstance(module, DistributedModelParallel) else module.module
    return module


def get_module(module: nn.Module) -> nn.Module:
    """``module`` without its DMP wrapper (a DDP wrapper stays, so its overrides still apply)."""
    while isinstance(module, DistributedModelParallel):
        module = module._dmp_wrapped_module
    return module


class DistributedModelParallel(nn.Module, FusedOptimizerModule):
    """Model parallelism for a whole model (see module docstring).

    Args:
        module: the model (may live on ``meta``).
        env: the process group (default: the default group's).
        device: where shards and dense parameters live (default: CPU, torchrec's default).
        plan: the sharding plan (default: ``EmbeddingShardingPlanner(Topology(world, device.type,
            local_world_size=get_local_size(world))).collective_plan(module, sharders, pg)``).
        sharders: the sharders to shard with (default: ``get_default_sharders()``).
        init_data_parallel: wrap the dense part in DDP now (else call :meth:`init_data_parallel` later, e.g. after
            a first forward that initialises lazy modules).
        init_parameters: materialise dense parameters and buffers still on ``meta`` on ``device``, running their
            module's ``reset_parameters``.
        data_parallel_wrapper: default :class:`DefaultDataParallelWrapper`.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | None = None,
        plan: ShardingPlan | None = None,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: DataParallelWrapper | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, DistributedModelParallel):
            raise TypeError("module is already a DistributedModelParallel")
        self._env = resolve_env(env)
        if device is None:
            device = torch.device("cpu")
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device) or device.type == "meta":
            raise ValueError(f"device must be a real torch.device (cpu, cuda), got device={device!r}")
        self.device = device
        self.sharders = get_default_sharders() if sharders is None else check_sharders(sharders)
        self._sharder_map = {sharder.module_type: sharder for sharder in self.sharders}
        if data_parallel_wrapper is None:
            data_parallel_wrapper = DefaultDataParallelWrapper()
        if not isinstance(data_parallel_wrapper, DataParallelWrapper):
            raise TypeError(f"data_parallel_wrapper must be a DataParallelWrapper, got {data_parallel_wrapper!r}")
        self._data_parallel_wrapper = data_parallel_wrapper
        for name, flag in (("init_data_parallel", init_data_parallel), ("init_parameters", init_parameters)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {name}={flag!r}")
        self.init_parameters = init_parameters
        self._ddp_wrapped = False
        if plan is None:
            plan = self._default_plan(module)
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
        self._check_plan(module, plan)
        self._plan = plan
        self._dmp_wrapped_module: nn.Module = self._shard_modules(module, "")
        self._sync_replicated_tables()
        self._optim = self._init_optim(self._dmp_wrapped_module)
        if init_parameters:
            self._init_parameters(self._dmp_wrapped_module)
        if init_data_parallel:
            self.init_data_parallel()

    # ---------------------------------------------------------------------------------------------- sharding
    def _default_plan(self, module: nn.Module) -> ShardingPlan:
        from tritonrec.dist.planner import EmbeddingShardingPlanner, Topology

        world, device = self._env.world_size, self.device.type
        topology = Topology(world, compute_device=device, local_world_size=get_local_size(world))
        constraints = dense_only_constraints(module, self._sharder_map, device)
        planner = EmbeddingShardingPlanner(topology, constraints=constraints)
        if self._env.process_group is not None:
            return planner.collective_plan(module, self.sharders, self._env.process_group)
        return planner.plan(module, self.sharders)

    def _check_plan(self, module: nn.Module, plan: ShardingPlan) -> None:
        modules = dict(module.named_modules())
        for path, module_plan in plan.plan.items():
            if path not in modules:
                raise ValueError(f"the plan shards module {path!r}, which the model does not have")
            if not isinstance(modules[path], ShardedModule) and sharder_for(modules[path], self._sharder_map) is None:
                raise ValueError(
                    f"the plan shards module {path!r} ({type(modules[path]).__name__}) but no sharder covers it "
                    f"(sharders cover {sorted(t.__name__ for t in self._sharder_map)})"
                )
            if not isinstance(module_plan, EmbeddingModuleShardingPlan):
                raise TypeError(f"plan.plan[{path!r}] must be an EmbeddingModuleShardingPlan, got {module_plan!r}")

    def _shard_modules(self, module: nn.Module, path: str) -> nn.Module:
        if isinstance(module, ShardedModule):
            return module
        module_plan = self._plan.get_plan_for_module(path)
        if module_plan:
            sharder = sharder_for(module, self._sharder_map)
            assert sharder is not None  # checked by _check_plan
            return sharder.shard(module, module_plan, self._env, self.device, path)  # type: ignore[arg-type]
        for name, child in module.named_children():
            setattr(module, name, self._shard_modules(child, join_name(path, name)))
        return module

    def _sync_replicated_tables(self) -> None:
        """Data-parallel tables start equal on every rank: rank 0's replica is broadcast (a model built on ``meta``
        initialised each rank's replica with its own random stream). DDP does the same for dense parameters."""
        pg = self._env.process_group
        if pg is None:
            return
        for path, module_plan in self._plan.plan.items():
            replicated = {
                name for name, p in module_plan.items()  # type: ignore[attr-defined]
                if p.sharding_type == ShardingType.DATA_PARALLEL.value
            }  # fmt: skip
            if not replicated:
                continue
            sharded = self._dmp_wrapped_module.get_submodule(path) if path else self._dmp_wrapped_module
            for name, param in sharded.named_parameters():
                parts = name.split(".")
                if len(parts) >= 2 and parts[-2] in replicated and parts[-1] == "weight":
                    with torch.no_grad():
                        dist.broadcast(param.data, src=dist.get_global_rank(pg, 0), group=pg)

    def _init_optim(self, module: nn.Module) -> CombinedOptimizer:
        optims: list[tuple[str, KeyedOptimizer]] = []
        seen: set[int] = set()

        def collect(child: nn.Module, path: str) -> None:
            if isinstance(child, FusedOptimizerModule):
                if id(child) not in seen:  # one module reachable under two paths contributes once
                    seen.add(id(child))
                    optimizer = child.fused_optimizer
                    if not isinstance(optimizer, KeyedOptimizer):
                        optimizer = HyperparamsOnlyOptimizer(optimizer)
                    optims.append((path, optimizer))
                return
            for name, grandchild in child.named_children():
                collect(grandchild, join_name(path, name))

        collect(get_unwrapped_module(module), "")
        return CombinedOptimizer(optims)  # type: ignore[arg-type]

    def _init_parameters(self, module: nn.Module) -> None:
        device = self.device

        @torch.no_grad()
        def materialise(child: nn.Module) -> None:
            if isinstance(child, ShardedModule):
                return
            replaced = False
            for name, param in child._parameters.items():
                if param is not None and param.device.type == "meta":
                    child._parameters[name] = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                    replaced = True
            for name, buffer in child._buffers.items():
                if buffer is not None and buffer.device.type == "meta":
                    child._buffers[name] = torch.zeros_like(buffer, device=device)
            if replaced and callable(getattr(child, "reset_parameters", None)):
                child.reset_parameters()

        apply_outside_sharded(get_unwrapped_module(module), materialise)

    def init_data_parallel(self) -> None:
        """Wrap the dense part in data parallelism (safe to call more than once)."""
        if self._ddp_wrapped:
            return
        if self.init_parameters:
            self._init_parameters(self._dmp_wrapped_module)
        self._data_parallel_wrapper.wrap(self, self._env, self.device)
        self._ddp_wrapped = True

    # ------------------------------------------------------------------------------------------------ access
    @property
    def module(self) -> nn.Module:
        """The sharded model without any DMP / DDP wrapper."""
        return get_unwrapped_module(self)

    @module.setter
    def module(self, value: nn.Module) -> None:
        if isinstance(self._dmp_wrapped_module, DistributedDataParallel):
            raise RuntimeError("module cannot be set after init_data_parallel()")
        self._dmp_wrapped_module = value

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "module":  # nn.Module would register a module value as a child instead of calling the setter
            type(self).module.fset(self, value)  # type: ignore[attr-defined]
            return
        super().__setattr__(name, value)

    def get_module(self) -> nn.Module:
        """The wrapped model, data-parallel wrapper included."""
        return get_module(self)

    def get_unwrapped_module(self) -> nn.Module:
        return get_unwrapped_module(self)

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def fused_optimizer(self) -> CombinedOptimizer:
        """Every sharded module's fused optimizer, keyed ``<module path>.<parameter name>``; its ``state_dict`` holds
        each table's state whole, as ShardedTensors, so ``torch.distributed.checkpoint`` saves and re-shards it
        (:mod:`tritonrec.dist.sharded_fused_optimizer`)."""
        return self._optim

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under their unwrapped names (this rank's shards for sharded tables)."""
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def bare_named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.module.named_parameters(prefix, recurse)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)

    @staticmethod
    def _sharded_parameter_names(module: nn.Module, prefix: str = "") -> Iterator[str]:
        """Parameters owned by sharded modules (kept out of data parallelism)."""
        yield from sharded_parameter_names(get_unwrapped_module(module), prefix)

    def sparse_grad_parameter_names(self, destination: list[str] | None = None, prefix: str = "") -> list[str]:
        """Names of unsharded ``nn.Embedding`` / ``nn.EmbeddingBag`` weights with sparse gradients."""
        destination = [] if destination is None else destination

        def visit(module: nn.Module, path: str) -> None:
            module = get_unwrapped_module(module)
            if isinstance(module, ShardedModule):
                return
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                if module.sparse:
                    destination.append(join_name(path, "weight"))
                return
            for name, child in module.named_children():
                visit(child, join_name(path, name))

        visit(self.module, prefix)
        return destination

    # ---------------------------------------------------------------------------------------------- state dict
    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The model's state dict under unwrapped names (sharded modules give theirs: this rank's shards)."""
        out = get_unwrapped_module(self).state_dict(prefix=prefix, keep_vars=keep_vars)
        if destination is None:
            return out
        destination.update(out)
        return destination

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], prefix: str = "", strict: bool = True
    ) -> _IncompatibleKeys:
        """Load a :meth:`state_dict` (sharded modules load their entries through their own ``load_state_dict``)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        missing: list[str] = []
        unexpected: list[str] = []
        load_into(self.module, dict(state_dict), prefix, strict, missing, unexpected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        return _IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------------------------------------- copies
    def copy(self, device: torch.device) -> DistributedModelParallel:
        """A copy with every tensor on ``device`` (same plan and process group; re-wrapped in data parallelism when
        this one is, so every rank must call it). As torchrec's: a module that defines ``copy(device)`` (its
        ``CopyMixIn``, as the quantized collections, sharded or not) is replaced by what that returns (themselves:
        their tables stay on their devices, shared); every other module is deep-copied to ``device``."""
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device) or device.type == "meta":
            raise TypeError(f"device must be a real torch.device, got device={device!r}")
        was_wrapped = self._ddp_wrapped
        unwrapped = self.module
        # deepcopy's memo maps each self-copying module to its own copy, which the deep copy then takes as it is
        memo: dict[int, Any] = {id(m): m.copy(device) for m in self_copying_modules(unwrapped)}  # type: ignore[operator]
        kept = {id(m) for m in memo.values()}
        wrapped, self._dmp_wrapped_module = self._dmp_wrapped_module, unwrapped
        try:
            with process_groups_not_copied():
                twin = copy.deepcopy(self, memo)
        finally:
            self._dmp_wrapped_module = wrapped
        twin.device = device
        move_outside(twin._dmp_wrapped_module, device, kept)
        twin._optim = twin._init_optim(twin._dmp_wrapped_module)
        twin._ddp_wrapped = False
        if was_wrapped:
            twin.init_data_parallel()
        return twin
