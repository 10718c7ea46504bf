"""ShardedEmbeddingCollection on 2 gloo ranks against the unsharded EC on the same global batch: every sequence
sharding type (row-wise on CPU too, with even and uneven row blocks), dense forward and gradients, 10 fused steps of
SGD / rowwise Adagrad / Adam, index dedup, a mixed plan with dims 1/3/8/64, and the fp16 codec on the sequence
all-to-all. Rank-side code: ec_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.ec_cases import CODEC_KINDS, ec_cases
from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("case", [c.name for c in ec_cases()])
def test_sharded_ec_matches_unsharded(case: str) -> None:
    for rank, results in enumerate(suite_results("ec", 2)):
        got = results[case]
        assert got["forward"] == 0.0, f"rank {rank}: rows differ by {got['forward']} (a gather: bit-exact)"
        assert got["lengths"] == 0.0, f"rank {rank}: output lengths differ from the input's"
        assert got["grad"] <= 1e-6, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights after training differ by {got['weights']}"


@pytest.mark.parametrize("kind", CODEC_KINDS)
def test_sequence_codec_stays_within_fp16_bound(kind: str) -> None:
    for rank, results in enumerate(suite_results("ec", 2)):
        got = results["codecs"][kind]
        assert got["changed"], f"rank {rank}: the fp16 codec changed nothing: it is not on both wires"
        assert got["forward"] <= 1.0, f"rank {rank}: rows are off by {got['forward']:.2f}x half an fp16 ulp"


def test_uneven_column_blocks_are_refused_by_sequence_sharding() -> None:
    for rank, results in enumerate(suite_results("ec", 2)):
        got = results["uneven_refused"]
        assert "column_wise sequence sharding sends one row width" in got, f"rank {rank}: {got}"
        assert "widths [1, 2, 3, 4, 5, 7, 8]" in got and "size_per_rank" in got, f"rank {rank}: {got}"
