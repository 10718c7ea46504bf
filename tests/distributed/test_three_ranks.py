"""An odd world size: 3 gloo ranks on one node (``LOCAL_WORLD_SIZE=3``), one spawn for every case (the rest of the
distributed suite runs at 2 and 4 ranks, where halving hides mistakes: ``B / W``, ``rows / W`` and ``dim / W`` are
exact, a sum of two terms does not depend on their order, and ``x / 2`` is exact).

* Sharded EBC, every sharding type, against the unsharded module on the same global batch split 2 / 4 / 1 (and
  3 / 0 / 2: a rank without samples): forward, gradients, weights and optimizer state after fused steps, also with
  gradient division by 3. Row-wise tables get blocks of ``ceil(rows / 3)`` (12 -> 4/4/4, 20 -> 7/7/6, 1 -> 1/0/0).
* Variable batch per feature (VBE) when a rank holds no table of a table-wise or column-wise sharding: that rank's
  empty input used to leave the all-to-all's graph, so it skipped the backward collective the others waited in.
* Every comm op exact on uneven splits with zeros, and through every quantized codec within its bound, with wire
  split sizes equal to ``calc_quantized_size`` of the padded per-rank blocks; the KJT all-to-all (stagger 3 too)
  and the sequence embeddings round trip.
* Ends of data: pipelines whose ranks hold 6 / 4 / 5 batches all stop after 4; a rank-sharded source of 50 rows in
  batches of 8 (2 / 3 / 3 batches per rank, with 2 loader workers) reads the dataset once over the ranks and
  ``MultiHostDataLoadIterator`` stops every rank after 2.
* A DMP checkpoint saved table-wise by 2 ranks (a subgroup) loads on 3 ranks row-wise, table-row-wise and
  column-wise (4 blocks on 3 ranks) into identical checkpoints, and training resumed on a 3 / 3 / 2 batch split
  matches the uninterrupted single-process model; the planner's plan trains like the single-process model.
* A fresh DDP (a resumed job) reduces the dense gradients in the order the uninterrupted one does: the deterministic
  all-reduce (all-gather, sum in rank order), the default for gloo above 2 ranks, where plain all-reduces sum in an
  order that follows the bucket layout.
* The planner calibration's group timing builds the column-wise types at 3 ranks (it skipped them: 3 column blocks
  do not divide its table's width 8).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.spawned import results_of, spawn_ranks
from tests.distributed.three_rank_cases import (
    EXACT_FORWARD,
    PIPELINE_BATCHES,
    PIPELINE_STEPS,
    RESHARD_KINDS,
    SPAWN_TIMEOUT_S,
    WORLD,
    ebc_cases,
    empty_rank_plans,
    rank_main,
)

pytestmark = pytest.mark.dist


@functools.cache
def _spawned() -> tuple[list[dict[str, Any]], str]:
    root = tempfile.mkdtemp(prefix="tritonrec-three-ranks-")
    return spawn_ranks(rank_main, WORLD, root, timeout=SPAWN_TIMEOUT_S, pg_timeout_s=30.0), root


@pytest.fixture(scope="module", autouse=True)
def _remove_checkpoints() -> Iterator[None]:
    yield
    if _spawned.cache_info().currsize:
        shutil.rmtree(_spawned()[1], ignore_errors=True)


def _results(suite: str) -> list[Any]:
    return results_of(_spawned()[0], suite, WORLD)


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(ebc_cases()))
def test_sharded_ebc_matches_unsharded_on_an_uneven_split(case: str) -> None:
    kind = case.split("-")[0]
    for rank, results in enumerate(_results("ebc")):
        got = results[case]
        if kind in EXACT_FORWARD:
            assert got["forward"] == 0.0, f"rank {rank}: forward differs by {got['forward']} (bit-exact expected)"
        assert got["forward"] <= 1e-6, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= 1e-6, f"rank {rank}: gradient differs by {got['grad']}"
        assert got["weights"] <= 1e-5, f"rank {rank}: weights after training differ by {got['weights']}"
        assert got["state"] <= 1e-5, f"rank {rank}: optimizer state after training differs by {got['state']}"


@pytest.mark.parametrize("kind", list(empty_rank_plans()))
def test_variable_batch_with_a_rank_holding_no_table(kind: str) -> None:
    for rank, results in enumerate(_results("vbe_empty_rank")):
        got = results[kind]
        assert got["forward"] <= 1e-6, f"rank {rank}: forward differs by {got['forward']}"
        assert got["grad"] <= 1e-6, f"rank {rank}: gradient differs by {got['grad']}"


def test_comm_ops_are_exact_on_uneven_splits() -> None:
    for rank, results in enumerate(_results("collectives")):
        for name, got in results["ops"].items():
            assert got["forward"]["exact"], f"rank {rank} {name}: forward {got['forward']['detail']}"
            assert got["grad"]["exact"], f"rank {rank} {name}: gradient {got['grad']['detail']}"


def test_codecs_stay_within_their_bounds_and_wire_sizes() -> None:
    from tests.distributed.codec_cases import CODECS

    for rank, results in enumerate(_results("collectives")):
        for codec, per_case in results["codecs"].items():
            _, forward_bound, backward_bound = CODECS[codec]
            wire = per_case["wire"]
            assert all(v for k, v in wire.items() if k != "detail"), f"rank {rank} {codec}: {wire}"
            for name, got in per_case.items():
                if name == "wire":
                    continue
                allowed_forward = got["forward_sums"] * forward_bound
                allowed_grad = got["backward_sums"] * backward_bound / (WORLD if got["division"] else 1)
                if got["backward_sums"] > 2:  # fp32 sums of 3 pieces (all-gather backward) depend on their order
                    allowed_grad = max(allowed_grad, 1e-6)
                assert got["forward_err"] <= allowed_forward, f"rank {rank} {codec} {name}: {got['forward_err']}"
                assert got["grad_err"] <= allowed_grad, f"rank {rank} {codec} {name}: {got['grad_err']}"
                if codec == "fp32":
                    assert got["forward_exact"], f"rank {rank} {name}: the fp32 codec must not change values"


def test_kjt_all_to_all_and_sequence_round_trip() -> None:
    for rank, results in enumerate(_results("collectives")):
        for name, checks in results["kjt"].items():
            assert all(checks.values()), f"rank {rank} {name}: {checks}"
        for name, checks in results["sequence"].items():
            assert checks["forward"] and checks["grad"], f"rank {rank} {name}: {checks}"


def test_pipelines_stop_together_on_uneven_data() -> None:
    for rank, got in enumerate(_results("pipeline_end")):
        steps = (got["base_steps"], got["sparse_dist_steps"], got["staged_steps"])
        assert steps == (PIPELINE_STEPS,) * 3, f"rank {rank} ({PIPELINE_BATCHES[rank]} batches): {steps}"
        assert got["sparse_dist_equal"], f"rank {rank}: the sparse-dist pipeline trained differently from base"


@pytest.mark.parametrize("workers", [0, 2])
def test_rank_sharded_source_reads_the_dataset_once_and_ends_together(workers: int) -> None:
    results = [r[f"workers{workers}"] for r in _results("loader_end")]
    assert sorted(r["local_batches"] for r in results) == [2, 3, 3], results  # 16 / 17 / 17 rows
    for rank, got in enumerate(results):
        assert got["union_is_the_dataset"] and got["no_duplicates"], f"rank {rank}: {got}"
        assert got["steps"] == 2, f"rank {rank}: {got['steps']} steps, the shortest rank has 2"


@pytest.mark.parametrize("kind", RESHARD_KINDS)
def test_checkpoint_saved_on_two_ranks_loads_on_three(kind: str) -> None:
    from tests.model_parallel.checkpoint_cases import SAVED_AT
    from tests.model_parallel.test_checkpoint_reshard import _assert_identical
    from tritonrec.dist.checkpoint import load_unsharded_checkpoint

    results = _results("checkpoint")
    for rank, per_kind in enumerate(results):
        assert per_kind[kind]["step"] == SAVED_AT and per_kind[kind]["position"] == SAVED_AT, f"rank {rank}"
    root = Path(_spawned()[1])
    saved, resaved = (load_unsharded_checkpoint(root / n / f"step_{SAVED_AT:08d}") for n in ("tw2", f"{kind}3"))
    _assert_identical(resaved, saved, f"2 ranks TW -> 3 ranks {kind}")
    assert results[0][kind]["after_two_steps"] <= 1e-5, results[0][kind]


def test_planner_plan_trains_like_one_process() -> None:
    for rank, got in enumerate(_results("planner_dlrm")):
        assert got["loss"] <= 1e-5 and got["dense"] <= 1e-5 and got["dense_state"] <= 1e-5, f"rank {rank}: {got}"
        assert got["tables"] <= 1e-5 and got["fused_state"] <= 1e-5, f"rank {rank}: {got}"


def test_calibration_times_the_column_wise_types() -> None:
    for rank, kinds in enumerate(_results("calibration")):
        assert kinds == ["column_wise", "table_column_wise"], f"rank {rank}: timed {kinds}"


def test_a_fresh_ddp_reduces_like_the_uninterrupted_one() -> None:
    """Resume exactness of the dense part at 3 ranks: the deterministic all-reduce (the default, also under bf16)
    makes the resumed steps equal; plain bucket all-reduces differ in the last bit (the control: the check can
    fail)."""
    for rank, diffs in enumerate(_results("ddp_resume")):
        assert diffs["default"] == 0.0, f"rank {rank}: resumed steps differ by {diffs['default']}"
        assert diffs["bf16"] == 0.0, f"rank {rank}: resumed bf16 steps differ by {diffs['bf16']}"
        assert diffs["bucketed"] > 0.0, f"rank {rank}: bucket all-reduces no longer depend on the layout"


def test_a_sparse_gradient_takes_ddps_plain_all_reduce() -> None:
    for rank, diffs in enumerate(_results("ddp_sparse")):
        assert diffs.keys() == {"embedding.weight", "linear.weight", "linear.bias"}, f"rank {rank}: {diffs}"
        assert diffs["embedding.weight"] == 0.0, f"rank {rank}: the sparse gradient differs by {diffs}"
        assert max(diffs.values()) < 1e-6, f"rank {rank}: {diffs}"


def test_the_job_resumes_exactly_on_three_ranks() -> None:
    """The README's promise at more than 2 ranks: the resumed job's losses (steps 4-6 retrained) are the
    uninterrupted job's, bit for bit, and so are its AUROCs."""
    reports = _results("job_resume")[0]
    full, resumed = reports["full"], reports["resumed"]
    assert full["world_size"] == resumed["world_size"] == 3
    assert resumed["history"]["step"] == full["history"]["step"] == [1, 2, 3, 4, 5, 6]
    assert resumed["history"]["loss"] == full["history"]["loss"]
    assert (resumed["train_auroc"], resumed["eval_auroc"]) == (full["train_auroc"], full["eval_auroc"])


def test_plans_refuse_a_local_size_that_does_not_divide_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Table-row-wise needs whole nodes: 3 ranks cannot be nodes of 2. An explicit ``local_size=2`` is refused (a plan
    made for nodes of 2 would not match the shardings' node groups); ``LOCAL_WORLD_SIZE=2`` in the environment falls
    back to one node of 3 with a warning, as torchrec's ``get_local_size`` does, and the node groups, the sharding
    and the planner's default topology all read that same fallback (the 3-rank spawn runs one node of 3)."""
    from tritonrec.dist import EmbeddingBagCollectionSharder, construct_module_sharding_plan, table_row_wise
    from tritonrec.dist.planner import Topology
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

    config = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"])
    ebc = EmbeddingBagCollection([config], device="meta")
    sharder = EmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match=r"local_size must be a positive divisor of world_size 3, got 2"):
        construct_module_sharding_plan(ebc, {"t": table_row_wise(host_index=0)}, sharder, 2, WORLD, "cpu")
    with pytest.raises(ValueError, match=r"local_world_size must divide world_size 3, got local_world_size=2"):
        Topology(WORLD, compute_device="cpu", local_world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = construct_module_sharding_plan(ebc, {"t": table_row_wise(host_index=0)}, sharder, None, WORLD, "cpu")
    assert plan["t"].ranks == [0, 1, 2]
    assert [list(s.shard_sizes) for s in plan["t"].shards] == [[4, 4], [4, 4], [2, 4]]
    with pytest.raises(ValueError, match=r"host_index must be .*got host_index=1"):
        construct_module_sharding_plan(ebc, {"t": table_row_wise(host_index=1)}, sharder, None, WORLD, "cpu")
