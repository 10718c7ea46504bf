"""``EmbeddingTowerSharder`` / ``EmbeddingTowerCollectionSharder`` and their sharded modules (torchrec's
``torchrec.distributed.embedding_tower_sharding`` names and semantics): each whole tower - tables and interaction -
on one host (see :mod:`tritonrec.dist.embedding_tower_base` for the data flow and the gradients,
:mod:`tritonrec.dist.embedding_tower_plan` for the plans they take).

Example (2 ranks, one rank per host: ``LOCAL_WORLD_SIZE=1``)::

    towers = EmbeddingTowerCollection([EmbeddingTower(ebc_a, interaction_a), EmbeddingTower(ebc_b, interaction_b)])
    sharder = EmbeddingTowerCollectionSharder()
    plan = construct_module_sharding_plan(
        towers, {"a0": table_row_wise(host_index=0), "a1": table_row_wise(host_index=0),
                 "b0": table_column_wise(ranks=[1])}, sharder, local_size=1, world_size=2, device_type="cpu")
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"tower_arch": plan}),
                                   sharders=[sharder, EmbeddingBagCollectionSharder()])
    # rank 0 holds tower 0 (tables a0, a1 and interaction_a), rank 1 tower 1; model(dense, kjt) as unsharded
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.embedding_tower_base import (
    EmbeddingTowerCollectionContext,
    LocalTower,
    ShardedEmbeddingTowers,
    TowerLazyAwaitable,
)
from tritonrec.dist.embedding_tower_inputs import TowerInputs
from tritonrec.dist.embedding_tower_plan import (
    TOWER_SHARDING_TYPES,
    check_tower,
    embedding_sharder,
    tower_feature_names,
    tower_table_names,
)
from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs
from tritonrec.dist.types import (
    BaseEmbeddingSharder,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
)
from tritonrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection, tower_input_params

_KERNELS = [EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value]


class ShardedEmbeddingTower(ShardedEmbeddingTowers):
    """One tower on its host. ``embedding`` (sharded over the host's ranks) and ``interaction`` exist on that host's
    ranks only (``None`` elsewhere); ``forward`` takes the unsharded tower's arguments and returns this rank's
    ``[B, N]``.

    Args:
        module: the unsharded tower (its embedding an EBC or an EC).
        table_name_to_parameter_sharding: every table of the tower, ``table_row_wise`` / ``table_column_wise`` on one
            host.
        env: the world's process group.
        fused_params, qcomm_codecs_registry: passed to the embedding module's sharder.
        device: where the tower's shards and interaction live (default CPU).
    """

    def __init__(
        self,
        module: EmbeddingTower,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        module = check_tower(module, "module")
        super().__init__(
            [module], ["module"], table_name_to_parameter_sharding, env, fused_params, device, qcomm_codecs_registry
        )
        self._input_params = tower_input_params(module.embedding)

    def _init_containers(self) -> None:
        self.embedding: nn.Module | None = None
        self.interaction: nn.Module | None = None

    def _register(self, index: int, embedding: nn.Module, interaction: nn.Module) -> None:
        self.embedding = embedding
        self.interaction = interaction

    def _prefix(self, index: int) -> str:
        return ""

    def forward(self, *input: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """The unsharded tower's arguments -> this rank's ``[B, N]``, waited for: an unsharded collection around a
        sharded tower checks that its towers return tensors (torchrec returns the lazy awaitable)."""
        return super().forward(*input, **kwargs).wait()

    def input_dist(  # type: ignore[override]
        self,
        ctx: EmbeddingTowerCollectionContext,
        features: KeyedJaggedTensor,
        optional_features: KeyedJaggedTensor | None = None,
    ) -> Awaitable[Awaitable[TowerInputs]]:
        """``features`` (and ``optional_features`` when the embedding module takes both), as the unsharded tower's
        arguments: a weighted EBC's only argument is its weighted KJT."""
        takes_features, takes_weighted = self._input_params
        if takes_features and takes_weighted:
            return self._input_dist(ctx, features, optional_features)
        if takes_weighted:
            return self._input_dist(ctx, None, features)
        return self._input_dist(ctx, features, None)


class ShardedEmbeddingTowerCollection(ShardedEmbeddingTowers):
    """Every tower on its host; ``towers.{i}.embedding`` / ``towers.{i}.interaction`` exist for this host's towers
    only. ``forward(features, weighted_features)`` as the unsharded collection -> this rank's ``[B, sum(N_i)]``, the
    towers in their order.

    Args:
        module: the unsharded collection.
        table_name_to_parameter_sharding: every table of every tower; a tower's tables on one host (towers may share
            a host).
        env, fused_params, device, qcomm_codecs_registry: as :class:`ShardedEmbeddingTower`.
    """

    def __init__(
        self,
        module: EmbeddingTowerCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        if not isinstance(module, EmbeddingTowerCollection):
            raise TypeError(f"module must be an EmbeddingTowerCollection, got {type(module).__name__}")
        towers = [check_tower(t, f"module.towers[{i}]") for i, t in enumerate(module.towers)]
        _check_distinct_tables(towers)
        super().__init__(
            towers,
            [f"towers[{i}]" for i in range(len(towers))],
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry,
        )
        self.input_dist_params = [tower_input_params(t.embedding) for t in towers]

    def _init_containers(self) -> None:
        self.towers = nn.ModuleDict()

    def _register(self, index: int, embedding: nn.Module, interaction: nn.Module) -> None:
        self.towers[str(index)] = LocalTower(embedding, interaction)

    def _prefix(self, index: int) -> str:
        return f"towers.{index}."

    def input_dist(  # type: ignore[override]
        self,
        ctx: EmbeddingTowerCollectionContext,
        features: KeyedJaggedTensor | None = None,
        weighted_features: KeyedJaggedTensor | None = None,
    ) -> Awaitable[Awaitable[TowerInputs]]:
        return self._input_dist(ctx, features, weighted_features)


def _check_distinct_tables(towers: list[EmbeddingTower]) -> None:
    owner: dict[str, int] = {}
    for i, tower in enumerate(towers):
        for table in tower_table_names(tower):
            if table in owner:
                raise ValueError(
                    f"table {table!r} is in towers[{owner[table]}] and towers[{i}]; a plan names tables, so the "
                    "towers' table names must be distinct"
                )
            owner[table] = i


class _TowerSharderBase(BaseEmbeddingSharder):
    """Options every tower sharder carries (torchrec's ``BaseEmbeddingSharder`` arguments) and its sharding types."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """``table_row_wise`` and ``table_column_wise`` (a tower stays on one host)."""
        return list(TOWER_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return list(_KERNELS)

    def embedding_sharder(self, module: EmbeddingTower) -> ModuleSharder[nn.Module]:
        """The sharder of ``module``'s embedding module (EBC or EC sharder, with this sharder's options)."""
        return embedding_sharder(check_tower(module, "module"), self._fused_params, self._qcomm_codecs_registry)  # type: ignore[attr-defined]

    def embedding_feature_names(self, module: EmbeddingTower) -> tuple[list[str], list[str]]:
        """``(features, weighted_features)`` keys the tower reads."""
        return tower_feature_names(check_tower(module, "module"))


class EmbeddingTowerSharder(_TowerSharderBase, BaseEmbeddingSharder[EmbeddingTower]):
    """Shards an :class:`EmbeddingTower` onto one host (:class:`ShardedEmbeddingTower`).

    Args:
        fused_params: optimizer and lookup options for the tower's tables (as the EBC sharder's).
        qcomm_codecs_registry: comm op name -> codecs.
    """

    def shard(
        self,
        module: EmbeddingTower,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingTower:
        return ShardedEmbeddingTower(module, params, env, self._fused_params, device, self.qcomm_codecs_registry)

    @property
    def module_type(self) -> type[EmbeddingTower]:
        return EmbeddingTower

    def shardable_parameters(self, module: EmbeddingTower) -> dict[str, nn.Parameter]:
        """The tower's tables (its interaction's parameters are not sharded: they follow the tables)."""
        return self.embedding_sharder(module).shardable_parameters(module.embedding)


class EmbeddingTowerCollectionSharder(_TowerSharderBase, BaseEmbeddingSharder[EmbeddingTowerCollection]):
    """Shards an :class:`EmbeddingTowerCollection`, each tower onto one host (:class:`ShardedEmbeddingTowerCollection`).

    Args:
        fused_params, qcomm_codecs_registry: as :class:`EmbeddingTowerSharder`.
    """

    def shard(
        self,
        module: EmbeddingTowerCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingTowerCollection:
        return ShardedEmbeddingTowerCollection(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry
        )

    @property
    def module_type(self) -> type[EmbeddingTowerCollection]:
        return EmbeddingTowerCollection

    def shardable_parameters(self, module: EmbeddingTowerCollection) -> dict[str, nn.Parameter]:
        """Every tower's tables."""
        if not isinstance(module, EmbeddingTowerCollection):
            raise TypeError(f"module must be an EmbeddingTowerCollection, got {type(module).__name__}")
        out: dict[str, nn.Parameter] = {}
        for i, tower in enumerate(module.towers):
            out.update(self.embedding_sharder(check_tower(tower, f"module.towers[{i}]")).shardable_parameters(
                tower.embedding))  # fmt: skip
        return out


__all__ = [
    "EmbeddingTowerCollectionContext",
    "EmbeddingTowerCollectionSharder",
    "EmbeddingTowerSharder",
    "ShardedEmbeddingTower",
    "ShardedEmbeddingTowerCollection",
    "TowerLazyAwaitable",
]
