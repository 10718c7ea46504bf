"""Placing a proposal on ranks: :class:`GreedyPerfPartitioner` (torchrec's name).

Options whose shards go to every rank (DP, RW) are placed first. The others are placed largest first (by estimated
time, or storage with ``sort_by="storage"``), each shard on the least loaded rank (estimated time so far, then used
storage, then rank) that still has room - longest-processing-time-first scheduling, which keeps the slowest rank
(the step time) close to the average. Host-bound options pick a host the same way: TWRW one host for all row shards,
GRID one host per column block, TWCW one host whose ranks take the column blocks. Column blocks of one table go to
different ranks (or hosts) while any with room is left. A tower's tables (options sharing a ``dependency``) are
placed as one unit: one host for all of them, its row shards and column blocks on that host's ranks.
"""

from __future__ import annotations

import copy

from tritonrec.dist.planner.types import (
    DeviceHardware,
    PartitionByType,
    Perf,
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
    Storage,
    Topology,
)
from tritonrec.dist.types import ShardingType

__all__ = ["GreedyPerfPartitioner"]


class GreedyPerfPartitioner:
    """See module docstring.

    Args:
        sort_by: ``"perf"`` (default) or ``"storage"``: which size orders the options, largest first.
    """

    def __init__(self, sort_by: str = "perf") -> None:
        if sort_by not in ("perf", "storage"):
            raise ValueError(f"sort_by must be 'perf' or 'storage', got sort_by={sort_by!r}")
        self._sort_by = sort_by

    def partition(self, proposal: list[ShardingOption], storage_constraint: Topology) -> list[ShardingOption]:
        """Copies of ``proposal``'s options with every shard's ``rank`` set. Raises ``PlannerError`` naming the table
        whose shard fits on no rank, with its need and the most free storage left."""
        topo = storage_constraint
        devices = [DeviceHardware(d.rank, copy.copy(d.storage), Perf()) for d in topo.devices]
        plan = [copy.deepcopy(option) for option in proposal]
        kind = topo.storage_kind
        size = (lambda o: o.total_perf) if self._sort_by == "perf" else (lambda o: o.total_storage.kind(kind))
        uniform = [o for o in plan if o.partition_by == PartitionByType.UNIFORM]
        # a tower's options (one ``dependency``) are placed as one unit on one host, as torchrec groups them; any
        # other option is a unit of its own (the same largest-first order as before for those)
        units: dict[str, list[ShardingOption]] = {}
        for option in plan:
            if option.partition_by != PartitionByType.UNIFORM:
                units.setdefault(option.dependency or f"\0{id(option)}", []).append(option)
        ordered = sorted(units.values(), key=lambda unit: sum(size(o) for o in unit), reverse=True)
        for option in uniform:
            for shard, device in zip(option.shards, devices, strict=True):
                if not self._fits(shard, device):
                    raise self._error(option, shard, devices, kind)
                self._place(shard, device)
        for unit in ordered:
            option = unit[0]
            if option.dependency is not None:
                self._place_tower(unit, devices, topo, kind)
            elif option.partition_by == PartitionByType.DEVICE:
                self._place_on_devices(option, option.shards, devices, kind)
            elif option.sharding_type == ShardingType.TABLE_COLUMN_WISE.value:
                host = self._pick_host(option, option.shards, devices, topo, kind, avoid=set(), whole_host=False)
                self._place_on_devices(option, option.shards, self._host_devices(host, devices, topo), kind)
            else:  # TWRW: one block of local-world-size row shards; GRID: one such block per column block
                used: set[int] = set()
                local = topo.local_world_size
                for start in range(0, option.num_shards, local):
                    block = option.shards[start : start + local]
                    host = self._pick_host(option, block, devices, topo, kind, avoid=used, whole_host=True)
                    used.add(host)
                    for shard, device in zip(block, self._host_devices(host, devices, topo), strict=True):
                        self._place(shard, device)
        return plan

    def _place_tower(
        self, options: list[ShardingOption], devices: list[DeviceHardware], topo: Topology, kind: str
    ) -> None:
        """Every table of one tower on one host: the least loaded whose ranks' free storage holds all the tower's
        shards; table-row-wise row shards on the host's ranks in order, column blocks each on the least loaded of
        its ranks."""
        shards = [shard for option in options for shard in option.shards]
        try:
            host = self._pick_host(options[0], shards, devices, topo, kind, avoid=set(), whole_host=False)
        except PlannerError as err:
            tables = [o.name for o in options]
            raise PlannerError(f"tower {options[0].dependency!r} (tables {tables}) fits on no host: {err}") from None
        local = self._host_devices(host, devices, topo)
        for option in options:
            if option.sharding_type != ShardingType.TABLE_ROW_WISE.value:
                self._place_on_devices(option, option.shards, local, kind)
                continue
            for shard, device in zip(option.shards, local, strict=True):
                if not self._fits(shard, device):
                    raise self._error(option, shard, devices, kind)
                self._place(shard, device)

    @staticmethod
    def _fits(shard: Shard, device: DeviceHardware) -> bool:
        return (shard.storage or Storage()).fits_in(device.storage)

    @staticmethod
    def _place(shard: Shard, device: DeviceHardware) -> None:
        shard.rank = device.rank
        device.storage = device.storage - (shard.storage or Storage())
        device.perf = device.perf + (shard.perf or Perf())

    @staticmethod
    def _load(device: DeviceHardware, kind: str) -> tuple[float, int, int]:
        return (device.perf.total, -device.storage.kind(kind), device.rank)

    def _place_on_devices(
        self, option: ShardingOption, shards: list[Shard], devices: list[DeviceHardware], kind: str
    ) -> None:
        used: set[int] = set()
        for shard in shards:
            fitting = [d for d in devices if self._fits(shard, d)]
            if not fitting:
                raise self._error(option, shard, devices, kind)
            fresh = [d for d in fitting if d.rank not in used] or fitting
            device = min(fresh, key=lambda d: self._load(d, kind))
            self._place(shard, device)
            used.add(device.rank)

    @staticmethod
    def _host_devices(host: int, devices: list[DeviceHardware], topo: Topology) -> list[DeviceHardware]:
        return devices[host * topo.local_world_size : (host + 1) * topo.local_world_size]

    def _pick_host(
        self,
        option: ShardingOption,
        shards: list[Shard],
        devices: list[DeviceHardware],
        topo: Topology,
        kind: str,
        avoid: set[int],
        whole_host: bool,
    ) -> int:
        """The least loaded host that can take ``shards`` (shard ``i`` on local rank ``i`` with ``whole_host``;
        otherwise total need within the host's total free storage)."""
        candidates = []
        for host in range(topo.num_hosts):
            local = self._host_devices(host, devices, topo)
            if whole_host:
                fits = all(self._fits(s, d) for s, d in zip(shards, local, strict=True))
            else:
                need = sum((s.storage or Storage() for s in shards), Storage())
                fits = need.fits_in(sum((d.storage for d in local), Storage()))
            if fits:
                load = sum(d.perf.total for d in local)
                candidates.append((host in avoid, load, host))
        if not candidates:
            raise self._error(option, max(shards, key=lambda s: (s.storage or Storage()).kind(kind)), devices, kind)
        return min(candidates)[2]

    @staticmethod
    def _error(option: ShardingOption, shard: Shard, devices: list[DeviceHardware], kind: str) -> PlannerError:
        need = (shard.storage or Storage()).kind(kind)
        free = max(d.storage.kind(kind) for d in devices)
        return PlannerError(
            f"cannot place table {option.name!r} ({option.sharding_type}, {option.compute_kernel}): a shard of "
            f"{shard.size[0]} x {shard.size[1]} needs {need} bytes of {kind}, but the rank with the most free "
            f"{kind} has {free} bytes left",
            PlannerErrorType.PARTITION,
        )
