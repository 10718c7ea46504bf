"""Rank-side cases (2 gloo ranks) for StagedTrainPipeline when the ranks drop different batches: filter stages that
return None for some batch indices on one rank only, placed before the input-dist stage, after it (between its
start and the forward hook that waits it), during the fill, two in one step, and during a flush. Each case trains
the DLRM of pipeline_cases on 10 batches per rank and compares with TrainPipelineBase on the batches every rank kept.
"""

from __future__ import annotations

from typing import Any

from tests.train_pipeline import pipeline_cases as pc
from tests.train_pipeline.toy import staged_losses

COUNT = 10


# name -> (sharding, stage layout, {filter stage: {rank: batch indices it drops}}, flush after this many steps)
CASES: dict[str, tuple[str, list[str], dict[str, dict[int, set[int]]], int | None]] = {
    "different_before_start": ("tw", ["copy", "filter_a", "start"], {"filter_a": {0: {3}, 1: {5}}}, None),
    # row-wise: two input-dist rounds per batch, both in flight when the batch is dropped
    "different_after_start": ("rw", ["copy", "start", "filter_a"], {"filter_a": {0: {3}, 1: {5}}}, None),
    "same_before_start": ("tw", ["copy", "filter_a", "start"], {"filter_a": {0: {3}, 1: {3}}}, None),
    "same_after_start": ("tw", ["copy", "start", "filter_a"], {"filter_a": {0: {3}, 1: {3}}}, None),
    # while filling: batch 0 dropped by rank 0 after its input dist started (and its fill callback waited it), batch 1
    # by rank 1 before its input dist
    "fill": ("tw", ["copy", "filter_a", "start", "filter_b"], {"filter_a": {1: {1}}, "filter_b": {0: {0}}}, None),
    # batches 3 (rank 0, last stage) and 4 (rank 1, the stage before) dropped in the same step, both started: the
    # input dist must discard the right two of its three contexts in flight
    "two_in_one_step": (
        "tw",
        ["copy", "start", "filter_a", "filter_b"],
        {"filter_a": {1: {4}}, "filter_b": {0: {3}}},
        None,
    ),
    # a flush requested after 3 steps (every rank): batch 4, in flight, is dropped by rank 0 and 6 by rank 1
    "flush": ("tw", ["copy", "start", "filter_a"], {"filter_a": {0: {4}, 1: {6}}}, 3),
}


def dropped_by_any(case: str) -> set[int]:
    return {k for per_rank in CASES[case][2].values() for ks in per_rank.values() for k in ks}


def run_case(rank: int, world: int, case: str) -> dict[str, Any]:
    """Train ``case`` staged, then TrainPipelineBase on the batches no rank dropped: what each trained, both loss
    lists, the weights that differ, and the step counts at each flush end."""
    from tritonrec.dist.train_pipeline import PipelineStage, SparseDataDistUtil, StagedTrainPipeline, TrainPipelineBase

    kind, layout, drops, flush_after = CASES[case]
    model, optimizer, sharded = pc.build_model(kind, world)
    sdd = SparseDataDistUtil(model)
    data = list(pc.batches(rank, COUNT))
    index = {id(b): k for k, b in enumerate(data)}

    def filter_stage(name: str) -> PipelineStage:
        mine = drops.get(name, {}).get(rank, set())
        return PipelineStage(name, lambda b: None if index[id(b)] in mine else b)

    stages = {
        "copy": PipelineStage("data_copy", lambda b: b),
        "start": sdd.start_sparse_data_dist_stage(),
        "filter_a": filter_stage("filter_a"),
        "filter_b": filter_stage("filter_b"),
    }
    trained: list[int] = []
    flushes: list[int] = []
    pipeline = StagedTrainPipeline([stages[s] for s in layout], on_flush_end=lambda: flushes.append(len(trained)))

    def after_step(batch: Any, losses: list[float]) -> None:
        trained.append(index[id(batch)])
        if len(losses) == flush_after:
            pipeline.set_flush(True)

    losses = staged_losses(pipeline, model, optimizer, iter(data), after_step)
    pipeline.close()
    union = dropped_by_any(case)
    kept = (b for k, b in enumerate(pc.batches(rank, COUNT)) if k not in union)
    base = pc.train(lambda m, o: TrainPipelineBase(m, o, pc.CPU), kind, world, kept)
    return {
        "trained": trained,
        "losses": losses,
        "base_losses": base["losses"],
        "differ": pc._differ({"weights": pc.snapshot(model, sharded)}, base),
        "flushes": flushes,
        "in_flight": len(sdd._ready) + len(sdd._waiting),
    }


def run_drop_cases(rank: int, world: int) -> dict[str, Any]:
    """Every case in order, each one's failure recorded as ``{"error": ...}`` (a later case still runs, unless the
    failure left a collective unmatched: then the spawn's timeout names it)."""
    import traceback

    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case in CASES:
        try:
            out[case] = run_case(rank, world, case)
        except Exception:
            out[case] = {"error": traceback.format_exc()}
    return out
