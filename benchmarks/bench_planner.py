"""Planner quality: the measured training-step time of the sharding planner's plan against every plan of a small
exhaustive search, plain table-wise, and torchrec 1.8's planner's plan, on 2 gloo ranks (CPU).

    python benchmarks/bench_planner.py --plot                  # 4 table sets x (~260 plans screened, 10 refined)
    python benchmarks/bench_planner.py --sets uniform --screen-steps 2 --rounds 2

Table sets (4 tables each, pooling factor = mean ids per sample): ``uniform`` (4 x 100k rows, D=64, 20 ids);
``zipf_rows`` (400k / 100k / 25k / 6k rows: sizes falling as 1/4^k); ``skewed_pooling`` (4 x 50k rows, 80 / 20 / 5 /
1 ids); ``mixed_dim`` (4 x 50k rows, D = 8 / 32 / 128 / 256, 10 ids). Each sample's bag length is uniform in
``[0, 2 x factor]``, ids uniform over the table, ``--batch`` samples per rank, a stream of distinct batches.

Plans, all run by tritonrec's sharded modules through ``DistributedModelParallel`` (fused rowwise Adagrad, so the
step is forward, backward and update):

* ``ours``: ``EmbeddingShardingPlanner`` told the batch size and pooling factors (every sharding type allowed), its
  perf model calibrated on this machine first (``tritonrec.dist.planner.calibrate``; ``--no-calibrate``: defaults);
* ``grid_*``: every distinct placed plan of a grid search over {table-wise, row-wise, column-wise, data-parallel} per
  table (``candidate_plans``: 4^4 type choices, tables placed by the partitioner);
* ``table_wise``: table ``k`` on rank ``k % 2``;
* ``torchrec``: torchrec's ``EmbeddingShardingPlanner`` with the same batch size and pooling factors, its plan
  translated to ours (so the plan is compared, not the runtime). On CPU torchrec's sharder offers only
  data-parallel / table-wise / column-wise / table-column-wise (row-wise is refused, torchrec #1252): recorded.

A step is timed from a barrier to its end, as the slowest rank's time. Every distinct plan is screened with
``--screen-steps`` steps (labels with the same plan share one measurement); the ``--refine`` fastest grid plans,
``ours``, ``table_wise`` and ``torchrec`` are then built side by side and stepped in ``--rounds`` rounds, one step of
each per round in rotating order, so load drifting during the run (a shared machine) hits every finalist alike; the
median over rounds is reported with its quartiles. Steps run with the cross-rank metadata checks off (the steady
state a training job reaches after its first calls). The summary also says how well the perf model ranks the grid's
plans: Spearman's rank correlation of its estimates with the screening times (all grid plans) and with the refined
times (the grid finalists).
Appends ``benchmarks/results/planner_quality_cpu.csv`` (``--plot``: ``planner_quality_cpu.png``). The model and the
plans (ours, grid, table-wise, torchrec's translated) are built in ``planner_plans``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import append_csv, print_table, spawn_ranks
from planner_plans import (
    GRID_TYPES,  # noqa: F401  (re-exported: it used to live here)
    LR,  # noqa: F401  (re-exported: it used to live here)
    Tables,
    describe,
    grid_plans,
    our_plan,
    sharder,
    table_wise_plan,
    torchrec_plan,
    translate,  # noqa: F401  (re-exported: it used to live here)
)

from tritonrec.dist.rendezvous import init_local_rank

# table set -> per table (rows, dim, pooling factor)
TABLE_SETS: dict[str, list[tuple[int, int, float]]] = {
    "uniform": [(100_000, 64, 20.0)] * 4,
    "zipf_rows": [(400_000, 64, 20.0), (100_000, 64, 20.0), (25_000, 64, 20.0), (6_000, 64, 20.0)],
    "skewed_pooling": [(50_000, 64, 80.0), (50_000, 64, 20.0), (50_000, 64, 5.0), (50_000, 64, 1.0)],
    "mixed_dim": [(50_000, 8, 10.0), (50_000, 32, 10.0), (50_000, 128, 10.0), (50_000, 256, 10.0)],
}


# ------------------------------------------------------------------------------------------------------- timing
def make_batches(specs: list, batch: int, rank: int, count: int) -> list[Any]:
    from tritonrec.data import KeyedJaggedTensor

    g = torch.Generator().manual_seed(4321 + rank)
    out = []
    for _ in range(count):
        lengths = torch.cat([torch.randint(0, int(2 * f) + 1, (batch,), generator=g) for _, _, f in specs])
        values = []
        for i, (rows, _, _) in enumerate(specs):
            n = int(lengths[i * batch : (i + 1) * batch].sum())
            values.append(torch.randint(0, rows, (n,), generator=g))
        out.append(KeyedJaggedTensor([f"f{i}" for i in range(len(specs))], torch.cat(values), lengths=lengths))
    return out


class PlanRunner:
    """The DMP of ``Tables`` under one plan, ready to step (a stream of distinct batches, cycled)."""

    def __init__(self, plan: Any, specs: list, batches: list, warmup: int) -> None:
        from tritonrec.dist import DistributedModelParallel

        self.model = DistributedModelParallel(Tables(specs), plan=plan, sharders=[sharder()])
        self.batches = batches
        width = sum(d for _, d, _ in specs)
        self.grads = [torch.randn(b.stride(), width, generator=torch.Generator().manual_seed(i))
                      for i, b in enumerate(batches)]  # fmt: skip
        self.count = 0
        for _ in range(warmup):
            self.step()

    def step(self) -> None:
        i = self.count % len(self.batches)
        self.model(self.batches[i]).values().backward(self.grads[i])
        self.count += 1

    def timed_step(self) -> float:
        """One step started together on every rank: the slowest rank's ms."""
        dist.barrier()
        t0 = time.perf_counter()
        self.step()
        elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)


def time_plan(plan: Any, specs: list, batches: list, steps: int, warmup: int) -> float:
    """Median over ``steps`` of the slowest rank's ms per training step (screening)."""
    runner = PlanRunner(plan, specs, batches, warmup)
    return statistics.median(runner.timed_step() for _ in range(steps))


def plans_for(specs: list, args: argparse.Namespace) -> dict[str, Any]:
    """Label -> (plan, our perf model's estimate in ms or nan, note); computed on rank 0, sent to every rank."""
    plans: dict[str, Any] = {}
    if dist.get_rank() == 0:
        plan, estimate = our_plan(specs, args.batch, args.calibration)
        plans["ours"] = (plan, estimate * 1e3, "")
        plans["table_wise"] = (table_wise_plan(specs), float("nan"), "")
        if args.torchrec:
            their, note = torchrec_plan(specs, args.batch)
            if their is not None:
                plans["torchrec"] = (their, float("nan"), note)
            else:
                plans["torchrec"] = (None, float("nan"), note)
        for k, (plan, estimate) in enumerate(grid_plans(specs, args.batch, args.calibration)[: args.max_grid]):
            plans[f"grid_{k:03d}"] = (plan, estimate * 1e3, "")
    box = [plans]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def run_set(name: str, args: argparse.Namespace, rank: int) -> list[dict[str, Any]]:
    """Screen every distinct plan once, then time the finalists in interleaved rounds; one row per label (labels
    with the same plan share its measurement)."""
    specs = TABLE_SETS[name]
    plans = plans_for(specs, args)
    batches = make_batches(specs, args.batch, rank, args.warmup + max(args.rounds, args.screen_steps))
    signature = {label: str(plan) for label, (plan, _, _) in plans.items() if plan is not None}
    distinct = {sig: label for label, sig in reversed(list(signature.items()))}  # signature -> its first label
    screened: dict[str, float] = {}
    for sig, label in distinct.items():
        started = time.perf_counter()
        screened[sig] = time_plan(plans[label][0], specs, batches, args.screen_steps, args.warmup)
        gc.collect()
        if args.verbose and rank == 0:
            print(f"  {name} {label} {describe(plans[label][0])}: {screened[sig]:.1f} ms/step "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)  # fmt: skip
    named = [signature[label] for label in ("ours", "table_wise", "torchrec") if label in signature]
    grid = sorted((t, sig) for sig, t in screened.items() if sig not in named)
    finalists = list(dict.fromkeys(named + [sig for _, sig in grid[: args.refine]]))
    # every finalist built at once, then stepped in rotating order, one step each per round: load drifting during
    # the run hits every finalist alike
    runners = {sig: PlanRunner(plans[distinct[sig]][0], specs, batches, args.warmup) for sig in finalists}
    rounds: dict[str, list[float]] = {sig: [] for sig in finalists}
    for round_ in range(args.rounds):
        shift = round_ % len(finalists)
        for sig in finalists[shift:] + finalists[:shift]:
            rounds[sig].append(runners[sig].timed_step())
    del runners
    gc.collect()
    if rank == 0:
        print(f"{name}: {len(plans)} plans, {len(distinct)} distinct screened, {len(finalists)} refined", flush=True)
    rows = []
    for label, (plan, estimate, note) in plans.items():
        sig = signature.get(label)
        refined = sig in rounds
        measured = statistics.median(rounds[sig]) if refined else screened.get(sig, float("nan"))  # type: ignore[arg-type]
        spread = _quartiles(rounds[sig]) if refined else (float("nan"), float("nan"))  # type: ignore[index]
        rows.append({"table_set": name, "plan": label, "sharding": describe(plan) if plan is not None else "",
                     "measured_ms": measured, "p25_ms": spread[0], "p75_ms": spread[1],
                     "refined": refined, "estimated_ms": estimate, "screen_ms": screened.get(sig, float("nan")),  # type: ignore[arg-type]
                     "note": note})  # fmt: skip
    return rows


def _quartiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    try:
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
        # the steady state is timed: the cross-rank metadata checks of each module's first calls (which would fall
        # in the screening steps) are off
        os.environ["TRITONREC_DIST_CHECKS"] = "0"
        torch.set_num_threads(args.threads)
        init_local_rank("gloo", port, rank, world)
        rows = []
        for name in args.sets:
            rows += run_set(name, args, rank)
        results.put((rank, True, rows))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------ report
def spearman(estimated: list[float], measured: list[float]) -> float:
    """Rank correlation of the perf model's estimates with the measured times (1: the model orders plans right)."""
    import numpy as np

    pairs = [(e, m) for e, m in zip(estimated, measured, strict=True) if e == e and m == m]  # drop NaNs
    if len(pairs) < 3:
        return float("nan")
    ranks = np.argsort(np.argsort(np.asarray(pairs), axis=0), axis=0).astype(float)
    return float(np.corrcoef(ranks[:, 0], ranks[:, 1])[0, 1])


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per table set: ours, the best refined plan, table-wise, torchrec, the ratios, and how well the perf model
    ranks the grid's plans (Spearman of estimate vs screening time over all, vs refined time over the finalists)."""
    out = []
    for name in dict.fromkeys(r["table_set"] for r in rows):
        refined = [r for r in rows if r["table_set"] == name and r["refined"]]
        by_label = {r["plan"]: r for r in rows if r["table_set"] == name}
        best = min(refined, key=lambda r: r["measured_ms"])
        ours = by_label["ours"]["measured_ms"]
        theirs = by_label.get("torchrec", {}).get("measured_ms", float("nan"))
        measured = sum(1 for r in rows if r["table_set"] == name and r["screen_ms"] > 0)
        grid = [r for r in rows if r["table_set"] == name and r["plan"].startswith("grid_")]
        finalists = [r for r in grid if r["refined"]]
        out.append({"table_set": name, "ours_ms": ours, "best_ms": best["measured_ms"], "best_plan": best["plan"],
                    "best_sharding": best["sharding"], "ours_over_best": ours / best["measured_ms"],
                    "table_wise_ms": by_label["table_wise"]["measured_ms"], "torchrec_ms": theirs,
                    "ours_over_torchrec": ours / theirs, "ours_sharding": by_label["ours"]["sharding"],
                    "torchrec_sharding": by_label.get("torchrec", {}).get("sharding", ""),
                    "plans_measured": measured,
                    "spearman_screened": spearman([r["estimated_ms"] for r in grid], [r["screen_ms"] for r in grid]),
                    "spearman_refined": spearman([r["estimated_ms"] for r in finalists],
                                                 [r["measured_ms"] for r in finalists])})  # fmt: skip
    return out


def plot(rows: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for x, s in enumerate(summary):
        grid = [r["screen_ms"] for r in rows if r["table_set"] == s["table_set"] and r["plan"].startswith("grid_")]
        ax.scatter([x - 0.3] * len(grid), grid, s=6, color="0.7", label="grid plans (screening)" if x == 0 else None)
        for dx, key, color, label in ((-0.1, "best_ms", "tab:green", "best measured"), (0.05, "ours_ms", "tab:blue",
                                      "ours"), (0.2, "torchrec_ms", "tab:orange", "torchrec's plan"),
                                      (0.35, "table_wise_ms", "tab:red", "table-wise")):  # fmt: skip
            ax.bar(x + dx, s[key], 0.14, color=color, label=label if x == 0 else None)
    ax.set_xticks(range(len(summary)), [s["table_set"] for s in summary])
    ax.set_ylabel("ms per training step (slowest rank; lower is better)")
    ax.set_title("Planner quality: 2 gloo ranks on CPU, fused rowwise Adagrad")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(TABLE_SETS), choices=list(TABLE_SETS))
    parser.add_argument("--batch", type=int, default=256, help="samples per rank")
    parser.add_argument("--screen-steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40, help="refinement rounds (one step of each finalist)")
    parser.add_argument("--refine", type=int, default=8, help="grid plans (fastest screened) timed in the rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--calibration", default=None, help="planner calibration JSON (default: measure one now)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    parser.add_argument("--no-torchrec", dest="torchrec", action="store_false")
    parser.add_argument("--max-grid", type=int, default=None, help="screen only the first N grid plans (a quick run)")
    parser.add_argument("--verbose", action="store_true", help="print each screened plan")
    parser.add_argument("--csv", default="planner_quality_cpu.csv")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    if args.calibration is None and args.calibrate:
        from tritonrec.dist.planner.calibrate import calibrate

        torch.set_num_threads(args.threads)
        started = time.perf_counter()
        path = Path(tempfile.mkdtemp(prefix="tritonrec-bench-planner-")) / "calibration_cpu.json"
        calibrate("cpu", 2).save(path)
        args.calibration = str(path)
        print(f"calibrated the perf model in {time.perf_counter() - started:.0f} s -> {path}", flush=True)
    rows = spawn_ranks(rank_main, 2, args)[0]
    summary = summarize(rows)
    print_table([r for r in rows if r["refined"]], ["table_set", "plan", "sharding", "measured_ms", "estimated_ms",
                                                    "screen_ms", "note"])  # fmt: skip
    print()
    print_table(summary, ["table_set", "ours_ms", "best_ms", "ours_over_best", "torchrec_ms", "ours_over_torchrec",
                          "table_wise_ms", "spearman_screened", "spearman_refined", "ours_sharding", "best_sharding",
                          "torchrec_sharding"])  # fmt: skip
    print(f"threads per rank: {args.threads}; calibration: {args.calibration or 'documented defaults'}")
    path = append_csv(args.csv, [{**r, "batch_per_rank": args.batch, "rounds": args.rounds} for r in rows])
    append_csv(Path(args.csv).with_name(Path(args.csv).stem + "_summary.csv"), summary)
    if args.plot:
        plot(rows, summary, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
