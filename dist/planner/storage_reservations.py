"""Storage the tables may not use: a share kept free for everything the planner does not model (allocator slack,
activations of the dense layers, communication buffers) and the dense part of the model, which every rank holds
(data parallel) with its gradient and optimizer state."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from tritonrec.dist.planner.enumerators import check_sharders, shardable_modules
from tritonrec.dist.planner.types import ParameterConstraints, PlannerError, PlannerErrorType, Storage, Topology
from tritonrec.dist.types import ModuleSharder
from tritonrec.kernels.checks import check_optional_int

__all__ = ["HeuristicalStorageReservation", "Reservation", "dense_bytes"]


def dense_bytes(module: nn.Module, sharders: list[ModuleSharder[Any]]) -> int:
    """Bytes of the parameters and buffers no sharder covers (those replicated on every rank)."""
    sharded = {
        id(param)
        for _, child, sharder in shardable_modules(module, sharders)
        for param in sharder.shardable_parameters(child).values()
    }
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()] if id(t) not in sharded}
    return sum(t.nelement() * t.element_size() for t in tensors.values())


@dataclass
class Reservation:
    """What was reserved on each rank: ``percentage`` of its capacity plus the dense part."""

    percentage_bytes: int
    dense_bytes: int

    @property
    def total(self) -> int:
        return self.percentage_bytes + self.dense_bytes


class HeuristicalStorageReservation:
    """Reserves ``percentage`` of each rank's table storage plus ``parameter_multiplier`` x the dense parameters'
    bytes (weights, gradient, two Adam moments, DDP buckets, slack: 6x by default, torchrec's heuristic).

    Args:
        percentage: share of each rank's capacity kept free, in ``[0, 1)``.
        parameter_multiplier: factor on the dense parameters' bytes.
        dense_tensor_estimate: bytes of the dense part, if you know better than the module's parameters.
    """

    def __init__(
        self, percentage: float = 0.15, parameter_multiplier: float = 6.0, dense_tensor_estimate: int | None = None
    ) -> None:
        if isinstance(percentage, bool) or not isinstance(percentage, (int, float)) or not 0 <= percentage < 1:
            raise ValueError(f"percentage must be a number in [0, 1), got percentage={percentage!r}")
        ok = isinstance(parameter_multiplier, (int, float)) and not isinstance(parameter_multiplier, bool)
        if not ok or not math.isfinite(parameter_multiplier) or parameter_multiplier < 0:
            raise ValueError(f"parameter_multiplier must be a non-negative number, got {parameter_multiplier!r}")
        dense_tensor_estimate = check_optional_int(dense_tensor_estimate, "dense_tensor_estimate", 0)
        self._percentage = float(percentage)
        self._multiplier = float(parameter_multiplier)
        self._dense_estimate = dense_tensor_estimate
        self.last_reservation: Reservation | None = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[ModuleSharder[Any]],
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> Topology:
        """A copy of ``topology`` whose ranks hold only what the tables may use."""
        sharders = check_sharders(sharders)
        kind = topology.storage_kind
        capacity = topology.hbm_cap if kind == "hbm" else topology.ddr_cap
        dense = self._dense_estimate if self._dense_estimate is not None else dense_bytes(module, sharders)
        reservation = Reservation(round(self._percentage * capacity), round(self._multiplier * dense))
        if reservation.total > capacity:
            raise PlannerError(
                f"the storage reservation needs {reservation.total} bytes of {kind} per rank "
                f"({self._percentage:.0%} of capacity = {reservation.percentage_bytes} + dense parameters "
                f"{dense} x {self._multiplier:g} = {reservation.dense_bytes}) but a rank holds {capacity} bytes",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        reserved = Storage(hbm=reservation.total) if kind == "hbm" else Storage(ddr=reservation.total)
        out = topology.copy()
        for device in out.devices:
            device.storage = device.storage - reserved
        self.last_reservation = reservation
        return out
