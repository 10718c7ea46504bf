"""DLRM under DistributedModelParallel equals the single-process DLRM trained on the global batch: 10 steps with an
explicit table-wise, row-wise, column-wise, table-row-wise or data-parallel plan, or the planner's plan (2 ranks; a
4-rank subset as 2 nodes x 2); on 2 ranks also a DLRM whose tables share a feature (a mixed plan and the planner's),
whose gathered state dict is the trained single-process one. Loss, every weight (dense layers and each rank's table
shards), the fused rowwise Adagrad state and the dense SGD momentum agree within 1e-5. Rank-side code: dlrm_cases.py.
"""

from __future__ import annotations

import pytest

from tests.model_parallel.dlrm_cases import KINDS_BY_WORLD
from tests.model_parallel.spawned import suite_results

pytestmark = pytest.mark.dist

CASES = [(kind, world) for world, kinds in KINDS_BY_WORLD.items() for kind in kinds]
EXPECTED_TYPES = {
    "tw": ["table_wise"],
    "rw": ["row_wise"],
    "cw": ["column_wise"],
    "twrw": ["table_row_wise"],
    "dp": ["data_parallel"],
}
TOLERANCE = 1e-5


@pytest.mark.parametrize(("kind", "world"), CASES)
def test_dmp_trains_like_the_single_process_model(kind: str, world: int) -> None:
    results = [r[kind] for r in suite_results("dlrm", world)]
    for rank, got in enumerate(results):
        if kind in EXPECTED_TYPES:
            assert got["types"] == EXPECTED_TYPES[kind], f"rank {rank}: the plan has {got['types']}"
        for what in ("loss", "dense", "tables", "fused_state", "dense_state"):
            assert got[what] <= TOLERANCE, f"rank {rank}: {what} differs by {got[what]} after 10 steps"
    assert len({r["plan"] for r in results}) == 1, "the ranks sharded by different plans"
    if kind.startswith("shared-"):  # torchrec 1.8's names: f_t1 is read by t0, t1 and t3
        names = ["f_t0", "f_t1@t0", "f_t1@t1", "f_t2", "f_t3", "f_t1@t3"]
        assert all(r["sparse_names"] == names for r in results), results[0]["sparse_names"]
        assert results[0]["state_dict_keys"], "the gathered state dict has other keys than the unsharded model's"
        assert results[0]["state_dict"] <= TOLERANCE, f"the gathered tables differ by {results[0]['state_dict']}"
