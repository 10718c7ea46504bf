"""Rank-side code of test_three_ranks.py (3 gloo ranks, one spawn): the cases, each returning what the tests
compare; see that module's docstring for what each suite checks."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.spawned import run_suites

WORLD = 3
SPAWN_TIMEOUT_S = 240.0
SPLIT, EMPTY_SPLIT, RESUME_SPLIT = [2, 4, 1], [3, 0, 2], [3, 3, 2]
SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard",
                  "data_parallel", "mixed"]  # fmt: skip
# the lookup sums each bag in the same order as the unsharded module only when bags stay whole on one rank
EXACT_FORWARD = ("table_wise", "column_wise", "table_column_wise", "data_parallel")
PIPELINE_BATCHES, PIPELINE_STEPS = [6, 4, 5], 4
LOADER_ROWS, LOADER_BATCH = 50, 8
RESHARD_KINDS = ["rw", "twrw", "cw"]


# ------------------------------------------------------------------------------------------------ sharded EBC
@contextlib.contextmanager
def _batch_split(split: list[int]) -> Iterator[None]:
    """The global batch's split over the 3 ranks, for the case modules of tests/sharding (they read it per world)."""
    from tests.sharding import ebc_cases

    before = ebc_cases.BATCH_PER_RANK.get(WORLD)
    ebc_cases.BATCH_PER_RANK[WORLD] = split
    try:
        yield
    finally:
        if before is None:
            del ebc_cases.BATCH_PER_RANK[WORLD]
        else:
            ebc_cases.BATCH_PER_RANK[WORLD] = before


def ebc_cases() -> dict[str, tuple[Any, list[int]]]:
    """name -> (case, batch split): per sharding type the dense kernel (mean pooling) and 5 fused rowwise Adagrad
    steps (weighted), Adam with gradient division by 3, and a rank without samples."""
    from tests.sharding.ebc_cases import Case, plans_by_type

    plans = plans_by_type()
    cases = {}
    for kind in SHARDING_TYPES:
        cases[f"{kind}-dense-mean"] = (Case(kind, plans[kind], "MEAN"), SPLIT)
        cases[f"{kind}-ROWWISE-weighted"] = (
            Case(kind, plans[kind], "SUM", True, "EXACT_ROWWISE_ADAGRAD", steps=5),
            SPLIT,
        )
    division = {"exchange": "sparse", "division": True}
    cases["mixed-ADAM-division"] = (Case("mixed", plans["mixed"], "MEAN", False, "ADAM", 5, extra=division), SPLIT)
    cases["mixed-dense-sum-empty_rank"] = (Case("mixed", plans["mixed"]), EMPTY_SPLIT)
    cases["row_wise-ADAM-empty_rank"] = (Case("row_wise", plans["row_wise"], "SUM", True, "ADAM", 3), EMPTY_SPLIT)
    cases["table_row_wise-SGD-empty_rank"] = (
        Case("table_row_wise", plans["table_row_wise"], "MEAN", False, "EXACT_SGD", 3),
        EMPTY_SPLIT,
    )
    cases["data_parallel-ADAM-empty_rank"] = (
        Case("data_parallel", plans["data_parallel"], "SUM", False, "ADAM", 3, extra={"exchange": "sparse"}),
        EMPTY_SPLIT,
    )
    return cases


def _run_ebc_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    from tests.sharding.ebc_cases import run_ebc_case
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)  # the cases turn it on where they say so
    out = {}
    try:
        for name, (case, split) in ebc_cases().items():
            with _batch_split(split):
                out[name] = run_ebc_case(case, rank, world)
    finally:
        set_gradient_division(True)
    return out


def empty_rank_plans() -> dict[str, dict[str, Callable[[int], Any]]]:
    """Plans where rank 2 holds no table of the sharding: table-wise on ranks 0 and 1, column-wise likewise."""
    from tritonrec.dist import column_wise, table_wise

    return {
        "table_wise": {t: (lambda w, r=r: table_wise(rank=r)) for t, r in (("t0", 0), ("t1", 1), ("t2", 0), ("t3", 1))},
        "column_wise": {
            "t0": lambda w: column_wise(ranks=[0, 1]),
            "t1": lambda w: column_wise(ranks=[1]),
            "t2": lambda w: column_wise(ranks=[0]),
            "t3": lambda w: column_wise(ranks=[1, 0]),
        },
    }


def _run_vbe_empty_rank(rank: int, world: int) -> dict[str, dict[str, float]]:
    from tests.sharding.ebc_cases import Case, build_pair, max_diff, shard_slices
    from tests.sharding.wire_cases import expanded_kjt, vbe_batch, vbe_kjt
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    out = {}
    try:
        with _batch_split(SPLIT):
            for kind, plan in empty_rank_plans().items():
                pooling = "MEAN" if kind == "column_wise" else "SUM"
                reference, sharded = build_pair(Case(kind, plan, pooling), rank, world)
                ranks = vbe_batch(0, world)
                got = sharded(vbe_kjt(ranks[rank])).wait().values()
                full = reference(expanded_kjt(ranks)).values()
                lo = sum(SPLIT[:rank])
                grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(0))
                (got * grad[lo : lo + got.shape[0]]).sum().backward()
                (full * grad).sum().backward()
                result = {"forward": max_diff(got, full[lo : lo + SPLIT[rank]]), "grad": 0.0}
                for table, _, spec, param in shard_slices(sharded):
                    rows = slice(spec.row_offset, spec.row_offset + spec.rows)
                    block = reference.embedding_bags[table].weight.grad[rows, spec.col_offset :][:, : spec.cols]
                    result["grad"] = max(result["grad"], max_diff(param.grad, block))
                out[kind] = result
    finally:
        set_gradient_division(True)
    return out


# ----------------------------------------------------------------------------------------------- collectives
def _kjt_cases() -> tuple[list[Any], list[Any]]:
    from tests.distributed.data_cases import KJTCase

    kjt = [
        KJTCase("kjt/fixed", 4, (2, 1, 1)),
        KJTCase("kjt/weighted_zero_split", 3, (2, 0, 1), weighted=True),
        KJTCase("kjt/batch_per_rank", 3, (1, 1, 1), batch="per_rank", weighted=True),
        KJTCase("kjt/vbe", 5, (1, 2, 2), batch="vbe", weighted=True),
        KJTCase("kjt/empty_bags", 3, (1, 1, 1), empty_bags=True),
        KJTCase("kjt/stagger3", 3, (1, 1, 1), stagger=3, weighted=True),
    ]
    sequence = [
        KJTCase("seq/fixed", 3, (2, 0, 1)),
        KJTCase("seq/batch_per_rank", 4, (1, 2, 1), batch="per_rank"),
        KJTCase("seq/stagger3", 3, (1, 1, 1), stagger=3),
    ]
    return kjt, sequence


def _run_collectives(rank: int, world: int) -> dict[str, Any]:
    from tests.distributed.codec_cases import run_codec_cases
    from tests.distributed.comm_cases import build_op_cases, run_case
    from tests.distributed.data_cases import run_kjt_case, run_sequence_case

    kjt, sequence = _kjt_cases()
    pg = dist.group.WORLD
    return {
        "ops": {case.name: run_case(case, rank, world, pg, "ints", None) for case in build_op_cases(world)},
        "codecs": run_codec_cases(rank, world),
        "kjt": {case.name: run_kjt_case(case, rank, world) for case in kjt},
        "sequence": {case.name: run_sequence_case(case, rank, world) for case in sequence},
    }


# ------------------------------------------------------------------------------------------------ ends of data
def _run_pipeline_end(rank: int, world: int) -> dict[str, Any]:
    from tests.train_pipeline.pipeline_cases import CPU, _differ, batches, train, train_staged
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    count = PIPELINE_BATCHES[rank]
    base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, batches(rank, count))
    sparse_dist = train(lambda m, o: TrainPipelineSparseDist(m, o, CPU), "rw", world, batches(rank, count))
    sparse_base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "rw", world, batches(rank, count))
    staged = train_staged("rw", world, batches(rank, count))
    return {
        "base_steps": len(base["losses"]),
        "sparse_dist_equal": sparse_dist["losses"] == sparse_base["losses"] and not _differ(sparse_dist, sparse_base),
        "sparse_dist_steps": len(sparse_dist["losses"]),
        "staged_steps": len(staged["losses"]),
    }


def _run_loader_end(rank: int, world: int) -> dict[str, Any]:
    from tests.distributed.loader_cases import _FORK, _row_keys, _workers_allowed
    from tritonrec.data.loader import make_rank_loader
    from tritonrec.data.multihost import MultiHostDataLoadIterator
    from tritonrec.data.synthetic import SyntheticRecSource

    def source(**kwargs: Any) -> SyntheticRecSource:
        return SyntheticRecSource([60, 25], num_dense=2, num_samples=LOADER_ROWS, chunk_size=16, **kwargs)

    out = {}
    with _workers_allowed():
        for workers in (0, 2):
            mine_source = source(rank=rank, world_size=world, shuffle_buffer=8)
            loader = make_rank_loader(mine_source, LOADER_BATCH, workers, multiprocessing_context=_FORK)
            mine = [key for batch in loader for key in _row_keys(batch)]
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            union = Counter(key for keys in gathered for key in keys)
            full = Counter(key for batch in make_rank_loader(source(), LOADER_BATCH) for key in _row_keys(batch))
            local_batches = len(list(loader))
            steps = sum(1 for _ in MultiHostDataLoadIterator(loader))
            out[f"workers{workers}"] = {
                "union_is_the_dataset": union == full,
                "no_duplicates": max(union.values()) == 1,
                "local_batches": local_batches,
                "steps": steps,
            }
    return out


# ------------------------------------------------------------------------------------------- DMP and checkpoints
def _dmp(model: Any, generators: dict[str, Any], world: int, pg: Any = None) -> Any:
    from tests.model_parallel.dlrm_cases import SHARDED_PATH
    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingEnv, ShardingPlan, construct_module_sharding_plan
    from tritonrec.dist.model_parallel import DistributedModelParallel

    ebc = model.get_submodule(SHARDED_PATH)
    module_plan = construct_module_sharding_plan(ebc, generators, EmbeddingBagCollectionSharder(), world, world, "cpu")
    env = None if pg is None else ShardingEnv.from_process_group(pg)
    dmp = DistributedModelParallel(model, env=env, plan=ShardingPlan({SHARDED_PATH: module_plan}))
    for sharding in dmp.module.get_submodule(SHARDED_PATH).shardings:
        sharding.lookup.backend = "torch"
    return dmp


def _reshard_generators(kind: str) -> dict[str, Any]:
    from tests.model_parallel.dlrm_cases import TABLES
    from tritonrec.dist import column_wise, row_wise, table_row_wise

    # column-wise: DIM 8 in 4 blocks (3 does not divide 8), rank 0 holds two
    makers = {"rw": row_wise, "twrw": lambda: table_row_wise(host_index=0), "cw": lambda: column_wise([0, 1, 2, 0])}
    return {name: makers[kind]() for name, _ in TABLES}


def _train_split(dmp: Any, optimizer: Any, steps: range, split: list[int], rank: int) -> None:
    """Train on ``split`` slices of each global batch; the loss is scaled so that averaging over the ranks (DDP and
    gradient division) gives the global batch's mean gradient, also for unequal slices."""
    from tests.model_parallel.checkpoint_cases import GLOBAL_BATCH, batch_slice, global_batch, loss_of

    lo, hi = sum(split[:rank]), sum(split[: rank + 1])
    for step in steps:
        optimizer.zero_grad()
        loss = loss_of(dmp, *batch_slice(global_batch(step, GLOBAL_BATCH), lo, hi))
        (loss * (hi - lo) * len(split) / GLOBAL_BATCH).backward()
        optimizer.step()


def _run_checkpoint(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks (a subgroup) train table-wise and save; 3 ranks load it per kind, save again, train on."""
    from tests.model_parallel.checkpoint_cases import SAVED_AT, DataPosition
    from tests.model_parallel.dlrm_cases import TABLES, build_dlrm, dense_optimizer
    from tritonrec.dist import table_wise
    from tritonrec.dist.checkpoint import CheckpointManager, gather_unsharded_state_dict

    out: dict[str, Any] = {}
    pair = dist.new_group([0, 1])
    model = build_dlrm()
    reference, ref_dense = copy.deepcopy(model), None
    if rank < 2:
        saver = _dmp(model, {n: table_wise(rank=i % 2) for i, (n, _) in enumerate(TABLES)}, 2, pair)
        dense = dense_optimizer(saver.named_parameters())
        _train_split(saver, dense, range(SAVED_AT), [4, 4], rank)
        extra = {"data": DataPosition(SAVED_AT)}
        CheckpointManager(Path(root) / "tw2", pg=pair).save(SAVED_AT, saver, {"dense": dense}, extra)
    if rank == 0:  # the uninterrupted single-process run
        ref_dense = dense_optimizer(reference.named_parameters())
        _train_split(reference, ref_dense, range(SAVED_AT + 2), [8], 0)
    dist.barrier()
    for kind in RESHARD_KINDS:
        dmp = _dmp(build_dlrm(seed=11), _reshard_generators(kind), world)
        dense, position = dense_optimizer(dmp.named_parameters()), DataPosition()
        loaded = CheckpointManager(Path(root) / "tw2").load(dmp, {"dense": dense}, {"data": position})
        CheckpointManager(Path(root) / f"{kind}3").save(SAVED_AT, dmp, {"dense": dense}, {"data": position})
        _train_split(dmp, dense, range(SAVED_AT, SAVED_AT + 2), RESUME_SPLIT, rank)
        after = gather_unsharded_state_dict(dmp)
        result = {"step": loaded.step, "position": position.position}
        if rank == 0:
            expected = reference.state_dict()
            result["after_two_steps"] = max(float((after[k] - v).abs().max()) for k, v in expected.items())
        out[kind] = result
    return out


def _run_planner_dlrm(rank: int, world: int) -> dict[str, Any]:
    from tests.model_parallel.dlrm_cases import run_training_case

    result = run_training_case("planner", rank, world)
    return {k: v for k, v in result.items() if k in ("dense", "tables", "fused_state", "dense_state", "loss")}


def _run_calibration(rank: int, world: int) -> list[str]:
    from tritonrec.dist.planner.calibrate_dist import measure_group_steps

    return sorted(measure_group_steps(torch.device("cpu"), 1, ("column_wise", "table_column_wise")))


# ------------------------------------------------------------------------------------------------------- spawn
def rank_main(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one node of 3 (torchrun --nproc_per_node 3)
    torch.set_num_threads(1)
    from tests.distributed.ddp_resume_cases import run_fresh_ddp_resume, run_job_resume, run_sparse_gradient

    suites = {
        "ebc": _run_ebc_cases,
        "ddp_resume": run_fresh_ddp_resume,
        "ddp_sparse": run_sparse_gradient,
        "job_resume": functools.partial(run_job_resume, root=root),
        "collectives": _run_collectives,
        "pipeline_end": _run_pipeline_end,
        "loader_end": _run_loader_end,
        "checkpoint": functools.partial(_run_checkpoint, root=root),
        "planner_dlrm": _run_planner_dlrm,
        "calibration": _run_calibration,
        # last: before its fix, rank 2 left this suite early and the others waited in its backward collective
        "vbe_empty_rank": _run_vbe_empty_rank,
    }
    return run_suites({name: (fn, (world,)) for name, fn in suites.items()}, rank, world)
