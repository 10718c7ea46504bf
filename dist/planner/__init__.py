"""The sharding planner (torchrec's ``torchrec.distributed.planner`` names): it enumerates every way to shard every
table, estimates each shard's storage and step time with a perf model calibrated on this machine
(``python -m tritonrec.dist.planner.calibrate``), proposes, places and rates plans, and returns the fastest that
fits as a ``ShardingPlan``. Every sharding type is plannable on CPU and GPU alike.

    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"), batch_size=512)
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()])  # same plan on every rank
"""

from tritonrec.dist.planner.calibration import (
    DEFAULT_COEFFICIENTS,
    CommCoefficients,
    InputDistCoefficients,
    LookupCoefficients,
    PerfCoefficients,
    default_calibration_path,
    load_perf_coefficients,
)
from tritonrec.dist.planner.enumerators import EmbeddingEnumerator
from tritonrec.dist.planner.partitioners import GreedyPerfPartitioner
from tritonrec.dist.planner.perf_models import EmbeddingPerfModel, NoopPerfModel
from tritonrec.dist.planner.planners import CandidatePlan, EmbeddingShardingPlanner, to_sharding_plan
from tritonrec.dist.planner.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from tritonrec.dist.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from tritonrec.dist.planner.stats import EmbeddingStats
from tritonrec.dist.planner.storage_reservations import HeuristicalStorageReservation
from tritonrec.dist.planner.types import (
    DeviceHardware,
    ParameterConstraints,
    PartitionByType,
    Perf,
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
    Storage,
    Topology,
)

__all__ = [
    "DEFAULT_COEFFICIENTS",
    "CandidatePlan",
    "CommCoefficients",
    "DeviceHardware",
    "EmbeddingEnumerator",
    "EmbeddingPerfEstimator",
    "EmbeddingPerfModel",
    "EmbeddingShardingPlanner",
    "EmbeddingStats",
    "EmbeddingStorageEstimator",
    "GreedyPerfPartitioner",
    "GreedyProposer",
    "GridSearchProposer",
    "HeuristicalStorageReservation",
    "InputDistCoefficients",
    "LookupCoefficients",
    "NoopPerfModel",
    "ParameterConstraints",
    "PartitionByType",
    "Perf",
    "PerfCoefficients",
    "PlannerError",
    "PlannerErrorType",
    "Shard",
    "ShardingOption",
    "Storage",
    "Topology",
    "UniformProposer",
    "default_calibration_path",
    "load_perf_coefficients",
    "to_sharding_plan",
]
