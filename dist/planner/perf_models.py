"""Rating a placed plan: the estimated step time is the slowest rank's (collectives make every rank wait for the
slowest), each rank's time being the sum of its shards' estimates plus the fixed costs of the groups it takes part
in (:func:`~tritonrec.dist.planner.shard_estimators.group_fixed_perf`).

Ranks of one host share its cores and memory bandwidth: the lookup coefficients are measured with every rank of the
host computing at once, and a rank computing while its host peers are idle runs ``lookup.alone_speedup`` times
faster (measured by ``calibrate``; 1 on a GPU per rank). So each compute phase (forward, backward) of a host's ranks
is played out as processor sharing: while ``k`` of the ``L`` ranks still compute, each progresses at
``1 + (alone_speedup - 1) (L - k) / (L - 1)`` times the all-busy rate. A plan that leaves one rank more work than the
others thus costs less than its all-busy estimate - what a shared CPU host shows, where table-wise plans with some
imbalance beat perfectly balanced row-wise ones."""

from __future__ import annotations

from tritonrec.dist.planner.shard_estimators import group_fixed_perf
from tritonrec.dist.planner.types import Perf, ShardingOption, Topology

__all__ = ["EmbeddingPerfModel", "NoopPerfModel", "shared_host_finish"]


def shared_host_finish(busy_seconds: list[float], alone_speedup: float) -> list[float]:
    """When each of a host's ranks finishes work estimated at ``busy_seconds`` (all ranks busy), if a rank runs
    ``1 + (alone_speedup - 1) (L - k) / (L - 1)`` times faster while only ``k`` of the ``L`` ranks compute (see
    module docstring). ``alone_speedup == 1``: the inputs unchanged."""
    count = len(busy_seconds)
    if count < 2 or alone_speedup == 1.0:
        return list(busy_seconds)
    order = sorted(range(count), key=lambda r: busy_seconds[r])
    finish = [0.0] * count
    now = done = 0.0  # wall time, and busy-seconds of work every unfinished rank has done
    for position, rank in enumerate(order):
        active = count - position
        rate = 1.0 + (alone_speedup - 1.0) * (count - active) / (count - 1)
        now += (busy_seconds[rank] - done) / rate
        done = busy_seconds[rank]
        finish[rank] = now
    return finish


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
        speedup = topo.coefficients.lookup.alone_speedup
        local = topo.local_world_size
        if speedup > 1.0 and local > 1:
            for start in range(0, topo.world_size, local):
                host = perfs[start : start + local]
                fwd = shared_host_finish([p.fwd_compute for p in host], speedup)
                bwd = shared_host_finish([p.bwd_compute for p in host], speedup)
                for k, p in enumerate(host):
                    perfs[start + k] = Perf(fwd[k], p.fwd_comms, bwd[k], p.bwd_comms)
        return perfs

    def rate(self, plan: list[ShardingOption]) -> float:
        return max(p.total for p in self.rank_perfs(plan))


class NoopPerfModel(EmbeddingPerfModel):
    """torchrec's name for the max-over-ranks rating (the same model here)."""
