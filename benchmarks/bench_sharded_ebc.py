"""Sharded EmbeddingBagCollection training steps on 2 gloo ranks (CPU), per sharding type, next to torchrec 1.8's
sharded EBC on the same configuration in the same run (where installed).

    python benchmarks/bench_sharded_ebc.py                       # 8 tables x 100k rows x D=64, B=512 per rank
    python benchmarks/bench_sharded_ebc.py --rows 20000 --steps 6 --types table_wise row_wise --plot

Each rank runs fused rowwise Adagrad steps (forward, backward, update) on a stream of DISTINCT batches (pooling
lengths ~ U[0, 40), ids uniform), built through the API a user calls: ``EmbeddingBagCollectionSharder.shard`` for
ours; ``DistributedModelParallel`` for torchrec with the fused compute kernel on every sharded table (FBGEMM's CPU
TBE updating rows inside the backward; torchrec's plan generators would pick the dense kernel, which takes no
optimizer step). torchrec's data-parallel tables only come dense: they train with DDP's all-reduce and torchrec's
``RowWiseAdagrad`` stepped after the backward.

Reported per (implementation, sharding type): the slowest rank's median ms per step (median over rounds, with the
rounds' range); the process CPU time per step (the slowest rank; what a step costs whatever else the machine runs);
bytes handed to the collectives per rank per step (every ``torch.distributed`` send buffer, counted by wrapping the
Python collectives; DDP's C++ all-reduce escapes the count); the largest rank's peak RSS (each measurement runs in
fresh processes, so the peak is that configuration's, imports included). The speedup is the median over rounds of
the ratio measured within one round (both implementations run back to back, in alternating order), so load drifting
across the run biases no type against another. Timed steps follow more warm-up steps than the collectives' metadata
checks take (their first calls), so the steady state is what is timed.
A sharding type torchrec cannot build on CPU (or has no plan helper for) is recorded as ``refused`` with its error.

Appends to ``benchmarks/results/sharded_ebc_cpu.csv`` (``--plot``: ``sharded_ebc_cpu.png``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import append_csv, print_table, spawn_ranks

from tritonrec.dist.comm_consistency import DEFAULT_CHECKED_CALLS
from tritonrec.dist.rendezvous import init_local_rank

TYPES = ["table_wise", "row_wise", "column_wise", "table_column_wise", "data_parallel", "table_row_wise", "grid_shard"]


# ------------------------------------------------------------------------------------------------- wire counting
class WireCounter:
    """Counts the bytes every collective is handed to send (wraps ``torch.distributed``'s functions; the send buffer
    is found by parameter name, so keyword calls such as torchrec's ``all_to_all_single(output=..., input=...)``
    count too)."""

    # the parameter holding what is sent; point-to-point sends count through batch_isend_irecv (P2POp checks that
    # its op IS dist.isend, so isend itself stays unwrapped)
    SENT: ClassVar[dict[str, str]] = {
        "all_to_all_single": "input", "all_reduce": "tensor", "reduce_scatter_tensor": "input",
        "reduce_scatter_single": "input", "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
        "_reduce_scatter_base": "input", "_all_gather_base": "input_tensor",
        "all_gather": "tensor", "reduce_scatter": "input_list", "all_to_all": "input_tensor_list",
        "batch_isend_irecv": "p2p_op_list",
    }  # fmt: skip

    def __init__(self) -> None:
        self.bytes = 0
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        for name, param in self.SENT.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, param, original))

    def _wrap(self, name: str, param: str, original: Any) -> Any:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            sent = signature.bind_partial(*args, **kwargs).arguments.get(param)
            if name == "batch_isend_irecv":
                sent = [op.tensor for op in sent if op.op is dist.isend]
            for t in sent if isinstance(sent, (list, tuple)) else [sent]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
            return original(*args, **kwargs)

        return counted


# ------------------------------------------------------------------------------------------------------ batches
def make_batches(args: argparse.Namespace, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` distinct (lengths [F * B], values) pairs for this rank."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, args.max_length, (args.tables * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        out.append((lengths, values))
    return out


def plan_generators(kind: str, tables: int, world: int, lib: Any) -> dict[str, Any]:
    """Per table, the plan generator of ``kind`` (``lib``: tritonrec.dist or torchrec's sharding_plan)."""
    names = [f"t{i}" for i in range(tables)]
    if kind == "table_wise":
        return {n: lib.table_wise(rank=i % world) for i, n in enumerate(names)}
    if kind == "row_wise":
        return {n: lib.row_wise() for n in names}
    if kind == "column_wise":
        return {n: lib.column_wise(ranks=list(range(world))) for n in names}
    if kind == "table_column_wise":
        return {n: lib.table_column_wise(ranks=list(range(world))) for n in names}
    if kind == "data_parallel":
        return {n: lib.data_parallel() for n in names}
    if kind == "table_row_wise":
        return {n: lib.table_row_wise(host_index=0) for n in names}
    return {n: lib.grid_shard(host_indexes=[0, 0]) for n in names}


# ------------------------------------------------------------------------------------------------------- ours
def build_ours(args: argparse.Namespace, kind: str, world: int) -> tuple[Any, Any]:
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingEnv, construct_module_sharding_plan
    from tritonrec.dist import sharding_plan as lib
    from tritonrec.kernels.embedding import OptimType
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables, device="meta")
    fused = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    plan = construct_module_sharding_plan(
        ebc, plan_generators(kind, args.tables, world, lib), sharder, world, world, "cpu"
    )
    for sharding in plan.values():
        sharding.compute_kernel = "fused"
    model = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    keys = [f"f{i}" for i in range(args.tables)]

    def step(batch: tuple[torch.Tensor, torch.Tensor], grad: torch.Tensor) -> None:
        lengths, values = batch
        out = model(KeyedJaggedTensor(keys, values, lengths=lengths)).wait()
        out.values().backward(grad)

    return model, step


# ----------------------------------------------------------------------------------------------------- torchrec
def build_torchrec(args: argparse.Namespace, kind: str, world: int) -> tuple[Any, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import sharding_plan as lib
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    tables = [
        EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    generators = plan_generators(kind, args.tables, world, lib)
    module_plan = construct_module_sharding_plan(ebc, generators, sharder, world, world, "cpu")
    if kind != "data_parallel":
        # torchrec's plan generators pick the dense kernel unless the parameter carries an in-backward optimizer:
        # that kernel would only accumulate dense gradients (no optimizer step at all). Fused is what ours runs.
        for sharding in module_plan.values():
            sharding.compute_kernel = "fused"
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    model = DistributedModelParallel(
        ebc, env=env, device=torch.device("cpu"), plan=ShardingPlan({"": module_plan}), sharders=[sharder]
    )
    optimizer = CombinedOptimizer([model.fused_optimizer])
    if kind == "data_parallel":  # torchrec's data-parallel tables are dense: DDP all-reduces, RowWiseAdagrad steps
        dense = dict(in_backward_optimizer_filter(model.named_parameters()))
        rowwise = KeyedOptimizerWrapper(dense, lambda params: RowWiseAdagrad(params, lr=0.01))
        optimizer = CombinedOptimizer([model.fused_optimizer, rowwise])
    keys = [f"f{i}" for i in range(args.tables)]

    def step(batch: tuple[torch.Tensor, torch.Tensor], grad: torch.Tensor) -> None:
        lengths, values = batch
        out = model(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths))
        out = out.wait() if hasattr(out, "wait") else out
        out.values().backward(grad)
        optimizer.step()
        optimizer.zero_grad()

    return model, step


# ------------------------------------------------------------------------------------------------------- ranks
def _time_steps(step: Any, batches: list, grad: torch.Tensor, steps: int, warmup: int, counter: WireCounter) -> dict:
    for i in range(warmup):
        step(batches[i % len(batches)], grad)
    dist.barrier()
    counter.bytes = 0
    samples = []
    cpu_start = _cpu_seconds()
    for i in range(steps):
        t0 = time.perf_counter()
        step(batches[(warmup + i) % len(batches)], grad)
        samples.append((time.perf_counter() - t0) * 1e3)
    cpu_ms = (_cpu_seconds() - cpu_start) / steps * 1e3
    wire = counter.bytes / steps
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # this fresh process's peak
    worst = torch.tensor([statistics.median(samples), peak_mb, cpu_ms], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"median_ms": float(worst[0]), "wire_bytes_per_rank": wire, "peak_rss_mb": float(worst[1]),
            "cpu_ms": float(worst[2])}  # fmt: skip


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads, gloo's included): what a step costs whatever else runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, impl: str, kind: str, results: Any) -> None:
    """One (implementation, sharding type) measurement in a fresh process per rank (so its peak RSS is its own)."""
    try:
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
        torch.set_num_threads(args.threads)
        init_local_rank("gloo", port, rank, world)
        counter = WireCounter()
        counter.install()
        batches = make_batches(args, rank, args.steps + args.warmup)
        grad = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(rank))
        try:
            build = build_ours if impl == "tritonrec" else build_torchrec
            _, step = build(args, kind, world)
            result = {"status": "ok", **_time_steps(step, batches, grad, args.steps, args.warmup, counter)}
        except Exception as err:  # torchrec refusing a sharding type on CPU is a result, not a crash
            if args.verbose and rank == 0:
                traceback.print_exc()
            result = {"status": "refused", "error": f"{type(err).__name__}: {err}".splitlines()[0][:160]}
        results.put((rank, True, result))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_once(args: argparse.Namespace, impl: str, kind: str) -> dict[str, Any]:
    return spawn_ranks(rank_main, args.world, args, impl, kind)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank")
    parser.add_argument("--max-length", type=int, default=40, help="pooling lengths ~ U[0, max_length)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (more than the metadata-checked "
                        f"calls, {DEFAULT_CHECKED_CALLS}, so the steady state is timed)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--no-torchrec", dest="torchrec", action="store_false")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--csv", default="sharded_ebc_cpu.csv")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    if args.torchrec:
        try:
            import torchrec  # noqa: F401
        except Exception:
            print("torchrec is not installed: no anchor rows")
            args.torchrec = False
    impls = ["tritonrec"] + (["torchrec"] if args.torchrec else [])
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    loads = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        for kind in args.types:
            # the order alternates per round, so neither implementation always runs right after the other
            for impl in impls if round_ % 2 == 0 else impls[::-1]:
                key = (impl, kind)
                if rows.get(key, {}).get("status", "ok") != "ok":
                    continue
                result = measure_once(args, impl, kind)
                if result["status"] != "ok":
                    rows[key] = result
                    continue
                entry = rows.setdefault(key, {"status": "ok", "medians": {}, "cpu": {}, "wire": 0.0})
                entry["medians"][round_] = result["median_ms"]
                entry["cpu"][round_] = result["cpu_ms"]
                entry["wire"] = result["wire_bytes_per_rank"]
                entry["peak_rss_mb"] = max(entry.get("peak_rss_mb", 0.0), result["peak_rss_mb"])
        loads.append(os.getloadavg()[0])
        print(f"round {round_ + 1}/{args.rounds} done (load average {loads[-1]:.1f})", flush=True)
    report(args, rows, loads)


def _paired_ratios(anchor: dict[int, float], mine: dict[int, float]) -> list[float]:
    """Per round in which both ran: anchor / ours (each round's two runs are neighbours in time)."""
    return [anchor[r] / mine[r] for r in sorted(anchor) if r in mine and mine[r] > 0]


def report(args: argparse.Namespace, measured: dict[tuple[str, str], dict[str, Any]], loads: list[float]) -> None:
    rows = []
    for (impl, kind), entry in measured.items():
        row: dict[str, Any] = {"impl": impl, "sharding": kind, "status": entry["status"], "tables": args.tables,
                               "rows": args.rows, "dim": args.dim, "batch_per_rank": args.batch, "world": args.world,
                               "rounds": args.rounds, "steps_per_round": args.steps,
                               "load_avg_min": min(loads), "load_avg_max": max(loads)}  # fmt: skip
        if entry["status"] == "ok":
            medians = list(entry["medians"].values())
            row["ms_per_step"] = statistics.median(medians)
            row["ms_min_round"], row["ms_max_round"] = min(medians), max(medians)
            row["steps_per_s"] = 1e3 / row["ms_per_step"]
            row["cpu_ms_per_step"] = statistics.median(entry["cpu"].values())
            row["wire_mb_per_rank_step"] = entry["wire"] / 1e6
            row["peak_rss_mb_max_rank"] = entry["peak_rss_mb"]
            if impl == "torchrec" and kind == "data_parallel":
                row["note"] = "DDP's all-reduce runs in C++: its bytes are not counted"
        else:
            row["note"] = entry.get("error", entry["status"])
        rows.append(row)
    for row in rows:
        theirs = measured[(row["impl"], row["sharding"])]
        mine = measured.get(("tritonrec", row["sharding"]), {})
        if row["impl"] != "torchrec" or theirs["status"] != "ok" or mine.get("status") != "ok":
            continue
        ours = next(r for r in rows if r["impl"] == "tritonrec" and r["sharding"] == row["sharding"])
        ratios = _paired_ratios(theirs["medians"], mine["medians"])
        ours["speedup_vs_torchrec"] = statistics.median(ratios)
        ours["speedup_min_round"], ours["speedup_max_round"] = min(ratios), max(ratios)
        ours["cpu_speedup_vs_torchrec"] = statistics.median(_paired_ratios(theirs["cpu"], mine["cpu"]))
    print_table(rows, ["impl", "sharding", "status", "ms_per_step", "ms_min_round", "ms_max_round", "cpu_ms_per_step",
                       "wire_mb_per_rank_step", "peak_rss_mb_max_rank", "speedup_vs_torchrec", "speedup_min_round",
                       "speedup_max_round", "cpu_speedup_vs_torchrec", "note"])  # fmt: skip
    print(f"threads per rank: {args.threads}; {args.rounds} rounds x {args.steps} steps (after {args.warmup} warm-up "
          f"steps) per implementation and type, each round in fresh processes; ms: the slowest rank's median per "
          f"round, then the median over rounds (min/max: the rounds' range); speedup: median over rounds of the "
          f"same round's ratio; cpu: process CPU time per step (the slowest rank), load-independent; load average "
          f"during the run {min(loads):.1f}-{max(loads):.1f}; peak RSS: the largest rank's whole process")  # fmt: skip
    columns = ["impl", "sharding", "status", "ms_per_step", "ms_min_round", "ms_max_round", "steps_per_s",
               "cpu_ms_per_step", "wire_mb_per_rank_step", "speedup_vs_torchrec", "speedup_min_round",
               "speedup_max_round", "cpu_speedup_vs_torchrec", "peak_rss_mb_max_rank", "tables", "rows", "dim",
               "batch_per_rank", "world", "rounds", "steps_per_round", "load_avg_min", "load_avg_max",
               "note"]  # fmt: skip
    torch.set_num_threads(args.threads)  # the CSV's threads column: what each rank ran with
    path = append_csv(args.csv, [{c: row.get(c, "") for c in columns} for row in rows])
    if args.plot:
        plot(rows, path.with_suffix(".png"))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["sharding"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for offset, impl in ((-width / 2, "tritonrec"), (width / 2, "torchrec")):
        values = []
        for kind in kinds:
            match = [r for r in rows if r["impl"] == impl and r["sharding"] == kind and r["status"] == "ok"]
            values.append(match[0]["steps_per_s"] if match else 0.0)
        bars = ax.bar([i + offset for i in range(len(kinds))], values, width, label=impl)
        for bar, value in zip(bars, values, strict=True):
            if value == 0.0:
                ax.annotate("refused" if impl == "torchrec" else "-", (bar.get_x() + width / 2, 0), ha="center",
                            va="bottom", fontsize=7, rotation=90)  # fmt: skip
    ax.set_xticks(range(len(kinds)), kinds, rotation=20, fontsize=8)
    ax.set_ylabel("training steps / s (higher is better)")
    ax.set_title("Sharded EBC, fused rowwise Adagrad, 2 gloo ranks on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
