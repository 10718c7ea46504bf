"""``TrainPipelineSparseDist`` over a model with a tower-sharded collection (2 gloo ranks, one per host; rank-side
code: tower_sharding_pipeline_cases.py, run in test_tower_sharding.py's spawn): the tower collection's input dist is
prefetched (no fallback) and 8 steps equal ``TrainPipelineBase``'s bit for bit, losses and every weight. The
``check_*`` helpers are shared with the 2-hosts-of-2 pipeline (test_tower_sharding_hosts_checkpoint.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.model_parallel.test_tower_sharding import results
from tests.model_parallel.tower_sharding_pipeline_cases import STEPS

pytestmark = pytest.mark.dist


def check_pipelined(got: list[Any]) -> None:
    for rank, result in enumerate(got):
        assert result["pipelined"] == ["tower_arch"], rank
        assert result["fallback_reason"] is None, f"rank {rank} fell back: {result['fallback_reason']}"


def check_bit_equal(got: list[Any]) -> None:
    for rank, result in enumerate(got):
        assert result["steps"] == STEPS, rank
        assert result["losses_equal"], f"rank {rank}: the pipelined losses differ from the base pipeline's"
    assert got[0]["keys_equal"] and got[0]["differing"] == [], f"weights differ: {got[0]['differing']}"
    assert len(got[0]["moved"]) == 12, f"only {got[0]['moved']} trained: the comparison would not test them all"


def test_the_tower_collection_is_pipelined_without_fallback() -> None:
    check_pipelined(results("pipeline"))


def test_sparse_dist_pipeline_equals_the_base_pipeline_bit_for_bit() -> None:
    check_bit_equal(results("pipeline"))
