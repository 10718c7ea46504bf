"""Sharded EBC on 2 gloo ranks, what rides on the wire: every quantized comm codec on every output dist (pooled
all-to-all, reduce-scatter, the two-stage table-row-wise dist) keeps forward values and gradients within its
documented bound and is really applied; variable batch per feature (VBE) for table-wise, row-wise, column-wise and
data-parallel tables equals the unsharded module on the expanded batch. Rank-side code: wire_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.spawned import suite_results
from tests.sharding.wire_cases import CODEC_PLANS, CODECS, VBE_CASES

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("plan", CODEC_PLANS)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_codecs_stay_within_their_bounds(plan: str, codec: str) -> None:
    for rank, results in enumerate(suite_results("wire", 2)):
        got = results["codecs"][f"{plan}-{codec}"]
        assert got["changed"], f"rank {rank}: the {codec} codec changed nothing: it is not on the wire"
        assert got["forward"] <= 1.0, f"rank {rank}: forward error is {got['forward']:.2f}x the {codec} bound"
        assert got["grad"] <= 1.0, f"rank {rank}: gradient error is {got['grad']:.2f}x the {codec} bound"


@pytest.mark.parametrize("case", [f"{k}-{p.lower()}-{o or 'dense'}" for k, p, o in VBE_CASES])
def test_variable_batch_per_feature_matches_expanded_batch(case: str) -> None:
    for rank, results in enumerate(suite_results("wire", 2)):
        got = results["vbe"][case]
        assert got["forward"] <= 1e-6, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= 1e-6, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights differ by {got['weights']}"
