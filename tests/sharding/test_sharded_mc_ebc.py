"""Sharded managed-collision EBC (row-wise) on 2 gloo ranks against torchrec's decomposition written out (per table
one rebuilt MCH module per rank over its raw-id range, one unsharded EBC): remapped rows, pooled outputs (SUM and
MEAN), fused SGD updates and MCH state over a stream of batches with inserts and evictions (rows handed to new ids
redrawn with ``init_fn``, as torchrec's sharded module) and one eval step; the state dict (torchrec's keys,
``ShardedTensor`` buffers) round trip; non-row-wise plans refused by table name. The same for the sharded MC-EC
(sequence embeddings per feature, each rank's samples). The reset of evicted rows' fused optimizer state (rowwise
Adagrad, Adam). Rank-side code: mc_cases.py, mc_ec_cases.py and mc_reset_cases.py (one spawn for the module)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.dist_utils import run_ranks
from tests.sharding.mc_cases import run_suite

pytestmark = pytest.mark.dist

MC = "_managed_collision_collection._managed_collision_modules"


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(run_suite, 2, timeout=240.0)


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_training_stream_matches_reference(pooling: str) -> None:
    for rank, results in enumerate(_results()):
        got = results[pooling]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} remapped-row mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: pooled output differs by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} MCH buffer mismatches"
        assert sum(got["open_slots"].values()) == 0, f"rank {rank}: tables never filled: {got['open_slots']}"


@pytest.mark.parametrize("suite", ["ebc", "ec"])
def test_return_remapped_features_gives_each_rank_its_samples_rows(suite: str) -> None:
    """return_remapped_features=True: each rank gets the reference's remapped rows of its own samples (training
    stream with evictions, one eval step), and the embeddings equal those of the False case bit for bit."""
    for rank, results in enumerate(_results()):
        got, plain = (results["SUM_remapped"], results["SUM"]) if suite == "ebc" else (
            results["ec"]["training_remapped"], results["ec"]["training"])  # fmt: skip
        assert got["returned"] == 0, f"rank {rank}: {got['returned']} returned remapped KJT mismatches"
        assert plain["returned"] == 0
        assert got["rows"] == 0 and got["state"] == 0 and got["forward"] <= 1e-6, f"rank {rank}: {got}"
        flat = [t for step in got["outputs"] for t in (step if isinstance(step, list) else [step])]
        want = [t for step in plain["outputs"] for t in (step if isinstance(step, list) else [step])]
        assert len(flat) == len(want) > 0
        assert all(a.equal(b) for a, b in zip(flat, want, strict=True)), f"rank {rank}: embeddings changed"


def test_state_dict_keys_and_round_trip() -> None:
    for rank, results in enumerate(_results()):
        got = results["state"]
        expected_sharded = sorted(
            [f"_embedding_module.embedding_bags.{t}.weight" for t in ("t0", "t1")]
            + [f"{MC}.t0.{b}" for b in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts")]
            + [f"{MC}.t1.{b}" for b in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter")]
        )
        assert got["sharded_keys"] == expected_sharded, f"rank {rank}: {got['sharded_keys']}"
        local = [f"{MC}.{t}.{b}" for t in ("t0", "t1") for b in ("_output_segments_tensor", "_current_iter_tensor")]
        assert sorted(got["keys"]) == sorted(expected_sharded + local)
        assert got["sizes"][f"{MC}.t0._mch_sorted_raw_ids"] == [10]
        assert got["sizes"][f"{MC}.t1._mch_remapped_ids_mapping"] == [8]
        assert got["round_trip"], f"rank {rank}: state dict changed through load_state_dict"
        assert got["after_load"] == 0.0, f"rank {rank}: loaded module's output differs by {got['after_load']}"


def test_non_row_wise_plans_refused_by_table_name() -> None:
    for results in _results():
        messages = results["refusals"]
        assert set(messages) == {"plan", "shard"}, messages
        assert all("t1" in m for m in messages.values()), messages
        assert "row-wise" in messages["shard"]


def test_distributed_model_parallel_trains_a_model_holding_it() -> None:
    for rank, results in enumerate(_results()):
        got = results["dmp"]
        assert got["kinds"] == ["row_wise"], f"rank {rank}: the planner proposed {got['kinds']}"
        assert got["loss"] <= 1e-6, f"rank {rank}: DMP's loss differs from the hand-sharded module's by {got['loss']}"


def test_ec_training_stream_matches_reference() -> None:
    for rank, results in enumerate(_results()):
        got = results["ec"]["training"]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} remapped-row mismatches"
        assert got["lengths"] == 0, f"rank {rank}: {got['lengths']} sequence-length mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: sequence embeddings differ by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} MCH buffer mismatches"
        assert got["evicted"] > 0, f"rank {rank}: no batch handed a row to a new id"
        assert sum(got["open_slots"].values()) == 0, f"rank {rank}: tables never filled: {got['open_slots']}"


def test_ec_state_dict_keys_and_round_trip() -> None:
    for rank, results in enumerate(_results()):
        got = results["ec"]["state"]
        expected_sharded = sorted(
            [f"_embedding_module.embeddings.{t}.weight" for t in ("t0", "t1")]
            + [f"{MC}.t0.{b}" for b in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts")]
            + [f"{MC}.t1.{b}" for b in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter")]
        )
        assert got["sharded_keys"] == expected_sharded, f"rank {rank}: {got['sharded_keys']}"
        local = [f"{MC}.{t}.{b}" for t in ("t0", "t1") for b in ("_output_segments_tensor", "_current_iter_tensor")]
        assert sorted(got["keys"]) == sorted(expected_sharded + local)
        assert got["sizes"]["_embedding_module.embeddings.t1.weight"] == [8, 4]
        assert got["sizes"][f"{MC}.t0._mch_sorted_raw_ids"] == [10]
        assert got["round_trip"], f"rank {rank}: state dict changed through load_state_dict"
        assert got["after_load"] == 0.0, f"rank {rank}: loaded module's output differs by {got['after_load']}"


def test_ec_non_row_wise_plans_refused_by_table_name() -> None:
    for results in _results():
        messages = results["ec"]["refusals"]
        assert set(messages) == {"plan", "shard"}, messages
        assert all("t1" in m for m in messages.values()), messages
        assert "row-wise" in messages["shard"]


def test_ec_distributed_model_parallel_trains_a_model_holding_it() -> None:
    for rank, results in enumerate(_results()):
        got = results["ec"]["dmp"]
        assert got["kinds"] == ["row_wise"], f"rank {rank}: the planner proposed {got['kinds']}"
        assert got["loss"] <= 1e-6, f"rank {rank}: DMP's loss differs from the hand-sharded module's by {got['loss']}"


def test_sparse_dist_pipeline_pipelines_it_and_trains_as_the_base_pipeline() -> None:
    for rank, results in enumerate(_results()):
        got = results["pipeline"]
        assert got["pipelined"] == ["mc"], f"rank {rank}: pipelined {got['pipelined']}"
        assert got["losses_equal"], f"rank {rank}: the pipelined losses differ from TrainPipelineBase's"
        assert got["state_differs"] == [], f"rank {rank}: state differs in {got['state_differs']}"


def test_semi_sync_pipeline_runs_it_synchronously_and_stale() -> None:
    """TrainPipelineSemiSync over the MC-EBC (whose lookup returns embeddings and remapped features): before
    start_batch bit for bit as TrainPipelineBase, after it stale (other losses from batch 4 on) but running."""
    for rank, result in enumerate(_results()):
        got = result["pipeline"]
        assert got["semi_sync_pipelined"] == ["mc"] and got["semi_sync_equal"], f"rank {rank}"
        stale, base = got["stale_losses"], got["base_losses"]
        assert len(stale) == 8 and stale[:3] == base[:3] and stale[3:] != base[3:], f"rank {rank}: {stale} vs {base}"


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("optimizer", ["EXACT_ROWWISE_ADAGRAD", "ADAM"])
def test_evicted_rows_are_reset_with_their_optimizer_state(kind: str, optimizer: str) -> None:
    """torchrec's sharded reset, on each rank's own shard: the rows handed to new ids hold ``init_fn``'s rows and
    zero optimizer state after the forward, every other row and its state is unchanged bit for bit."""
    for rank, results in enumerate(_results()):
        got = results["reset"][f"{kind}_{optimizer}"]
        assert got["reset"] > 0, f"rank {rank}: no row was handed to a new id"
        assert got["bad_reset"] == 0, f"rank {rank}: {got['bad_reset']} reset rows differ from init_fn / zero state"
        assert got["changed"] == 0, f"rank {rank}: {got['changed']} untouched rows changed in the forward"
        states = {"EXACT_ROWWISE_ADAGRAD": ["momentum1"], "ADAM": ["momentum1", "momentum2"]}[optimizer]
        assert got["state_names"] == sorted(["weight", *states]), got["state_names"]
