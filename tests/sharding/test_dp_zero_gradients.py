"""Data-parallel fused tables on 2 gloo ranks, rows whose gradient is exactly zero: a row the lookup read is
touched whatever its gradient (its upstream gradient is zero on the only rank that read it, or its gradients cancel
exactly across ranks), so weight decay and Adam's moments apply to it as in the unsharded module trained on the
global batch; both exchanges (sparse all-gather, dense all-reduce), SGD / rowwise Adagrad / per-element Adagrad with
weight decay and Adam with and without. Rank-side code: dp_zero_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.dp_zero_cases import cases
from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("case_name", list(cases()))
def test_rows_with_zero_gradient_are_updated_as_unsharded(case_name: str) -> None:
    for rank, results in enumerate(suite_results("dp_zero", 2)):
        got = results[case_name]
        assert got["zero_rows"] > 0 and got["moved"] > 0, f"rank {rank}: no zero-gradient row was exercised: {got}"
        assert got["weights"] <= 1e-6, f"rank {rank}: weights differ from the unsharded module by {got['weights']}"
        assert got["state"] <= 1e-6, f"rank {rank}: optimizer state differs by {got['state']}"
