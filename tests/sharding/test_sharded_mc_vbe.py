"""Variable batch per feature (VBE) through the sharded managed-collision EBC on 2 gloo ranks (torchrec 1.8 takes
it), against torchrec's sharded decomposition fed the same per-rank bags: remapped rows, pooled outputs expanded
with the inverse indices (SUM and MEAN), fused SGD updates and MCH state over a stream with evictions and one eval
step; the VBE inputs refused by name. Rank-side code: mc_vbe_cases.py (one spawn for the module)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.dist_utils import run_ranks
from tests.sharding.mc_cases import BATCH
from tests.sharding.mc_vbe_cases import run_vbe_suite

pytestmark = pytest.mark.dist


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(run_vbe_suite, 2, timeout=240.0)


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_vbe_training_stream_matches_reference(pooling: str) -> None:
    for rank, results in enumerate(_results()):
        got = results[pooling]
        assert got["shape"] == [BATCH, 11], f"rank {rank}: output {got['shape']} is not the expanded batch"
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} remapped-row mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: pooled output differs by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} MCH buffer mismatches"
        assert sum(got["open_slots"].values()) == 0, f"rank {rank}: tables never filled: {got['open_slots']}"


def test_vbe_over_hash_zch_tables_matches_unsharded_module() -> None:
    for rank, results in enumerate(_results()):
        got = results["hash_zch"]
        assert got["forward"] <= 1e-6, f"rank {rank}: pooled output differs by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after SGD"
        assert got["evicted"] > 0, f"rank {rank}: no TTL eviction"


def test_vbe_refusals_name_what_is_refused() -> None:
    for rank, results in enumerate(_results()):
        got = results["refusals"]
        assert got["remapped"].startswith("NotImplementedError") and "return_remapped_features" in got["remapped"]
        assert got["no_inverse"].startswith("ValueError") and "inverse_indices" in got["no_inverse"], got
        assert got["ec"].startswith("NotImplementedError") and "VBE" in got["ec"], f"rank {rank}: {got['ec']}"


def test_dedup_training_stream_matches_reference_fed_unique_ids() -> None:
    """use_index_dedup=True: torchrec's decomposition fed each source rank's unique ids per table (what dedup sends,
    so the MCH modules count an id once per rank), its rows expanded back to every occurrence."""
    for rank, results in enumerate(_results()):
        got = results["dedup"]["training"]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} remapped-row mismatches"
        assert got["lengths"] == 0, f"rank {rank}: {got['lengths']} sequence-length mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: sequence embeddings differ by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} MCH buffer mismatches"
        assert got["evicted"] > 0, f"rank {rank}: no batch handed a row to a new id"


@pytest.mark.parametrize("optim", ["SGD", "ADAGRAD"])
def test_dedup_equals_no_dedup_when_tables_hold_every_id(optim: str) -> None:
    for rank, results in enumerate(_results()):
        got = results["dedup"][f"equal_{optim}"]
        assert got["forward"] <= 1e-6, f"rank {rank}: outputs differ by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shards differ by {got['weights']}"
        assert got["sent"] < got["plain"], f"rank {rank}: dedup sent {got['sent']} ids, without {got['plain']}"


def test_dedup_with_return_remapped_features_refused() -> None:
    for results in _results():
        message = results["dedup"]["refusal"]
        assert "use_index_dedup" in message and "return_remapped_features" in message, message


def test_dedup_with_per_feature_ttl_refused() -> None:
    for results in _results():
        message = results["dedup"]["per_feature_refusal"]
        assert "use_index_dedup=True with PER_FEATURE_TTL_EVICTION tables ['t0']" in message, message
