"""Sharded feature-processed EBC on 2 gloo ranks (mixed row-wise / table-wise / data-parallel / column-wise plan):
forward, table gradients and position-weight gradients equal the unsharded module's on the global batch, for a
PositionWeightedModuleCollection (one feature without weights) and per-feature PositionWeightedModules under mean
pooling. Rank-side code: fp_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.fp_cases import FP_CASES
from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("case", [name for name, _, _ in FP_CASES])
def test_feature_processed_ebc_matches_unsharded(case: str) -> None:
    for rank, results in enumerate(suite_results("fp", 2)):
        got = results[case]
        assert got["forward"] <= 1e-6, f"rank {rank}: forward differs by {got['forward']}"
        assert got["table_grad"] <= 1e-6, f"rank {rank}: table gradient differs by {got['table_grad']}"
        assert got["position_grad"] <= 1e-6, f"rank {rank}: position-weight gradient differs by {got['position_grad']}"
