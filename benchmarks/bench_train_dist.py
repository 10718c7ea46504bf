"""DLRM training throughput on 2 gloo ranks (CPU) for every sharding x train pipeline x comm codec, next to
torchrec 1.8's DistributedModelParallel + TrainPipelineSparseDist / TrainPipelineBase on the same configuration in
the same run (where installed).

    python benchmarks/bench_train_dist.py                 # the anchor config below, every combination, 2 rounds
    python benchmarks/bench_train_dist.py --rows 20000 --shardings tw rw --pipelines sparse_dist --qcomms none

Anchor config (issue #15): 8 tables x 100k rows x D=64, ids per bag ~ U[0, 40), B=512 per rank, fused rowwise
Adagrad (lr 0.05) on the tables, dense Adagrad (lr 0.05), DLRM dense 13 -> [128, 64], over [256, 128, 1]. Models are
built on ``meta`` and sharded by ``DistributedModelParallel`` (each rank materialises its shards only), trained
through the API a user calls (``TrainPipelineBase``, ``TrainPipelineSparseDist``, ``StagedTrainPipeline``) on a
stream of DISTINCT batches, as torchrec is (its own DMP, sharder, DLRM and pipelines).

Reported per configuration: samples/s over all ranks (global batch x steps / the slowest rank's wall time) and ms per
step; each round runs every configuration once in fresh rank processes (one set per implementation), in reversed
order every other round, and the median of the rounds is reported, so load drifting during the run biases none
against another. Peak resident
memory per rank comes from a separate pass that runs each configuration without codec alone in fresh processes
(build + a few steps; ``ru_maxrss``). A combination torchrec refuses on CPU is recorded as ``refused`` with its
error. The metadata check of the comm ops runs on each module's first 8 calls: the warm-up covers them.

``--torchrec-kernels fused planner`` adds torchrec as its own defaults run it on CPU (rows ``torchrec_planner_kernel``:
the dense kernel its plan generators pick, whose dense Adagrad steps every row of every table) beside the anchor.

``--ceiling`` adds ours with the tables' fused backward update skipped (rows ``tritonrec_no_table_update``: the rows
are neither summed nor written, so the model does not train its tables): an upper bound on what any faster row
update could give, the rest of the step (lookups, collectives, dense layers, pipeline) unchanged. Throughput only.

Appends to ``sharded_dlrm_train_cpu.csv`` and writes ``sharded_dlrm_train_cpu.png`` (results folder of the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sharded_ebc import plan_generators as sharded_ebc_plan_generators
from harness import append_csv, device_name, print_table, results_dir, spawn_ranks

from tritonrec.dist.rendezvous import init_local_rank

SHARDINGS = ["tw", "rw", "cw", "twrw", "dp"]
# torchrec's rows by table kernel: "torchrec" (the anchor) runs FBGEMM's fused kernel as ours does
TORCHREC_KERNELS = {"torchrec": "fused", "torchrec_planner_kernel": "planner"}
CEILING = "tritonrec_no_table_update"  # --ceiling: ours with the tables' backward update skipped
OURS = ("tritonrec", CEILING)
PIPELINES = ["base", "sparse_dist", "staged"]
EXTRA_PIPELINES = ["semi_sync"]  # on request (--pipelines): not in the default sweep
QCOMMS = ["none", "fp16", "int8"]
DENSE_IN = 13


# ------------------------------------------------------------------------------------------------------ memory
def peak_rss_mb() -> float:
    """This process's peak resident memory (the memory pass runs each configuration in fresh processes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----------------------------------------------------------------------------------------------------- batches
def make_batches(args: argparse.Namespace, rank: int, count: int, torchrec_types: bool) -> list[Any]:
    """``count`` distinct batches for this rank (tritonrec's Batch, or torchrec's)."""
    g = torch.Generator().manual_seed(1000 + rank)
    keys = [f"f{i}" for i in range(args.tables)]
    out = []
    for _ in range(count):
        lengths = torch.randint(0, args.max_length, (args.tables * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        dense = torch.randn(args.batch, DENSE_IN, generator=g)
        labels = (torch.rand(args.batch, generator=g) < 0.3).float()
        if torchrec_types:
            from torchrec.datasets.utils import Batch as TorchrecBatch
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

            out.append(TorchrecBatch(dense, TorchrecKJT(keys=keys, values=values, lengths=lengths.int()), labels))
        else:
            from tritonrec.data import KeyedJaggedTensor
            from tritonrec.data.batch import Batch

            kjt = KeyedJaggedTensor(keys, values, lengths=lengths.int())
            out.append(Batch(dense, kjt, labels, torch.ones(args.batch, dtype=torch.bool)))
    return out


# this benchmark's sharding names -> bench_sharded_ebc's (ShardingType values), whose plan generators it uses
SHARDING_TYPES = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "twrw": "table_row_wise",
                  "dp": "data_parallel"}  # fmt: skip


def plan_generators(kind: str, tables: int, world: int, lib: Any) -> dict[str, Any]:
    return sharded_ebc_plan_generators(SHARDING_TYPES[kind], tables, world, lib)


# -------------------------------------------------------------------------------------------------------- ours
def build_ours(args: argparse.Namespace, sharding: str, pipeline: str, qcomm: str, world: int) -> Any:
    """A step function training one batch through our pipeline (DMP, DLRMTrain, fused tables, dense Adagrad)."""
    from tritonrec.dist import construct_module_sharding_plan, sharding_plan
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.dist.qcomm_codec import CommType
    from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs_registry
    from tritonrec.dist.train_pipeline import (
        PipelineStage,
        SparseDataDistUtil,
        StagedTrainPipeline,
        TrainPipelineBase,
        TrainPipelineSemiSync,
        TrainPipelineSparseDist,
    )
    from tritonrec.dist.types import ShardingPlan
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM, DLRMTrain
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    tables = [EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}",
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.05}, device="meta")
    model = DLRMTrain(DLRM(ebc, DENSE_IN, [128, args.dim], [256, 128, 1], dense_device="meta"))
    precision = CommType.FP32 if qcomm == "none" else CommType(qcomm)
    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=precision, backward_precision=precision))
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    generators = plan_generators(sharding, args.tables, world, sharding_plan)
    module_plan = construct_module_sharding_plan(ebc, generators, sharder, world, world, "cpu")
    for p in module_plan.values():
        p.compute_kernel = "fused"
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    optimizer = torch.optim.Adagrad(dense, lr=0.05)
    cpu = torch.device("cpu")
    if pipeline == "base":
        return _progress(TrainPipelineBase(dmp, optimizer, cpu, host_prefetch=2))
    if pipeline == "sparse_dist":
        return _progress(TrainPipelineSparseDist(dmp, optimizer, cpu, host_prefetch=2))
    if pipeline == "semi_sync":  # stale from the first batch on (throughput only)
        return _progress(TrainPipelineSemiSync(dmp, optimizer, cpu, start_batch=0, host_prefetch=2))
    sdd = SparseDataDistUtil(dmp)
    staged = StagedTrainPipeline([
        PipelineStage("data_copy", lambda b: b),
        PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sdd_fill_callback),
    ], host_prefetch=2)  # fmt: skip

    def step(batches: Any) -> None:
        batch = staged.progress(batches)
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        optimizer.step()

    step.close = staged.close  # type: ignore[attr-defined]
    return step


@contextlib.contextmanager
def _without_table_update() -> Iterator[None]:
    """The pooled fused backward op does nothing while inside (the ``--ceiling`` rows): its gradient plan (the ids'
    sort) and its row update are the two module functions the op's body calls."""
    import tritonrec.kernels.embedding.pooled as pooled

    saved = pooled._pooled_plan, pooled.fused_update
    pooled._pooled_plan = pooled.fused_update = lambda *args, **kwargs: None
    try:
        yield
    finally:
        pooled._pooled_plan, pooled.fused_update = saved


def _progress(pipeline: Any) -> Any:
    def step(batches: Any) -> None:
        pipeline.progress(batches)

    step.close = pipeline.close  # type: ignore[attr-defined]
    return step


# ---------------------------------------------------------------------------------------------------- torchrec
def build_torchrec(
    args: argparse.Namespace, sharding: str, pipeline: str, qcomm: str, world: int, kernel: str = "fused"
) -> Any:
    """torchrec's step. ``kernel="fused"`` (the anchor): every sharded table on FBGEMM's fused CPU kernel, as ours.
    ``kernel="planner"``: the kernel torchrec's plan generators pick on CPU (dense: the dense Adagrad then steps every
    row of every table), i.e. torchrec as its own defaults run it."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if qcomm != "none":
        raise ValueError("the torchrec anchor runs without comm codecs")
    tables = [EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}",
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]  # fmt: skip
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(ebc, DENSE_IN, [128, args.dim], [256, 128, 1], dense_device=torch.device("meta")))
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    generators = plan_generators(sharding, args.tables, world, sharding_plan)
    module_plan = construct_module_sharding_plan(ebc, generators, sharder, world, world, "cpu")
    if sharding != "dp" and kernel == "fused":
        # torchrec's plan generators pick its dense kernel on CPU: the tables then take a dense gradient and the dense
        # Adagrad steps every row of every table. Ours runs fused rowwise Adagrad, so the anchor runs FBGEMM's fused
        # CPU kernel too (data-parallel tables are dense in torchrec: DDP + the dense optimizer).
        for parameter_sharding in module_plan.values():
            parameter_sharding.compute_kernel = "fused"
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.05))  # fmt: skip
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    cls = TrainPipelineBase if pipeline == "base" else TrainPipelineSparseDist
    if pipeline == "staged":
        raise ValueError("the torchrec anchor runs TrainPipelineBase and TrainPipelineSparseDist")
    return _progress_torchrec(cls(dmp, optimizer, torch.device("cpu")))


def _progress_torchrec(pipeline: Any) -> Any:
    def step(batches: Any) -> None:
        pipeline.progress(batches)

    step.close = lambda: None  # type: ignore[attr-defined]
    return step


# ------------------------------------------------------------------------------------------------------- ranks
def _cycle(batches: list[Any]) -> Any:
    while True:
        yield from batches


def _time(step: Any, batches: list[Any], args: argparse.Namespace) -> float:
    """Seconds of ``args.steps`` steps on the slowest rank (after ``args.warmup`` steps)."""
    stream = _cycle(batches)
    for _ in range(args.warmup):
        step(stream)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(args.steps):
        step(stream)
    elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    step.close()
    return float(elapsed)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, configs: list[tuple], results: Any) -> None:
    """One round on this rank: every configuration in turn, each built, warmed up and timed, then released:
    ``{config: {"seconds": of the timed steps on the slowest rank, "peak_rss_mb": every rank's process peak} or
    {"error": ...}}`` (the peak is that configuration's only when it ran alone in these processes)."""
    try:
        os.environ.update({"LOCAL_WORLD_SIZE": str(world), "TRITON_INTERPRET": "0"})
        torch.set_num_threads(args.threads)
        init_local_rank("gloo", port, rank, world)
        count = args.steps + args.warmup + 2
        batches = {"tritonrec": make_batches(args, rank, count, torchrec_types=False)}
        if any(c[0] in TORCHREC_KERNELS for c in configs):
            batches["torchrec"] = make_batches(args, rank, count, torchrec_types=True)
        out: dict[tuple, Any] = {}
        for config in configs:
            impl, sharding, pipeline, qcomm = config
            dist.barrier()
            try:
                ceiling = _without_table_update() if impl == CEILING else contextlib.nullcontext()
                with ceiling:
                    if impl in OURS:
                        step = build_ours(args, sharding, pipeline, qcomm, world)
                    else:
                        step = build_torchrec(args, sharding, pipeline, qcomm, world, TORCHREC_KERNELS[impl])
                    seconds = _time(step, batches["tritonrec" if impl in OURS else "torchrec"], args)
                    del step
            except Exception as err:  # torchrec refusing a sharding on CPU is a result, not a crash
                if args.verbose and rank == 0:
                    traceback.print_exc()
                out[config] = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:200]}
                dist.barrier()
                continue
            peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([peak_rss_mb()], dtype=torch.float64))
            out[config] = {"seconds": seconds, "peak_rss_mb": [float(p) for p in peaks]}
            if rank == 0 and len(configs) > 1:
                rate = world * args.batch * args.steps / seconds
                print(f"{' '.join(config)}: {rate:,.0f} samples/s", flush=True)
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_round(args: argparse.Namespace, configs: list[tuple]) -> dict[tuple, Any]:
    """Every configuration once, in fresh rank processes."""
    return spawn_ranks(rank_main, args.world, args, configs)[0]


def report(args: argparse.Namespace, rows: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for (impl, sharding, pipeline, qcomm), entry in rows.items():
        row: dict[str, Any] = {
            "impl": impl, "sharding": sharding, "pipeline": pipeline, "qcomm": qcomm, "status": entry["status"],
            "tables": args.tables, "rows": args.rows, "dim": args.dim, "batch_per_rank": args.batch,
            "world": args.world, "steps": args.steps, "rounds": len(entry["seconds"]), "threads": args.threads,
        }  # fmt: skip
        if entry["status"] == "ok":
            seconds = statistics.median(entry["seconds"])
            row["samples_per_s"] = args.world * args.batch * args.steps / seconds
            row["ms_per_step"] = 1e3 * seconds / args.steps
            for r, peak in enumerate(entry.get("fresh_peak_rss_mb") or []):
                row[f"peak_rss_mb_rank{r}"] = peak
        else:
            row["note"] = entry.get("error", entry["status"])
        out.append(row)
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str, world: int) -> None:
    """Bars of samples/s per configuration (``rows``: this run's report), torchrec's in grey; ``title`` names the
    shape and the device (ratios against torchrec depend on the CPU: see the README)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    short = {"tritonrec": "ours", CEILING: "ours, no table update", "torchrec": "torchrec",
             "torchrec_planner_kernel": "torchrec (planner kernel)"}  # fmt: skip
    labels = [f"{short.get(r['impl'], r['impl'])} {r['sharding']} {r['pipeline']} {r['qcomm']}" for r in ok]
    colors = ["tab:gray" if r["impl"] in TORCHREC_KERNELS else "lightsteelblue" if r["impl"] == CEILING else "tab:blue"
              for r in ok]  # fmt: skip
    figure, axes = plt.subplots(figsize=(8, max(4, 0.22 * len(ok))))
    axes.barh(range(len(ok)), [float(r["samples_per_s"]) for r in ok], color=colors)
    axes.set_yticks(range(len(ok)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel(f"samples/s over {world} gloo ranks (higher is better); grey: torchrec 1.8")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank")
    parser.add_argument("--max-length", type=int, default=40, help="ids per bag ~ U[0, max_length)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps (past the 8 metadata-checked calls)")
    parser.add_argument("--rounds", type=int, default=2, help="an even count: each order runs as often")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of the memory pass (0: no memory pass)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shardings", nargs="+", default=SHARDINGS, choices=SHARDINGS)
    parser.add_argument("--pipelines", nargs="+", default=PIPELINES, choices=PIPELINES + EXTRA_PIPELINES)
    parser.add_argument("--qcomms", nargs="+", default=QCOMMS, choices=QCOMMS)
    parser.add_argument("--no-torchrec", dest="torchrec", action="store_false")
    parser.add_argument("--torchrec-kernels", nargs="+", default=["fused"], choices=["fused", "planner"],
                        help="torchrec's table kernel: fused (FBGEMM's fused CPU kernel, the anchor) and/or planner "
                             "(what its plan generators pick on CPU: dense)")  # fmt: skip
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also run ours with the tables' backward update skipped (an upper bound; does not train)",
    )
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--csv", default="sharded_dlrm_train_cpu.csv")
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        # the order flips every round and ours runs first in round 1: an odd count gives the implementation that
        # runs first (the faster position on a shared host) one extra round, which biases both medians
        parser.error(f"--rounds must be an even count >= 2, got --rounds={args.rounds}")
    if args.torchrec:
        try:
            import torchrec  # noqa: F401
        except Exception:
            print("torchrec is not installed: no anchor rows")
            args.torchrec = False
    configs = [("tritonrec", sh, p, q) for sh in args.shardings for p in args.pipelines for q in args.qcomms]
    if args.ceiling:
        configs += [(CEILING, sh, p, "none") for sh in args.shardings for p in args.pipelines]
    if args.torchrec:
        impls = [impl for impl, kernel in TORCHREC_KERNELS.items() if kernel in args.torchrec_kernels]
        configs += [(impl, sh, p, "none") for impl in impls for sh in args.shardings for p in ("base", "sparse_dist")
                    if p in args.pipelines]  # fmt: skip
    results: dict[tuple, dict[str, Any]] = {c: {"status": "ok", "seconds": [], "peak_rss_mb": []} for c in configs}
    for round_ in range(args.rounds):  # interleaved: every configuration once per round, the order reversed
        todo = [c for c in configs if results[c]["status"] == "ok"]
        print(f"round {round_ + 1}/{args.rounds}: {len(todo)} configurations", flush=True)
        todo = todo if round_ % 2 == 0 else todo[::-1]
        # each implementation in rank processes of its own, so neither runs in the other's leftovers (allocator
        # state, imported libraries' settings): in one shared process ours ran ~10% slower after torchrec's
        outs: dict[tuple, Any] = {}
        for impl in dict.fromkeys(c[0] for c in todo):
            outs |= run_round(args, [c for c in todo if c[0] == impl])
        for config, out in outs.items():
            entry = results[config]
            if "error" in out:
                entry.update(status="refused", error=out["error"])
                continue
            entry["seconds"].append(out["seconds"])
            entry["peak_rss_mb"].append(out["peak_rss_mb"])
    # Memory pass: each configuration (no codec) alone in fresh processes, so its peak RSS is its own, not the
    # high-water mark of everything the round's processes ran before it.
    if args.memory_steps:
        memory_args = argparse.Namespace(**{**vars(args), "steps": args.memory_steps, "warmup": 1})
        for config in configs:
            if config[3] != "none" or results[config]["status"] != "ok":
                continue
            out = run_round(memory_args, [config])[config]
            if "error" not in out:
                results[config]["fresh_peak_rss_mb"] = out["peak_rss_mb"]
                print(f"memory {' '.join(config)}: {max(out['peak_rss_mb']):,.0f} MB", flush=True)
    rows = report(args, results)
    columns = ["impl", "sharding", "pipeline", "qcomm", "status", "samples_per_s", "ms_per_step"]
    columns += [f"peak_rss_mb_rank{r}" for r in range(args.world)] + ["note"]
    print_table(rows, columns)
    path = append_csv(results_dir() / args.csv, rows)
    print(f"appended {len(rows)} rows to {path}")
    try:
        title = (
            f"DLRM training, {args.tables} tables x {args.rows:,} x {args.dim}, B={args.batch} per rank, "
            f"{args.threads} thread(s) per rank\n{device_name()}"
        )
        plot(rows, path.with_suffix(".png"), title, args.world)
        print(f"plot: {path.with_suffix('.png')}")
    except ImportError:
        print("no plot: matplotlib is not installed")


if __name__ == "__main__":
    main()
