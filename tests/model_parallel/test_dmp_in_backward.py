"""``apply_optimizer_in_backward`` on a plain EBC's tables chooses the sharded tables' fused optimizer, as in torchrec
(rank-side code: in_backward_cases.py): DMP training on 2 ranks equals torch's own optimizer (or the unsharded fused
module for Adam) on the global batch, for table-wise, row-wise, column-wise and the planner's plan; the tables leave
the dense optimizer; what one fused module cannot honour is refused by name."""

from __future__ import annotations

import pytest

from tests.model_parallel.in_backward_cases import CASES
from tests.model_parallel.spawned import suite_results

WORLD = 2


def _results() -> list[dict]:
    return suite_results("in_backward", WORLD)


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_training_follows_the_in_backward_optimizer(case: str) -> None:
    kwargs = CASES[case][2]
    for rank, got in enumerate(r[case] for r in _results()):
        assert got["kernels"] == ["fused"], f"rank {rank}: {got['kernels']}"
        assert got["dense_names"] == [], f"rank {rank}: tables left in the dense optimizer {got['dense_names']}"
        assert got["loss"] < 1e-5 and got["tables"] < 1e-5 and got["state"] < 1e-5, f"rank {rank}: {got}"
        for group in got["fused_groups"]:
            assert group["lr"] == kwargs["lr"], f"rank {rank}: {group}"
            if "betas" in kwargs:
                assert tuple(group["betas"]) == kwargs["betas"], f"rank {rank}: {group}"


@pytest.mark.dist
def test_what_one_fused_module_cannot_honour_is_refused() -> None:
    for rank, got in enumerate(r["errors"] for r in _results()):
        assert got["mixed"].startswith("ValueError") and "t0" in got["mixed"] and "t2" in got["mixed"], got["mixed"]
        assert got["two_optimizers"].startswith("ValueError") and "2 optimizers" in got["two_optimizers"], rank
        assert got["momentum"].startswith("ValueError") and "momentum=0.9" in got["momentum"], got["momentum"]
        assert got["dense_kernel"].startswith("ValueError") and "compute_kernel='fused'" in got["dense_kernel"], rank
