"""Rank-side checks of the process-group helpers on 4 ranks laid out as 2 nodes x 2 ranks (torchrun's variables)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist import comm
from tritonrec.dist.side_groups import group_timeout


def _whoami(tag: str) -> str:
    return f"{tag} computed on global rank {dist.get_rank()}"


def run_pg_cases(rank: int, world: int) -> dict[str, Any]:
    assert world == 4
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    intra, cross = comm.intra_and_cross_node_pg()
    again = comm.intra_and_cross_node_pg()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=intra)
    decorated = comm.run_on_leader(dist.group.WORLD, 3)(_whoami)
    return {
        "local_size": comm.get_local_size(),
        "local_rank": comm.get_local_rank(),
        "group_rank": comm.get_group_rank(),
        "num_groups": comm.get_num_groups(),
        "intra_ranks": dist.get_process_group_ranks(intra),
        "cross_ranks": dist.get_process_group_ranks(cross),
        "cached": again[0] is intra and again[1] is cross,
        # the world's timeout, not new_group's default (30 minutes for gloo)
        "timeouts": [group_timeout(g) == group_timeout(dist.group.WORLD) is not None for g in (intra, cross)],
        "intra_sum": total.item(),
        "is_leader": comm.is_leader(dist.group.WORLD),
        "is_leader_of_intra_rank_1": comm.is_leader(intra, leader_rank=1),
        "broadcast": comm.invoke_on_rank_and_broadcast_result(dist.group.WORLD, 2, _whoami, "invoke"),
        # group rank 1 of a subgroup is a different global rank: the broadcast must translate it
        "broadcast_in_subgroup": comm.invoke_on_rank_and_broadcast_result(cross, 1, _whoami, "cross"),
        "decorated": decorated("leader"),
    }
