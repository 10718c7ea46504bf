"""The table the planner prints (on rank 0) after choosing a plan: per rank its storage and estimated step time, per
table its sharding type, kernel, ranks, storage and time."""

from __future__ import annotations

from collections.abc import Callable

from tritonrec.dist.planner.perf_models import EmbeddingPerfModel
from tritonrec.dist.planner.storage_reservations import Reservation
from tritonrec.dist.planner.types import Perf, ShardingOption, Storage, Topology
from tritonrec.dist.types import _table

__all__ = ["EmbeddingStats", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


class EmbeddingStats:
    """Builds the report and hands it to ``out`` (default ``print``); the last one stays in ``last_report``."""

    def __init__(self, out: Callable[[str], None] | None = print) -> None:
        self._out = out
        self.last_report = ""

    def log(
        self,
        plan: list[ShardingOption],
        topology: Topology,
        batch_size: int,
        perf_model: EmbeddingPerfModel,
        reservation: Reservation | None = None,
        num_proposals: int = 0,
        num_plans: int = 0,
        run_time_s: float = 0.0,
    ) -> str:
        kind = topology.storage_kind
        capacity = topology.hbm_cap if kind == "hbm" else topology.ddr_cap
        reserved = reservation.total if reservation is not None else 0
        perfs = perf_model.rank_perfs(plan)
        used = [Storage() for _ in range(topology.world_size)]
        tables: list[list[str]] = [[] for _ in range(topology.world_size)]
        for option in plan:
            for shard in option.shards:
                assert shard.rank is not None
                used[shard.rank] = used[shard.rank] + (shard.storage or Storage())
                if option.name not in tables[shard.rank]:
                    tables[shard.rank].append(option.name)
        step = max(p.total for p in perfs)
        header = (
            f"tritonrec planner: {topology.world_size} ranks on {topology.compute_device} ({topology.num_hosts} "
            f"host{'s' if topology.num_hosts > 1 else ''}), batch size {batch_size} per rank, {len(plan)} tables; "
            f"{num_proposals} proposals, {num_plans} placed, {run_time_s:.2f} s\n"
            f"estimated step time {_ms(step)} ms (slowest rank); {kind} per rank: tables + reserved "
            f"{format_bytes(reserved)} of {format_bytes(capacity)}"
        )
        rank_rows = [
            [
                str(rank),
                format_bytes(used[rank].kind(kind)),
                f"{100 * (used[rank].kind(kind) + reserved) / capacity:.1f}" if capacity else "-",
                _ms(p.total),
                _ms(p.fwd_compute),
                _ms(p.fwd_comms),
                _ms(p.bwd_compute),
                _ms(p.bwd_comms),
                ", ".join(tables[rank]) or "-",
            ]
            for rank, p in enumerate(perfs)
        ]
        ranks = _table(
            [
                "rank",
                f"{kind} tables",
                "used %",
                "step ms",
                "fwd compute",
                "fwd comms",
                "bwd compute",
                "bwd comms",
                "tables",
            ],
            rank_rows,
        )
        table_rows = [
            [
                option.name,
                option.path or "-",
                option.sharding_type,
                option.compute_kernel,
                str(sorted({s.rank for s in option.shards if s.rank is not None})),
                format_bytes(option.total_storage.kind(kind)),
                _ms(max((s.perf or Perf()).total for s in option.shards)),
            ]
            for option in plan
        ]
        per_table = _table(
            ["table", "module", "sharding type", "kernel", "ranks", kind, "slowest shard ms"], table_rows
        )
        report = f"{header}\n\n{ranks}\n\n{per_table}"
        self.last_report = report
        if self._out is not None:
            self._out(report)
        return report
