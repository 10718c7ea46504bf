"""Shared pieces of the planner tests: a sharder that only plans (every sharding type on CPU, dense and fused
kernels), round-number perf coefficients for hand-computed estimates, and small meta-device modules."""

from __future__ import annotations

from typing import Any

from torch import nn

from tritonrec.dist.planner import (
    CommCoefficients,
    EmbeddingShardingPlanner,
    EmbeddingStats,
    HeuristicalStorageReservation,
    InputDistCoefficients,
    LookupCoefficients,
    PerfCoefficients,
    Topology,
)
from tritonrec.dist.types import EmbeddingComputeKernel, ModuleSharder, ShardingType
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

DENSE, FUSED = EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value
ALL_TYPES = [t.value for t in ShardingType]

# round numbers so the tests can write estimates by hand: lookups 1 GB/s and 1 ns per id forward, 0.5 GB/s and 2 ns
# per id backward; all-to-all is the reference collective (efficiency 1), reduce-scatter 0.5, all-gather 1,
# all-reduce 0.25; the KJT all-to-all's fixed cost 50 us (no per-id or bucketize terms: see test_planner_cost_terms)
COEFFS = PerfCoefficients(
    "cpu",
    LookupCoefficients(1e9, 1e-4, 5e8, 2e-4, fwd_id_s=1e-9, bwd_id_s=2e-9),
    {
        "all_to_all": CommCoefficients(1e-5, 1e9),
        "reduce_scatter": CommCoefficients(2e-5, 5e8),
        "all_gather": CommCoefficients(3e-5, 1e9),
        "all_reduce": CommCoefficients(4e-5, 2.5e8),
    },
    inter_host_bw=1e8,
    input_dist=InputDistCoefficients(latency_s=5e-5),
)


class PlanOnlySharder(ModuleSharder[Any]):
    """Plans for an ``EmbeddingBagCollection`` or ``EmbeddingCollection`` (the real sharders shard them too)."""

    def __init__(
        self,
        module_type: type[nn.Module] = EmbeddingBagCollection,
        types: list[str] | None = None,
        kernels: list[str] | None = None,
        fused_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._module_type = module_type
        self._types = types or ALL_TYPES
        self._kernels = kernels or [DENSE, FUSED]
        self.fused_params = fused_params or {}

    def shard(self, module, params, env, device=None, module_fqn=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("plans only")

    @property
    def module_type(self) -> type[nn.Module]:
        return self._module_type

    def shardable_parameters(self, module):  # type: ignore[no-untyped-def]
        tables = module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings
        return {name: table.weight for name, table in tables.items()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return self._types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return self._kernels


def ebc(specs: list[tuple[int, int]], features: int = 1, weighted: bool = False) -> EmbeddingBagCollection:
    """Tables ``t0, t1, ...`` of ``(rows, dim)`` on the meta device, each read by ``features`` features."""
    tables = [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}_{j}" for j in range(features)]
        )
        for i, (rows, dim) in enumerate(specs)
    ]
    return EmbeddingBagCollection(tables, is_weighted=weighted, device="meta")


def ec(specs: list[tuple[int, int]]) -> EmbeddingCollection:
    tables = [
        EmbeddingConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i, (rows, dim) in enumerate(specs)
    ]
    return EmbeddingCollection(tables, device="meta")


class Model(nn.Module):
    """Sparse tables under ``sparse.ebc`` plus a dense layer (what the storage reservation replicates)."""

    def __init__(self, tables: nn.Module, dense_features: int = 16) -> None:
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.ebc = tables
        self.dense = nn.Linear(dense_features, dense_features, device="meta")


def topology(world_size: int = 2, ddr_cap: int = 10**9, local_world_size: int | None = None) -> Topology:
    return Topology(
        world_size,
        "cpu",
        ddr_cap=ddr_cap,
        local_world_size=local_world_size,
        intra_host_bw=2e9,
        calibration=COEFFS,
    )


def planner(topo: Topology, batch_size: int = 10, **kwargs: Any) -> EmbeddingShardingPlanner:
    """A planner printing nothing, reserving nothing unless told."""
    kwargs.setdefault("storage_reservation", HeuristicalStorageReservation(percentage=0.0, parameter_multiplier=0.0))
    kwargs.setdefault("stats", EmbeddingStats(out=None))
    return EmbeddingShardingPlanner(topo, batch_size, **kwargs)
