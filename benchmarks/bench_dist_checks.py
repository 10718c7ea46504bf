"""Cost of the collective metadata check (``tritonrec.dist.comm_consistency``) on spawned gloo ranks (CPU):

    python benchmarks/bench_dist_checks.py [--worlds 2 4] [--repeats 300]

Per world size, three rows timed the same way in the same run, over a stream of distinct inputs:

* ``all_gather int64[2 + 2W]``: the check's own collective, alone (what a checked call adds on the wire);
* ``alltoall_pooled, checks off`` (the anchor): a small pooled all-to-all (``[W * 64, 16]`` fp32 per rank) through
  the public op with ``TRITONREC_DIST_CHECKS=0``, i.e. what every call after the first 8 of an instance costs;
* ``alltoall_pooled, checks on``: the same calls with ``TRITONREC_DIST_CHECKS=1`` (every call checked).

Timings are the slowest rank's median over ``repeats`` calls (every call is a collective, so all ranks make the same
number). Appends ``dist_checks_cpu.csv`` to this run's results folder (see ``harness.results_dir``).
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from harness import append_csv, measure, print_table, spawn_ranks

from tritonrec.dist.rendezvous import init_local_rank
from tritonrec.dist.tensor_collectives import all_gather_tensor

ROWS_PER_RANK, DIM = 64, 16


def _time(fn: Any, repeats: int) -> dict[str, float]:
    return measure(fn, warmup=10, repeats=repeats, min_time_s=0.0)  # a fixed call count: every call is collective


def _rank(rank: int, world: int, port: int, repeats: int, results: Any) -> None:
    from tritonrec.dist.comm_ops import alltoall_pooled

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_local_rank("gloo", port, rank, world, datetime.timedelta(seconds=120))
    inputs = [torch.randn(world * ROWS_PER_RANK, DIM) for _ in range(16)]  # distinct inputs, cycled
    step = iter(range(10**9))
    local = torch.zeros(2 + 2 * world, dtype=torch.int64)
    gathered = torch.empty(world * local.numel(), dtype=torch.int64)

    def a2a() -> None:
        embs = inputs[next(step) % len(inputs)]
        alltoall_pooled(embs, [ROWS_PER_RANK] * world, [DIM] * world).wait()

    timings = {"all_gather int64[2 + 2W]": _time(lambda: all_gather_tensor(gathered, local), repeats)}
    os.environ["TRITONREC_DIST_CHECKS"] = "0"
    timings["alltoall_pooled, checks off (anchor)"] = _time(a2a, repeats)
    os.environ["TRITONREC_DIST_CHECKS"] = "1"
    timings["alltoall_pooled, checks on"] = _time(a2a, repeats)
    dist.destroy_process_group()
    results.put((rank, True, timings))


def run_world(world: int, repeats: int) -> list[dict[str, Any]]:
    per_rank = spawn_ranks(_rank, world, repeats, timeout_s=600)
    rows = []
    for impl in per_rank[0]:
        slowest = max(per_rank.values(), key=lambda timings: timings[impl]["median_ms"])[impl]
        rows.append({
            "world_size": world, "impl": impl, "median_us": 1e3 * slowest["median_ms"],
            "p10_us": 1e3 * slowest["p10_ms"], "p90_us": 1e3 * slowest["p90_ms"], "repeats": repeats,
            "load_1min": round(os.getloadavg()[0], 2),
        })  # fmt: skip
    off = next(r for r in rows if "checks off" in r["impl"])["median_us"]
    for row in rows:
        row["vs_anchor_us"] = row["median_us"] - off if "alltoall" in row["impl"] else float("nan")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    rows = [row for world in args.worlds for row in run_world(world, args.repeats)]
    print_table(rows, ["world_size", "impl", "median_us", "p10_us", "p90_us", "vs_anchor_us", "load_1min"])
    print("appended to", append_csv("dist_checks_cpu.csv", rows))


if __name__ == "__main__":
    main()
