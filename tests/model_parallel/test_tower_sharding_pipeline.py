"""``TrainPipelineSparseDist`` over a model with a tower-sharded collection (2 gloo ranks, one per host; rank-side
code: tower_sharding_pipeline_cases.py, run in test_tower_sharding.py's spawn): the tower collection's input dist is
prefetched (no fallback) and 8 steps equal ``TrainPipelineBase``'s bit for bit, losses and every weight."""

from __future__ import annotations

import pytest

from tests.model_parallel.test_tower_sharding import results
from tests.model_parallel.tower_sharding_pipeline_cases import STEPS

pytestmark = pytest.mark.dist


def test_the_tower_collection_is_pipelined_without_fallback() -> None:
    for rank, got in enumerate(results("pipeline")):
        assert got["pipelined"] == ["tower_arch"], rank
        assert got["fallback_reason"] is None, f"rank {rank} fell back: {got['fallback_reason']}"


def test_sparse_dist_pipeline_equals_the_base_pipeline_bit_for_bit() -> None:
    got = results("pipeline")
    for rank, result in enumerate(got):
        assert result["steps"] == STEPS, rank
        assert result["losses_equal"], f"rank {rank}: the pipelined losses differ from the base pipeline's"
    assert got[0]["keys_equal"] and got[0]["differing"] == [], f"weights differ: {got[0]['differing']}"
    assert len(got[0]["moved"]) == 12, f"only {got[0]['moved']} trained: the comparison would not test them all"
