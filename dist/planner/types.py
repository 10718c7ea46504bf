"""The planner's vocabulary (torchrec's ``torchrec.distributed.planner.types`` names): storage and perf of one shard,
the hardware (:class:`Topology`), user constraints per table (:class:`ParameterConstraints`), one candidate placement
of one table (:class:`ShardingOption`) and :class:`PlannerError`.

Units: storage in bytes, times in seconds, bandwidths in bytes per second.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tritonrec.dist.planner.calibration import PerfCoefficients, load_perf_coefficients
from tritonrec.dist.types import EmbeddingComputeKernel, ModuleSharder, ShardingType
from tritonrec.kernels.checks import check_int

GIB = 1024**3
HBM_CAP = 32 * GIB  # torchrec's defaults: pass the real capacities of your machines
DDR_CAP = 128 * GIB
POOLING_FACTOR = 1.0  # ids per sample and feature when the constraints do not say
BATCH_SIZE = 512  # samples per rank
MIN_CW_DIM = 32  # narrowest column-wise shard the enumerator proposes unless ParameterConstraints.min_partition says

__all__ = [
    "BATCH_SIZE",
    "DDR_CAP",
    "HBM_CAP",
    "DeviceHardware",
    "ParameterConstraints",
    "PartitionByType",
    "Perf",
    "PlannerError",
    "PlannerErrorType",
    "Shard",
    "ShardingOption",
    "Storage",
    "Topology",
]


@dataclass
class Storage:
    """Bytes in GPU memory (``hbm``) and host memory (``ddr``)."""

    hbm: int = 0
    ddr: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(self.hbm + other.hbm, self.ddr + other.ddr)

    def __sub__(self, other: Storage) -> Storage:
        return Storage(self.hbm - other.hbm, self.ddr - other.ddr)

    def fits_in(self, other: Storage) -> bool:
        return self.hbm <= other.hbm and self.ddr <= other.ddr

    def kind(self, name: str) -> int:
        return self.hbm if name == "hbm" else self.ddr


@dataclass
class Perf:
    """Estimated seconds per training step, split as torchrec does."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0

    @property
    def total(self) -> float:
        return self.fwd_compute + self.fwd_comms + self.bwd_compute + self.bwd_comms

    def __add__(self, other: Perf) -> Perf:
        return Perf(
            self.fwd_compute + other.fwd_compute,
            self.fwd_comms + other.fwd_comms,
            self.bwd_compute + other.bwd_compute,
            self.bwd_comms + other.bwd_comms,
        )


@dataclass
class DeviceHardware:
    """One rank: its free storage and the perf of what the partitioner placed on it so far."""

    rank: int
    storage: Storage
    perf: Perf = field(default_factory=Perf)


def _check_positive_int(name: str, value: object) -> int:
    return check_int(value, name, 1)


def _check_bytes(name: str, value: object) -> int:
    return check_int(value, name, 0, what="a non-negative int (bytes)")


def _check_bandwidth(name: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a positive finite number (bytes/s), got {name}={value!r}")
    return float(value)  # type: ignore[arg-type]


class Topology:
    """The machines a plan runs on (torchrec's fields; bandwidths in bytes/s).

    Args:
        world_size: number of ranks.
        compute_device: ``"cpu"`` (tables in host memory: ``ddr_cap`` counts) or ``"cuda"`` (``hbm_cap`` counts).
        hbm_cap / ddr_cap: bytes per rank (defaults: 32 GiB HBM on cuda, 0 on cpu; 128 GiB DDR).
        local_world_size: ranks per host (default: all ranks on one host).
        intra_host_bw / inter_host_bw: link bandwidth between ranks of one host / across hosts. Default: the
            calibration's measured all-to-all bandwidth (intra) and its documented inter-host value.
        calibration: :class:`PerfCoefficients`, a JSON path written by ``python -m tritonrec.dist.planner.calibrate``,
            or ``None`` for :func:`load_perf_coefficients`'s default lookup (``$TRITONREC_PLANNER_CALIBRATION``, the
            default file, else the documented defaults).
    """

    def __init__(
        self,
        world_size: int,
        compute_device: str = "cuda",
        hbm_cap: int | None = None,
        ddr_cap: int | None = None,
        local_world_size: int | None = None,
        intra_host_bw: float | None = None,
        inter_host_bw: float | None = None,
        calibration: PerfCoefficients | str | Path | None = None,
    ) -> None:
        self.world_size = _check_positive_int("world_size", world_size)
        if compute_device not in ("cpu", "cuda"):
            raise ValueError(f"compute_device must be 'cpu' or 'cuda', got compute_device={compute_device!r}")
        self.compute_device = compute_device
        self.local_world_size = _check_positive_int("local_world_size", local_world_size or world_size)
        if world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size must divide world_size {world_size}, got local_world_size={local_world_size!r}"
            )
        default_hbm = HBM_CAP if compute_device == "cuda" else 0
        self.hbm_cap = _check_bytes("hbm_cap", default_hbm if hbm_cap is None else hbm_cap)
        self.ddr_cap = _check_bytes("ddr_cap", DDR_CAP if ddr_cap is None else ddr_cap)
        if isinstance(calibration, PerfCoefficients):
            self.coefficients = calibration
        else:
            self.coefficients = load_perf_coefficients(calibration, compute_device)
        coeffs = self.coefficients
        self.intra_host_bw = _check_bandwidth(
            "intra_host_bw", coeffs.comms["all_to_all"].bytes_per_s if intra_host_bw is None else intra_host_bw
        )
        self.inter_host_bw = _check_bandwidth(
            "inter_host_bw", coeffs.inter_host_bw if inter_host_bw is None else inter_host_bw
        )
        self.devices = [DeviceHardware(r, Storage(self.hbm_cap, self.ddr_cap)) for r in range(world_size)]

    @property
    def storage_kind(self) -> str:
        """Where tables live: ``"hbm"`` on cuda, ``"ddr"`` on cpu."""
        return "hbm" if self.compute_device == "cuda" else "ddr"

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def copy(self) -> Topology:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self.world_size}, compute_device={self.compute_device!r}, "
            f"local_world_size={self.local_world_size}, hbm_cap={self.hbm_cap}, ddr_cap={self.ddr_cap}, "
            f"intra_host_bw={self.intra_host_bw:.3g}, inter_host_bw={self.inter_host_bw:.3g})"
        )


def _check_per_feature(name: str, values: list[Any] | None, positive_int: bool = False) -> list[Any] | None:
    if values is None:
        return None
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name} must be a non-empty list (one entry per feature), got {name}={values!r}")
    if positive_int:
        return [_check_positive_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
    for v in values:
        # numbers.Real: numpy scalars too (a bool is no number here)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must hold finite non-negative numbers, got {name}={values!r}")
    return list(values)


@dataclass
class ParameterConstraints:
    """What the user knows or wants for one table (torchrec's fields; the lists hold one entry per feature).

    Args:
        sharding_types: the only sharding types to consider (``ShardingType`` values).
        compute_kernels: the only compute kernels to consider (``EmbeddingComputeKernel`` values).
        min_partition: narrowest column shard for CW / TWCW / GRID (default 32 columns).
        pooling_factors: mean ids per sample of each feature (default 1.0).
        num_poolings: bags per sample of each feature (default 1).
        batch_sizes: samples per rank of each feature (default: the planner's batch size).
        is_weighted: the feature carries per-id weights (more input bytes).
        stochastic_rounding / bounds_check_mode: copied into the table's ``ParameterSharding``.
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] = field(default_factory=lambda: [POOLING_FACTOR])
    num_poolings: list[float] | None = None
    batch_sizes: list[int] | None = None
    is_weighted: bool = False
    stochastic_rounding: bool | None = None
    bounds_check_mode: Any = None

    def __post_init__(self) -> None:
        for name in ("sharding_types", "compute_kernels"):  # a bare string would be read as its characters
            value = getattr(self, name)
            if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)):
                raise TypeError(f"{name} must be a list, got {name}={value!r}")
        if self.sharding_types is not None:
            known = {t.value for t in ShardingType}
            self.sharding_types = [t.value if isinstance(t, ShardingType) else t for t in self.sharding_types]
            bad = [t for t in self.sharding_types if t not in known]
            if bad or not self.sharding_types:
                raise ValueError(f"sharding_types must be non-empty values of {sorted(known)}, got {bad or '[]'}")
        if self.compute_kernels is not None:
            known = {k.value for k in EmbeddingComputeKernel}
            self.compute_kernels = [
                k.value if isinstance(k, EmbeddingComputeKernel) else k for k in self.compute_kernels
            ]
            bad = [k for k in self.compute_kernels if k not in known]
            if bad or not self.compute_kernels:
                raise ValueError(f"compute_kernels must be non-empty values of {sorted(known)}, got {bad or '[]'}")
        if self.min_partition is not None:
            self.min_partition = _check_positive_int("min_partition", self.min_partition)
        self.pooling_factors = _check_per_feature("pooling_factors", self.pooling_factors)  # type: ignore[assignment]
        self.num_poolings = _check_per_feature("num_poolings", self.num_poolings)
        self.batch_sizes = _check_per_feature("batch_sizes", self.batch_sizes, positive_int=True)
        for name in ("num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.pooling_factors):
                raise ValueError(
                    f"{name} has {len(values)} entries but pooling_factors has {len(self.pooling_factors)} "
                    "(one per feature each)"
                )


class PartitionByType(enum.Enum):
    """How the partitioner places an option's shards: on every rank (``uniform``: DP, RW), on the ranks of chosen
    hosts (``host``: TWRW, TWCW, GRID), or shard by shard on any rank (``device``: TW, CW)."""

    UNIFORM = "uniform"
    HOST = "host"
    DEVICE = "device"


_PARTITION_BY = {
    ShardingType.DATA_PARALLEL.value: PartitionByType.UNIFORM,
    ShardingType.ROW_WISE.value: PartitionByType.UNIFORM,
    ShardingType.TABLE_ROW_WISE.value: PartitionByType.HOST,
    ShardingType.TABLE_COLUMN_WISE.value: PartitionByType.HOST,
    ShardingType.GRID_SHARD.value: PartitionByType.HOST,
    ShardingType.TABLE_WISE.value: PartitionByType.DEVICE,
    ShardingType.COLUMN_WISE.value: PartitionByType.DEVICE,
}


@dataclass
class Shard:
    """One shard of a :class:`ShardingOption`: ``[rows, cols]`` at global ``[row, col]``; ``rank`` once placed."""

    size: list[int]
    offset: list[int]
    storage: Storage | None = None
    perf: Perf | None = None
    rank: int | None = None


@dataclass
class ShardingOption:
    """One way to shard one table: a sharding type, a compute kernel and its shards (with estimates once the
    estimators ran and ranks once the partitioner placed it).

    ``input_lengths`` / ``num_poolings`` / ``batch_sizes`` hold one entry per feature reading the table;
    ``num_column_shards`` is the column-block count of CW / TWCW / GRID (``None`` otherwise); ``optimizer`` the fused
    rule whose state a ``fused`` shard carries (an ``OptimType``, ``None`` when unknown); ``dependency`` the tower
    (``<path>`` or ``<path>.tower_<i>``) whose tables must share a host, ``None`` for a table placed on its own.
    """

    name: str
    tensor: torch.Tensor
    module: tuple[str, nn.Module]
    sharder: ModuleSharder[Any]
    sharding_type: str
    compute_kernel: str
    shards: list[Shard]
    input_lengths: list[float]
    num_poolings: list[float]
    batch_sizes: list[int]
    is_pooled: bool = True
    is_weighted: bool = False
    num_column_shards: int | None = None
    output_dim: int | None = None
    optimizer: Any = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: Any = None
    # torchrec's ``dependency``: options sharing one (a tower's tables) are placed on one host together
    dependency: str | None = None

    @property
    def path(self) -> str:
        return self.module[0]

    @property
    def fqn(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name

    @property
    def partition_by(self) -> PartitionByType:
        return _PARTITION_BY[self.sharding_type]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def total_storage(self) -> Storage:
        return sum((s.storage or Storage() for s in self.shards), Storage())

    @property
    def total_perf(self) -> float:
        return sum((s.perf or Perf()).total for s in self.shards)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardingOption:
        """Copy the shards, share the module, tensor and sharder (a plan is copied per proposal)."""
        out = copy.copy(self)
        out.shards = [copy.copy(s) for s in self.shards]
        return out


class PlannerErrorType(enum.Enum):
    """Why planning failed (torchrec's classes)."""

    INSUFFICIENT_STORAGE = "insufficient_storage"
    STRICT_CONSTRAINTS = "strict_constraints"
    PARTITION = "partition"
    OTHER = "other"


class PlannerError(Exception):
    """No plan: the message names the table, what it needs and what the ranks hold."""

    def __init__(self, message: str, error_type: PlannerErrorType = PlannerErrorType.OTHER) -> None:
        self.error_type = error_type
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # broadcast to the other ranks by collective_plan
        return (PlannerError, (str(self), self.error_type))
