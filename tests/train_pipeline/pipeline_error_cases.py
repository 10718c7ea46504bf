"""Rank-side error cases for the train pipelines (2 gloo ranks, the DLRM and batches of pipeline_cases): a rank's data,
stage or input dist raises, every rank must raise instead of hanging, and the same model trains on after it (reset
pipeline, new pipeline, renewed input-dist groups). These run last in the spawn: a rank that fails may leave a
collective it launched unmatched on the main group.

Separate from pipeline_cases.py (the exact and end-of-data cases and the shared builders) to keep each module small.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.train_pipeline.pipeline_cases import (
    BATCH,
    CPU,
    FEATURES,
    _differ,
    _outcome,
    batches,
    build_model,
    build_two_collections,
    make_batch,
    run_to_end,
    snapshot,
    train,
)
from tests.train_pipeline.toy import staged_losses


def missing_key(rank: int, count: int, at: int) -> Iterator[Any]:
    """``count`` batches; rank 1's batch ``at`` lacks feature f3, so its input dist raises in start_sparse_data_dist."""
    from tritonrec.data import KeyedJaggedTensor

    for step in range(count):
        batch = make_batch(rank, step)
        if rank == 1 and step == at:
            kjt = batch.sparse_features
            kept = 3 * BATCH
            short = KeyedJaggedTensor(FEATURES[:3], kjt.values()[: int(kjt.lengths()[:kept].sum())],
                                      lengths=kjt.lengths()[:kept])  # fmt: skip
            batch = type(batch)(batch.dense_features, short, batch.labels, batch.valid_mask)
        yield batch


def error_cases(rank: int, world: int) -> dict[str, Any]:
    """Each rank's outcome when rank 1's data raises (base, sparse_dist), rank 0's stage raises (staged) or rank 1's
    input dist raises (last, as it leaves rank 0's input dist unmatched on the input dists' group; then whether the
    model's group still pairs collectives)."""
    from tritonrec.dist.train_pipeline import (
        PipelineStage,
        SparseDataDistUtil,
        StagedTrainPipeline,
        TrainPipelineBase,
        TrainPipelineSparseDist,
    )

    fail_at = 4 if rank == 1 else None
    sparse_dist = lambda m, o: TrainPipelineSparseDist(m, o, CPU)
    # a clean run before any failure: later models in these processes must train exactly like it
    reference = train(sparse_dist, "tw", world, batches(rank, 14))["losses"]
    _, _, kept = build_model("tw", world)  # built before the failures: its shardings must follow the renewals
    first_group = kept._shardings[0].input_dist_pg

    def steps(make: Callable[..., Any], kind: str) -> Callable[[], int]:
        return lambda: len(train(make, kind, world, batches(rank, 10, fail_at))["losses"])

    out = {
        "base": _outcome(steps(lambda m, o: TrainPipelineBase(m, o, CPU), "tw")),
        "sparse_dist": _outcome(steps(lambda m, o: TrainPipelineSparseDist(m, o, CPU), "rw")),
    }

    def broken(batch: Any) -> Any:
        broken.calls += 1  # type: ignore[attr-defined]
        if rank == 0 and broken.calls == 3:  # type: ignore[attr-defined]
            raise RuntimeError("feature processing failed on rank 0")
        return batch

    broken.calls = 0  # type: ignore[attr-defined]

    def staged(stages: list[PipelineStage], data: Iterator[Any], wrapped: bool = False) -> int:
        """Steps of a staged pipeline: ``stages``, then the sparse data dist's (``wrapped``: its runnable a lambda
        around the util's method); raises as the pipeline does."""
        model, optimizer, _ = build_model("tw", world)
        sdd = SparseDataDistUtil(model)
        start = (lambda b: sdd.start_sparse_data_dist(b)) if wrapped else sdd.start_sparse_data_dist
        pipeline = StagedTrainPipeline([
            *stages,
            PipelineStage("start_sparse_data_dist", start, fill_callback=sdd.wait_sdd_fill_callback),
        ])  # fmt: skip
        return len(staged_losses(pipeline, model, optimizer, data))

    copy_stage = PipelineStage("data_copy", lambda b: b)
    out["staged"] = _outcome(lambda: staged([copy_stage, PipelineStage("process", broken)], batches(rank, 10)))

    def input_dist_failure(at: int, build: Callable[..., Any] | None = None) -> Callable[[], int]:
        make = lambda m, o: TrainPipelineSparseDist(m, o, CPU)
        return lambda: len(train(make, "tw", world, missing_key(rank, at + 4, at), build)["losses"])

    # batch 4: within the input dist's first 8 (metadata-checked) calls, rank 1 joins rank 0's check with its error,
    # so no rank issues the all-to-all and both raise at once
    out["input_dist_checked"] = _outcome(input_dist_failure(4))
    # batch 12: past them, rank 0 launches its all-to-all and learns of rank 1's failure from the agreement
    out["input_dist"] = _outcome(input_dist_failure(12))
    # the same with a second collection that runs its own input dist in the forward, on the input-dist group rank
    # 0's launch ahead is unpaired on: the ranks must agree before that forward (deferred, rank 1 aborted in gloo
    # on a size mismatch and rank 0 hung)
    out["two_collections"] = _outcome(input_dist_failure(12, lambda: build_two_collections(world, computed=True)))
    # rank 0 launched batch 12's input dist and rank 1 did not; on their own group, that leaves the model's group
    # in step: a collective on it still pairs up
    probe = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(probe)
    out["probe"] = probe.item()
    # rank 0's unmatched input dist stays on the old input-dist group: the ranks renewed it when they agreed on the
    # failure, so a new model's input dists pair up again (on the old group they paired with the stale launch)
    out["after_input_dist"] = train(sparse_dist, "tw", world, batches(rank, 14))["losses"] == reference

    # the same in a staged pipeline whose input-dist stage wraps the util's method in a lambda: the renewal is of the
    # input dists' side groups themselves, so it does not depend on finding the util among the stages
    out["staged_input_dist"] = _outcome(lambda: staged([copy_stage], missing_key(rank, 16, 12), wrapped=True))
    out["after_staged_input_dist"] = train(sparse_dist, "tw", world, batches(rank, 14))["losses"] == reference
    # the util's own method as the stage: the step's agreement is read in the forward hook (deferred), which must
    # not wait on the input dist rank 1 never launched; every rank raises at its next progress
    out["staged_input_dist_deferred"] = _outcome(lambda: staged([copy_stage], missing_key(rank, 16, 12)))
    out["after_staged_deferred"] = train(sparse_dist, "tw", world, batches(rank, 14))["losses"] == reference
    from tritonrec.dist.side_groups import INPUT_DIST, same_ranks_group

    group = kept._shardings[0].input_dist_pg
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total, group=group)
    renewed = same_ranks_group(kept._shardings[0].pg, INPUT_DIST)
    out["kept_sharding_follows"] = group is not first_group and group is renewed
    out["kept_group_sum"] = total.item()
    out["recovery"] = {
        "input_dist": recovery_cases(rank, world, lambda: missing_key(rank, 16, 12)),
        "data": recovery_cases(rank, world, lambda: batches(rank, 10, fail_at)),
    }
    return out


def recovery_cases(rank: int, world: int, failing: Callable[[], Iterator[Any]]) -> dict[str, Any]:
    """Training the failed pipeline's own model on after rank 1's ``failing()`` stream failed: the same pipeline
    after ``reset()``, and a new pipeline on the model. Each must train like TrainPipelineBase on a fresh model given
    the batches whose ``progress`` returned, then new data: a failed ``progress`` applies no update."""
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    out: dict[str, Any] = {}
    for how in ("reset", "new_pipeline"):
        model, optimizer, sharded = build_model("tw", world)
        pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
        data, done = failing(), 0
        try:
            while True:
                pipeline.progress(data)
                done += 1
        except Exception as error:
            out[f"{how}_error"] = type(error).__name__
        out[f"{how}_done"] = done
        if how == "reset":
            pipeline.reset()
        else:
            pipeline.close()
            pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
        losses = run_to_end(pipeline, batches(rank, 6))
        trained = itertools.chain(itertools.islice(failing(), done), batches(rank, 6))
        reference = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, trained)
        out[f"{how}_equal"] = reference["losses"][done:] == losses
        out[f"{how}_differ"] = _differ({"weights": snapshot(model, sharded)}, reference)
    return out
