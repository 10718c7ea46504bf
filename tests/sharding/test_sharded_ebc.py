"""ShardedEmbeddingBagCollection against the unsharded module on the same global batch, for every sharding type
(2 ranks; table-row-wise, grid and a subset on 4 ranks as 2 nodes x 2): forward and gradients at the same weights
(dense kernel, sum / mean / weighted pooling), weights and optimizer state after 10 fused steps of SGD, rowwise
Adagrad, Adam and per-element Adagrad. Global batches are split unevenly across ranks, have empty bags, dims 1/3/8/64
and a table with fewer rows than ranks; uneven row blocks (``row_wise(sizes_placement=...)``, ranks holding no rows
of a table) and uneven column blocks. Rank-side code: ebc_cases.py.
"""

from __future__ import annotations

import pytest

from tests.sharding.ebc_cases import TYPES_BY_WORLD, ebc_cases
from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist

# the lookup sums each bag in the same order as the unsharded module only when bags stay whole on one rank
EXACT_FORWARD = ("table_wise", "column_wise", "column_wise_uneven", "table_column_wise", "data_parallel")
CASES = [(case.name, world) for world, types in TYPES_BY_WORLD.items() for case in ebc_cases(types)]


@pytest.mark.parametrize(("case_name", "world"), CASES)
def test_sharded_ebc_matches_unsharded(case_name: str, world: int) -> None:
    kind = case_name.split("-")[0]
    for rank, results in enumerate(suite_results("ebc", world)):
        got = results[case_name]
        if kind in EXACT_FORWARD:
            assert got["forward"] == 0.0, f"rank {rank}: forward differs by {got['forward']} (bit-exact expected)"
        assert got["forward"] <= 1e-6, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= 1e-6, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights after training differ by {got['weights']}"
        assert got["state"] <= 1e-5, f"rank {rank}: optimizer state after training differs by {got['state']}"
