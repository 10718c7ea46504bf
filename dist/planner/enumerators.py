"""The search space: every (sharding type, compute kernel, column-shard count) a sharder offers for each table,
filtered by the user's constraints, with shard shapes from ``calculate_shard_sizes_and_offsets`` (the same function
the hand-written plan generators use, so a planned shard is exactly the shard the sharded module builds).

The enumerator relies only on the :class:`~tritonrec.dist.types.ModuleSharder` interface (``module_type``,
``shardable_parameters``, ``sharding_types``, ``compute_kernels``, ``storage_usage``), plus two things a module may
tell: its table configs (``embedding_bag_configs()`` -> pooled, ``embedding_configs()`` -> sequence; for each table's
feature count and output dim) and ``is_weighted()``. The fused optimizer whose state a ``fused`` shard carries comes
from the optimizer ``apply_optimizer_in_backward`` put on the table (torchrec's recipe), the sharder's
``fused_params["optimizer"]`` (torchrec's key) or the module's own ``fused_optimizer``. A table updated inside the
backward (such an optimizer, or a fused collection's table) is offered no dense kernel, which would drop its optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from tritonrec.dist.planner.types import (
    BATCH_SIZE,
    MIN_CW_DIM,
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
    Topology,
)
from tritonrec.dist.sharding_plan import calculate_shard_sizes_and_offsets
from tritonrec.dist.types import EmbeddingComputeKernel, ModuleSharder, ShardingType
from tritonrec.kernels.checks import check_int
from tritonrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection
from tritonrec.modules.fused_embedding_modules import resolve_optimizer_type

__all__ = ["EmbeddingEnumerator", "check_sharders", "shardable_modules", "tower_dependency"]

_COLUMN_SPLIT = {
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.GRID_SHARD.value,
}


def check_sharders(sharders: object) -> list[ModuleSharder[Any]]:
    if not isinstance(sharders, Sequence) or isinstance(sharders, str) or not sharders:
        raise ValueError(f"sharders must be a non-empty list of ModuleSharder, got {sharders!r}")
    for sharder in sharders:
        if not isinstance(sharder, ModuleSharder):
            raise TypeError(f"sharders must hold ModuleSharder instances, got {type(sharder).__name__}")
    return list(sharders)


def _sharder_for(module: nn.Module, sharders: list[ModuleSharder[Any]]) -> ModuleSharder[Any] | None:
    """The sharder of exactly this module type, else the first one whose type it subclasses."""
    exact = [s for s in sharders if type(module) is s.module_type]
    if exact:
        return exact[0]
    return next((s for s in sharders if isinstance(module, s.module_type)), None)


def shardable_modules(
    module: nn.Module, sharders: list[ModuleSharder[Any]]
) -> Iterator[tuple[str, nn.Module, ModuleSharder[Any]]]:
    """``(path, module, sharder)`` for every module some sharder handles (not descending into those)."""
    taken: list[str] = []
    for path, child in module.named_modules():
        if any(t == "" or path.startswith(f"{t}.") for t in taken):  # inside a module already taken
            continue
        sharder = _sharder_for(child, sharders)
        if sharder is not None:
            taken.append(path)
            yield path, child, sharder


def _table_config(module: nn.Module, name: str) -> tuple[Any, bool]:
    """The table's config (``None`` when the module does not list configs) and whether its lookups are pooled."""
    for method, pooled in (("embedding_bag_configs", True), ("embedding_configs", False)):
        if callable(getattr(module, method, None)):
            for config in getattr(module, method)():
                if getattr(config, "name", None) == name:
                    return config, pooled
            return None, pooled
    return None, True


def _tower_index(collection: EmbeddingTowerCollection, table: str) -> int | None:
    """The index of the tower of ``collection`` whose embedding module holds ``table`` (``None``: none does)."""
    for i, tower in enumerate(collection.towers):
        if any(name.split(".")[-1] == table for name, _ in tower.embedding.named_modules()):
            return i
    return None


def _tower_embedding(module: nn.Module, table: str) -> nn.Module:
    """The embedding module of the tower of ``module`` (an :class:`EmbeddingTower` or a collection of them) that
    holds ``table``; ``module`` itself when it is no tower."""
    if isinstance(module, EmbeddingTower):
        return module.embedding
    if isinstance(module, EmbeddingTowerCollection):
        index = _tower_index(module, table)
        return module.towers[index].embedding if index is not None else module
    return module


def fused_optimizer_type(sharder: ModuleSharder[Any], module: nn.Module, param: nn.Parameter | None = None) -> Any:
    """The optimizer a fused kernel would apply to ``module``'s tables: the one ``apply_optimizer_in_backward`` put
    on ``param``, else the sharder's ``fused_params``, else the module's own fused optimizer (the inner EBC's, for a
    feature-processed one); None when none has one."""
    in_backward = getattr(param, "_optimizer_classes", None)
    if in_backward:
        return resolve_optimizer_type(in_backward[0])
    fused_params = getattr(sharder, "fused_params", None) or {}
    for key in ("optimizer", "optimizer_type"):
        if key in fused_params:
            return resolve_optimizer_type(fused_params[key])
    inner = getattr(module, "_embedding_bag_collection", module)
    return getattr(getattr(inner, "fused_optimizer", None), "optimizer_type", None)


def tower_dependency(path: str, module: nn.Module, table: str) -> str | None:
    """The tower ``table`` belongs to when a tower sharder covers ``module`` (torchrec's ``dependency``: ``path`` for
    an :class:`EmbeddingTower`, ``<path>.tower_<i>`` for tower ``i`` of a collection), else ``None``. The partitioner
    places options of one dependency on one host, as the tower sharders require."""
    if isinstance(module, EmbeddingTower):
        return path
    if isinstance(module, EmbeddingTowerCollection):
        index = _tower_index(module, table)
        if index is not None:
            return f"{path}.tower_{index}"
        raise ValueError(f"table {table!r} is in none of the towers of {path or 'the model'!r}")
    return None


def _per_feature(
    name: str, what: str, values: list[Any] | None, features: int, default: Any
) -> list[Any]:  # one entry per feature; a single entry applies to every feature
    if values is None:
        return [default] * features
    if len(values) == 1:
        return list(values) * features
    if len(values) != features:
        raise ValueError(f"table {name!r} is read by {features} features but its constraints give {len(values)} {what}")
    return list(values)


class EmbeddingEnumerator:
    """Lists the :class:`ShardingOption` s of every table and runs the estimators on them.

    Args:
        topology: the machines.
        batch_size: samples per rank per step.
        constraints: table name -> :class:`ParameterConstraints`.
        estimator: one estimator or a list (``estimate(options)`` fills shard storage / perf).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = BATCH_SIZE,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: Any = None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        batch_size = check_int(batch_size, "batch_size", 1)
        self._topology = topology
        self._batch_size = batch_size
        if constraints is not None and not isinstance(constraints, Mapping):
            raise TypeError(
                f"constraints must be a dict of table name -> ParameterConstraints, got {type(constraints).__name__}"
            )
        self._constraints = dict(constraints or {})
        for name, c in self._constraints.items():
            if not isinstance(c, ParameterConstraints):
                raise TypeError(f"constraints[{name!r}] must be a ParameterConstraints, got {type(c).__name__}")
        if estimator is None:
            self._estimators: list[Any] = []
        else:
            self._estimators = list(estimator) if isinstance(estimator, (list, tuple)) else [estimator]

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[Any]]) -> list[ShardingOption]:
        """Every option of every shardable table of ``module``, estimated. Raises ``PlannerError`` for a table whose
        constraints leave no option and ``ValueError`` for constraints naming no table."""
        sharders = check_sharders(sharders)
        options: list[ShardingOption] = []
        seen: set[str] = set()
        for path, child, sharder in shardable_modules(module, sharders):
            for name, param in sharder.shardable_parameters(child).items():
                seen.add(name)
                table_options = list(self._table_options(path, child, sharder, name, param))
                if not table_options:
                    raise self._no_option_error(name, sharder)
                options.extend(table_options)
        unknown = sorted(set(self._constraints) - seen)
        if unknown:
            raise ValueError(f"constraints name tables {unknown} that no sharder covers (tables: {sorted(seen)})")
        for estimator in self._estimators:
            estimator.estimate(options)
        return options

    def _table_options(
        self, path: str, module: nn.Module, sharder: ModuleSharder[Any], name: str, param: nn.Parameter
    ) -> Iterator[ShardingOption]:
        topo, c = self._topology, self._constraints.get(name)
        if param.dim() != 2:
            raise ValueError(f"table {name!r}: only 2-D [rows, dim] tables can be sharded, got {tuple(param.shape)}")
        rows, dim = param.shape
        # a tower's tables are described by its embedding module (a tower lists no configs: without this its
        # sequence tables were costed as pooled ones read by one feature)
        lookup_module = _tower_embedding(module, name)
        config, pooled = _table_config(lookup_module, name)
        features = max(1, len(config.feature_names)) if config is not None else 1
        output_dim = config.embedding_dim if config is not None else dim
        is_weighted = getattr(lookup_module, "is_weighted", None)
        weighted = bool(is_weighted()) if callable(is_weighted) else False
        pooling = _per_feature(name, "pooling factors", c.pooling_factors if c else None, features, 1.0)
        poolings = _per_feature(name, "num_poolings", c.num_poolings if c else None, features, 1.0)
        batches = _per_feature(name, "batch sizes", c.batch_sizes if c else None, features, self._batch_size)
        optimizer = fused_optimizer_type(sharder, lookup_module, param)  # a tower: its fused EBC/EC
        # the dense kernel would drop an optimizer applied in backward (the sharded module refuses that plan) or a
        # fused collection's own; both mark the table with _in_backward_optimizers
        in_backward = hasattr(param, "_in_backward_optimizers")
        dependency = tower_dependency(path, module, name)
        device = topo.compute_device
        for sharding_type in sharder.sharding_types(device):
            if c is not None and c.sharding_types is not None and sharding_type not in c.sharding_types:
                continue
            for kernel in sharder.compute_kernels(sharding_type, device):
                if c is not None and c.compute_kernels is not None and kernel not in c.compute_kernels:
                    continue
                if in_backward and kernel == EmbeddingComputeKernel.DENSE.value:
                    continue
                for n in self._column_shard_counts(sharding_type, dim, c):
                    sizes, offsets = calculate_shard_sizes_and_offsets(
                        rows, dim, topo.world_size, topo.local_world_size, sharding_type, n
                    )
                    yield ShardingOption(
                        name=name,
                        tensor=param,
                        module=(path, module),
                        sharder=sharder,
                        sharding_type=sharding_type,
                        compute_kernel=kernel,
                        shards=[Shard(size=s, offset=o) for s, o in zip(sizes, offsets, strict=True)],
                        input_lengths=pooling,
                        num_poolings=poolings,
                        batch_sizes=batches,
                        is_pooled=pooled,
                        is_weighted=weighted or bool(c is not None and c.is_weighted),
                        num_column_shards=n,
                        output_dim=output_dim,
                        optimizer=optimizer,
                        stochastic_rounding=c.stochastic_rounding if c else None,
                        bounds_check_mode=c.bounds_check_mode if c else None,
                        dependency=dependency,
                    )

    def _column_shard_counts(self, sharding_type: str, dim: int, c: ParameterConstraints | None) -> list[int | None]:
        """Column-block counts to propose: every divisor ``n`` of ``dim`` with ``2 <= n <= limit`` whose blocks are
        at least ``min_partition`` wide (limit: world size for CW, ranks per host for TWCW, hosts for GRID); one
        block when none qualifies (a valid, degenerate split, as torchrec does for narrow tables)."""
        if sharding_type not in _COLUMN_SPLIT:
            return [None]
        topo = self._topology
        limit = {
            ShardingType.COLUMN_WISE.value: topo.world_size,
            ShardingType.TABLE_COLUMN_WISE.value: topo.local_world_size,
            ShardingType.GRID_SHARD.value: topo.num_hosts,
        }[sharding_type]
        narrowest = c.min_partition if c is not None and c.min_partition is not None else MIN_CW_DIM
        counts = [n for n in range(2, limit + 1) if dim % n == 0 and dim // n >= narrowest]
        return list(counts) or [1]

    def _no_option_error(self, name: str, sharder: ModuleSharder[Any]) -> PlannerError:
        device, c = self._topology.compute_device, self._constraints.get(name)
        offered = {t: sharder.compute_kernels(t, device) for t in sharder.sharding_types(device)}
        return PlannerError(
            f"table {name!r}: no sharding option left on {device}: its constraints allow sharding types "
            f"{c.sharding_types if c else None} and compute kernels {c.compute_kernels if c else None}, "
            f"{type(sharder).__name__} offers {offered}",
            PlannerErrorType.STRICT_CONSTRAINTS,
        )
