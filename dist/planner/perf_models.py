"""Rating a placed plan: the estimated step time is the slowest rank's (collectives make every rank wait for the
slowest), each rank's time being the sum of its shards' estimates plus the fixed costs of the groups it takes part
in (:func:`~tritonrec.dist.planner.shard_estimators.group_fixed_perf`)."""

from __future__ import annotations

from tritonrec.dist.planner.shard_estimators import group_fixed_perf
from tritonrec.dist.planner.types import Perf, ShardingOption, Topology

__all__ = ["EmbeddingPerfModel", "NoopPerfModel"]


class EmbeddingPerfModel:
    """``rate(plan)`` -> estimated seconds per step (lower is better); ``rank_perfs(plan)`` -> per-rank breakdown."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def rank_perfs(self, plan: list[ShardingOption]) -> list[Perf]:
        topo = self._topology
        perfs = [Perf() for _ in range(topo.world_size)]
        groups: dict[tuple[str, str, str, bool], set[int]] = {}
        for option in plan:
            key = (option.path, option.sharding_type, option.compute_kernel, option.is_pooled)
            holders = groups.setdefault(key, set())
            for shard in option.shards:
                if shard.rank is None:
                    raise ValueError(f"table {option.name!r} has an unplaced shard: partition the plan first")
                perfs[shard.rank] = perfs[shard.rank] + (shard.perf or Perf())
                holders.add(shard.rank)
        for (_, sharding_type, _, is_pooled), holders in groups.items():
            comms, compute = group_fixed_perf(sharding_type, is_pooled, topo)
            for rank in range(topo.world_size):
                perfs[rank] = perfs[rank] + comms + (compute if rank in holders else Perf())
        return perfs

    def rate(self, plan: list[ShardingOption]) -> float:
        return max(p.total for p in self.rank_perfs(plan))


class NoopPerfModel(EmbeddingPerfModel):
    """torchrec's name for the max-over-ranks rating (the same model here)."""
