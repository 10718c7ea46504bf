"""Shared features (one KJT key read by several tables) on 2 gloo ranks: the sharded EBC under every sharding type
(TW, RW, DP, CW, TWCW, TWRW and a mixed plan: dense forward / gradients under sum and mean pooling, 3 fused rowwise
Adagrad steps with weights), a variable batch per feature, the sharded EC (dense and 3 Adam steps, index dedup) and
the sharded feature-processed EBC, each against its unsharded module on the global batch. Outputs carry torchrec
1.8's embedding names in the unsharded order. Rank-side code: shared_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.shared_cases import SEQUENCE_KINDS, VBE_KINDS, ebc_shared_cases
from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist

# torchrec 1.8's names for t0 [f0, f1], t1 [f2, f1], t2 [f1, f3], t3 [f3]
EXPECTED_NAMES = ["f0", "f1@t0", "f2", "f1@t1", "f1@t2", "f3@t2", "f3@t3"]
TOLERANCE = 1e-6


def _results(case: str) -> list[dict]:
    per_rank = [results[case] for results in suite_results("shared", 2)]
    for rank, got in enumerate(per_rank):
        assert "error" not in got, f"rank {rank} raised:\n{got['error']}"
    return per_rank


@pytest.mark.parametrize("case", [c.name for c in ebc_shared_cases()])
def test_sharded_ebc_with_shared_features_matches_unsharded(case: str) -> None:
    for rank, got in enumerate(_results(f"ebc-{case}")):
        sharded_keys, unsharded_keys, same_lengths = got["keys"]
        assert sharded_keys == unsharded_keys == EXPECTED_NAMES, f"rank {rank}: keys {sharded_keys}"
        assert same_lengths, f"rank {rank}: length_per_key differs from the unsharded module's"
        assert got["forward"] <= TOLERANCE, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= TOLERANCE, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights after training differ by {got['weights']}"
        assert got["state"] <= 1e-5, f"rank {rank}: optimizer state after training differs by {got['state']}"


@pytest.mark.parametrize("kind", [kind for kind, _ in VBE_KINDS])
def test_variable_batch_with_shared_features_matches_expanded_batch(kind: str) -> None:
    for rank, got in enumerate(_results(f"vbe-{kind}")):
        assert got["keys"][0] == got["keys"][1] == EXPECTED_NAMES, f"rank {rank}: keys {got['keys'][0]}"
        assert got["forward"] <= TOLERANCE, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= TOLERANCE, f"rank {rank}: gradient differs by {got['grad']}"


@pytest.mark.parametrize(
    "case", [f"ec-{kind}-{what}" for kind in SEQUENCE_KINDS for what in ("dense", "ADAM")] + ["ec-row_wise-dedup"]
)
def test_sharded_ec_with_shared_features_matches_unsharded(case: str) -> None:
    for rank, got in enumerate(_results(case)):
        assert got["keys"][0] == got["keys"][1] == EXPECTED_NAMES, f"rank {rank}: keys {got['keys'][0]}"
        assert got["forward"] == 0.0, f"rank {rank}: rows differ by {got['forward']} (a gather: bit-exact)"
        assert got["lengths"] == 0.0, f"rank {rank}: output lengths differ from the input's"
        assert got["grad"] <= TOLERANCE, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights after training differ by {got['weights']}"


def test_sharded_feature_processed_ebc_with_shared_features_matches_unsharded() -> None:
    for rank, got in enumerate(_results("fp-mixed")):
        assert got["keys"][0] == got["keys"][1] == EXPECTED_NAMES, f"rank {rank}: keys {got['keys'][0]}"
        assert got["forward"] <= TOLERANCE, f"rank {rank}: forward differs by {got['forward']}"
        assert got["position_grad"] <= TOLERANCE, (
            f"rank {rank}: position-weight gradient differs by {got['position_grad']}"
        )
