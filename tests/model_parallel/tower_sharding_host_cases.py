"""Rank-side cases of tower sharding on 4 gloo ranks as 2 hosts of 2 (``LOCAL_WORLD_SIZE=2``): each tower's tables
are sharded over both ranks of its host (row-wise / column-wise inside the host) and its interaction is replicated
on them under ``DistributedDataParallel`` over the host's group. The model and the reference are
tower_sharding_cases.py's (each rank's interaction compared with the reference's, so both replicas of a host
must agree); this adds the topology."""

from __future__ import annotations

import os

from tests.model_parallel.tower_sharding_cases import run_training, tower_plan
from tests.model_parallel.tower_sharding_checkpoint_cases import run_checkpoint
from tests.model_parallel.tower_sharding_pipeline_cases import run_pipeline

LOCAL = 2


def two_hosts_of_two(rank: int, world: int) -> None:
    """Before the first node-group query (``intra_and_cross_node_pg`` caches its groups): 2 ranks per host."""
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    os.environ["LOCAL_RANK"] = str(rank % LOCAL)


# name -> rank-side case; run in this order in one spawn (the first sets the topology)
CASES = {
    "topology": two_hosts_of_two,
    "in_order": lambda rank, world: run_training(rank, world, (0, 1), steps=3, local=LOCAL),
    "swapped": lambda rank, world: run_training(rank, world, (1, 0), steps=2, local=LOCAL),
    "planner": lambda rank, world: run_training(rank, world, None, steps=3, local=LOCAL),
    "checkpoint": lambda rank, world: run_checkpoint(rank, world, local=LOCAL),
    "tower_sharder_checkpoint": lambda rank, world: run_checkpoint(rank, world, LOCAL, tower_plan, "tower"),
    "pipeline": lambda rank, world: run_pipeline(rank, world, local=LOCAL),
}
