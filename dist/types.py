"""The vocabulary of model parallelism (torchrec's ``torchrec.distributed.types`` names and semantics).

* :class:`ShardingType` / :class:`EmbeddingComputeKernel`: how a table is split across ranks and which lookup runs it.
* :class:`ParameterSharding`: one table's placement - its sharding type, compute kernel, the ranks holding its shards
  and, per shard, the global ``(row, column)`` offsets and sizes (a torch ``EnumerableShardingSpec`` of
  ``ShardMetadata``, as torchrec, so ``ShardedTensor``/DCP can describe the shards).
* :class:`EmbeddingModuleShardingPlan` (table name -> ParameterSharding) and :class:`ShardingPlan` (module path ->
  module plan), with a readable ``__str__`` table.
* :class:`ShardingEnv`: the process group (or, for single-host inference, just a world size and rank).
* :class:`ShardedModule`: ``input_dist`` -> ``compute`` -> ``output_dist``, each step returning an awaitable, with a
  per-batch context. The train pipeline only ever calls these steps, which is what lets it overlap them.
* :class:`ModuleSharder`: turns an unsharded module plus its plan into a :class:`ShardedModule`, and tells the planner
  what it supports (sharding types and compute kernels per device type) and what a placement costs in storage.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.kernels.checks import check_int

__all__ = [
    "BaseEmbeddingSharder",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "FusedOptimizerModule",
    "ModuleSharder",
    "ModuleShardingPlan",
    "Multistreamable",
    "NullShardedModuleContext",
    "ParameterSharding",
    "ShardMetadata",
    "ShardedModule",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
]


class ShardingType(enum.Enum):
    """How one table is split across ranks (values are torchrec's strings, which plans carry)."""

    DATA_PARALLEL = "data_parallel"  # replicated on every rank, gradients all-reduced
    TABLE_WISE = "table_wise"  # whole table on one rank
    COLUMN_WISE = "column_wise"  # column blocks on several ranks, each block a table of its own
    ROW_WISE = "row_wise"  # row ranges on every rank
    TABLE_ROW_WISE = "table_row_wise"  # row-wise inside one node, table-wise across nodes
    TABLE_COLUMN_WISE = "table_column_wise"  # column-wise inside one node
    GRID_SHARD = "grid_shard"  # column blocks, each row-wise inside a node


class EmbeddingComputeKernel(enum.Enum):
    """Which local lookup serves a shard: ``dense`` (autograd gradients to the parameters), ``fused`` (the optimizer
    runs inside the backward), ``quant`` (row-wise INT8/INT4 inference tables)."""

    DENSE = "dense"
    FUSED = "fused"
    QUANT = "quant"


def _value(x: str | enum.Enum) -> str:
    return x.value if isinstance(x, enum.Enum) else x


@dataclass
class ParameterSharding:
    """One table's placement (torchrec's fields).

    Args:
        sharding_type: a :class:`ShardingType` value (``"table_wise"``...).
        compute_kernel: an :class:`EmbeddingComputeKernel` value (``"fused"``...).
        ranks: the rank of each shard, in shard order (DP: every rank).
        sharding_spec: per shard, ``ShardMetadata(shard_offsets=[row, col], shard_sizes=[rows, cols],
            placement="rank:<r>/<device>")``; ``None`` for data parallel (every rank holds the whole table).
        stochastic_rounding, bounds_check_mode: per-table overrides of the sharder's ``fused_params``.
    """

    sharding_type: str
    compute_kernel: str
    ranks: list[int] | None = None
    sharding_spec: EnumerableShardingSpec | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: Any = None

    def __post_init__(self) -> None:
        self.sharding_type = _value(self.sharding_type)
        self.compute_kernel = _value(self.compute_kernel)
        known_types = {t.value for t in ShardingType}
        if self.sharding_type not in known_types:
            raise ValueError(f"sharding_type must be one of {sorted(known_types)}, got {self.sharding_type!r}")
        known_kernels = {k.value for k in EmbeddingComputeKernel}
        if self.compute_kernel not in known_kernels:
            raise ValueError(f"compute_kernel must be one of {sorted(known_kernels)}, got {self.compute_kernel!r}")

    @property
    def shards(self) -> list[ShardMetadata]:
        """The shards' metadata (empty for data parallel)."""
        return list(self.sharding_spec.shards) if self.sharding_spec is not None else []


class ModuleShardingPlan:
    """Base of per-module plans (torchrec keeps this seam for non-embedding modules)."""


class EmbeddingModuleShardingPlan(ModuleShardingPlan, dict[str, ParameterSharding]):
    """Table name -> :class:`ParameterSharding` for one embedding module."""

    def __str__(self) -> str:
        tables = [[name, p.sharding_type, p.compute_kernel, str(p.ranks)] for name, p in self.items()]
        shards = [
            [name, str(list(s.shard_offsets)), str(list(s.shard_sizes)), str(s.placement)]
            for name, p in self.items()
            for s in p.shards
        ]
        out = _table(["param", "sharding type", "compute kernel", "ranks"], tables)
        if shards:
            out += "\n\n" + _table(["param", "shard offsets", "shard sizes", "placement"], shards)
        return out


@dataclass
class ShardingPlan:
    """Module path (as in ``model.named_modules()``) -> that module's plan."""

    plan: dict[str, ModuleShardingPlan] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> ModuleShardingPlan | None:
        """The plan of the module at ``module_path``, or ``None`` when the module is not sharded."""
        return self.plan.get(module_path)

    def __str__(self) -> str:
        return "\n\n".join(f"module: {path}\n\n{module_plan}" for path, module_plan in self.plan.items())


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with left-aligned columns."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


class ShardingEnv:
    """Where sharded modules run: ``world_size`` ranks, this one being ``rank``, talking over ``process_group``
    (``None`` for single-host inference, where every "rank" is a device of this process)."""

    def __init__(self, world_size: int, rank: int, pg: dist.ProcessGroup | None = None) -> None:
        world_size = check_int(world_size, "world_size", 1)
        rank = check_int(rank, "rank", 0, world_size - 1, what=f"an int in [0, {world_size})")
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup or None, got {type(pg).__name__}")
        self.world_size = world_size
        self.rank = rank
        self.process_group = pg

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup) -> ShardingEnv:
        """The environment of ``pg`` (training)."""
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__}")
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        """A process-group-free environment (single-host inference)."""
        return cls(world_size, rank, None)

    def __repr__(self) -> str:
        return f"ShardingEnv(world_size={self.world_size}, rank={self.rank}, pg={self.process_group is not None})"


class Multistreamable(abc.ABC):
    """Something whose tensors can be told they are used on another CUDA stream (contexts, KJTs)."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None: ...


class NullShardedModuleContext(Multistreamable):
    """A context that holds nothing."""

    def record_stream(self, stream: torch.Stream) -> None:
        return None

    def __iter__(self) -> Iterator[None]:
        return iter(())


CompIn = TypeVar("CompIn")
DistOut = TypeVar("DistOut")
Out = TypeVar("Out")
ShrdCtx = TypeVar("ShrdCtx", bound=Multistreamable)
M = TypeVar("M", bound=nn.Module)


class ShardedModule(abc.ABC, nn.Module, Generic[CompIn, DistOut, Out, ShrdCtx]):
    """A model-parallel module: data-parallel inputs and outputs, model-parallel inside.

    ``input_dist(ctx, *input)`` launches the input redistribution and returns an awaitable of an awaitable (first the
    split sizes, then the tensors, as ``KJTAllToAll``); ``compute(ctx, dist_input)`` runs the local lookups;
    ``output_dist(ctx, output)`` launches the output redistribution. ``forward`` chains all three.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        super().__init__()
        self._qcomm_codecs_registry: dict[str, QuantizedCommCodecs] = dict(qcomm_codecs_registry or {})
        # set by the train pipeline when it swaps ``forward`` for one that consumes a prefetched input dist
        self.is_pipelined = False

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs]:
        return self._qcomm_codecs_registry

    @property
    def input_dist_on_own_group(self) -> bool:
        """Whether every input dist of this module runs on a process group no other traffic uses, so a rank that
        failed to launch one cannot mispair the model's other collectives (:mod:`tritonrec.dist.side_groups`).
        The pipelines then let the ranks agree on a step's failures during the forward instead of before it."""
        return False

    @abc.abstractmethod
    def create_context(self) -> ShrdCtx: ...

    @abc.abstractmethod
    def input_dist(self, ctx: ShrdCtx, *input: Any, **kwargs: Any) -> Awaitable[Awaitable[CompIn]]: ...

    @abc.abstractmethod
    def compute(self, ctx: ShrdCtx, dist_input: CompIn) -> DistOut: ...

    @abc.abstractmethod
    def output_dist(self, ctx: ShrdCtx, output: DistOut) -> LazyAwaitable[Out]: ...

    def compute_and_output_dist(self, ctx: ShrdCtx, input: CompIn) -> LazyAwaitable[Out]:
        """Compute then launch the output dist (override to start each output dist as soon as its compute ends)."""
        return self.output_dist(ctx, self.compute(ctx, input))

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Out]:
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, *input, **kwargs).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Names of the parameters this module holds shards of (DMP keeps them out of data parallelism)."""
        for name, _ in self.named_parameters(prefix=prefix):
            yield name


class FusedOptimizerModule(abc.ABC):
    """A module whose optimizer runs inside its backward; ``fused_optimizer`` exposes that optimizer's state and
    hyperparameters (a ``KeyedOptimizer``-like ``torch.optim.Optimizer``)."""

    @property
    @abc.abstractmethod
    def fused_optimizer(self) -> torch.optim.Optimizer: ...


class ModuleSharder(abc.ABC, Generic[M]):
    """Shards modules of one type (``module_type``) by a plan; tells the planner what it supports.

    Args:
        qcomm_codecs_registry: comm op name (``CommOp`` value) -> codecs put on that op's wire.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        """Build the sharded module: only this rank's shards are allocated (on ``device``)."""

    @property
    @abc.abstractmethod
    def module_type(self) -> type[M]: ...

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs] | None:
        return self._qcomm_codecs_registry

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        """Table name -> its weight parameter (what a plan assigns shardings to)."""
        return dict(module.named_parameters())

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Sharding types this sharder supports on ``compute_device_type`` (``"cpu"`` / ``"cuda"``)."""
        return [ShardingType.DATA_PARALLEL.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """Compute kernels this sharder supports for ``sharding_type`` on ``compute_device_type``."""
        return [EmbeddingComputeKernel.DENSE.value]

    def storage_usage(self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str) -> dict[str, int]:
        """Bytes a shard ``tensor`` needs, by storage kind (``"hbm"`` on GPU, ``"ddr"`` on CPU)."""
        kind = "hbm" if compute_device_type == "cuda" else "ddr"
        return {kind: tensor.element_size() * tensor.nelement()}


class BaseEmbeddingSharder(ModuleSharder[M]):
    """A sharder of embedding modules (torchrec's ``BaseEmbeddingSharder``): it carries the ``fused_params`` the
    sharded tables get (optimizer and lookup options, :mod:`tritonrec.dist.fused_params`; the planner reads their
    optimizer) besides the comm codecs."""

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        if fused_params is not None and not isinstance(fused_params, dict):
            raise TypeError(f"fused_params must be a dict or None, got {type(fused_params).__name__}")
        super().__init__(qcomm_codecs_registry)
        self._fused_params = fused_params

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._fused_params
