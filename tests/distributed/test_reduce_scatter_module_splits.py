"""``PooledEmbeddingsReduceScatter(pg)(local_embs, input_splits)`` with equal ``input_splits`` that do not add up to
``local_embs``' rows: a ``ValueError`` naming ``input_splits`` on every rank (it silently split the rows evenly,
ignoring ``input_splits``, before), also when only one rank's call is wrong (its peers must not hang), and the group
stays usable afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.spawned import spawn_ranks
from tritonrec.dist.embedding_dist import PooledEmbeddingsReduceScatter

pytestmark = pytest.mark.dist


def _error_of(call: Any) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _rank_side(rank: int, world: int) -> dict[str, Any]:
    module = PooledEmbeddingsReduceScatter(dist.group.WORLD)
    x = torch.arange(8.0).view(4, 2) + rank
    return {
        "all_wrong": _error_of(lambda: module(x, [1] * world).wait()),
        "rank0_wrong": _error_of(lambda: module(x, [1, 1] if rank == 0 else [2, 2]).wait()),
        "after": module(x, [2, 2]).wait().tolist(),
    }


def test_equal_splits_that_do_not_cover_the_rows_raise_on_every_rank() -> None:
    results = spawn_ranks(_rank_side, 2, timeout=120.0)
    for rank, result in enumerate(results):
        assert "local_embs has 4 rows but sum(input_splits) = 2 (input_splits=[1, 1])" in result["all_wrong"], rank
        assert "sum(input_splits) = 2" in result["rank0_wrong"], (rank, result["rank0_wrong"])  # rank 1: rank 0's
        expected = (torch.arange(8.0).view(4, 2) * 2 + 1)[2 * rank : 2 * rank + 2].tolist()
        assert result["after"] == expected, rank
