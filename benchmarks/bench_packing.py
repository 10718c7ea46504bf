"""Sequence packing benchmark: bins against the lower bound and packing time for every algorithm, token balance over 8
ranks, and pack / unpack throughput.

Workloads: N in {1,024; 16,384; 262,144} lengths at capacity 1,200, uniform in [50, 800] and log-normal (median 245
tokens, sigma 0.7, clipped to [16, 1,200]).

Anchor, measured in the same run on the same lengths: NeMo-RL's modified first-fit decreasing, re-implemented below in
pure Python step for step (NeMo-RL is neither installed nor vendored). Its list scans are quadratic, so it is timed up
to 16,384 lengths; at 262,144 it would run for hours and is reported as skipped.

This run is CPU only (no GPU in the environment): the Triton kernels are not timed (the interpreter's speed means
nothing), the pack / unpack rows time the torch twin, the CPU path, against a same-size copy. torch runs one thread:
the 2-core machine is shared, and two intra-op threads stall each other under contention (30-100x slower ops).

Usage: ``python benchmarks/bench_packing.py`` (``--plot-only`` redraws the PNG from the CSVs; ``--quick`` runs the
1,024-length cases only and writes nothing).
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from bisect import bisect_right
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from harness import (
    RESULTS_DIR,
    append_csv,
    copy_bandwidth_gbps,
    gbps,
    measure,
    print_table,
    results_dir,
    tensor_bytes,
)

from tritonrec.data.packing import (
    PackingAlgorithm,
    balance_bins_across_ranks,
    get_packer,
    rank_imbalance,
    theoretical_min_bins,
)
from tritonrec.kernels.pack_sequences import bin_assignment, make_packing_plan, pack_sequences, unpack_sequences

CAPACITY = 1200
SIZES = (1024, 16384, 262144)
DISTRIBUTIONS = ("uniform", "lognormal")
RANKS = 8
ANCHOR = "nemo_rl_mffd (re-implementation)"
ALGORITHMS_CSV = "packing_algorithms.csv"
BALANCE_CSV = "packing_rank_balance.csv"
KERNEL_CSV = "packing_kernel.csv"
PLOT = "packing_algorithms.png"  # next to the CSVs (see harness.results_dir)


def make_lengths(distribution: str, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        return rng.integers(50, 801, count)
    return np.clip(np.rint(rng.lognormal(np.log(245), 0.7, count)), 16, CAPACITY).astype(np.int64)


def nemo_rl_mffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """Re-implementation of NeMo-RL's ``ModifiedFirstFitDecreasingPacker`` for timing and bin counts: the same five
    phases on Python lists (scans and ``list.pop``), including its last phase, which offers each leftover item
    only to the least-loaded leftover bin."""
    for length in lengths:  # NeMo-RL validates item by item first
        if length > capacity:
            raise ValueError(f"Sequence length {length} exceeds bin capacity {capacity}")
    items = list(enumerate(lengths))
    large = sorted((it for it in items if it[1] > capacity / 2), key=lambda it: it[1], reverse=True)
    medium = sorted((it for it in items if capacity / 3 < it[1] <= capacity / 2), key=lambda it: it[1], reverse=True)
    small = sorted((it for it in items if capacity / 6 < it[1] <= capacity / 3), key=lambda it: it[1])
    tiny = sorted((it for it in items if it[1] <= capacity / 6), key=lambda it: it[1])
    bins = [[it] for it in large]
    for contents in bins:  # one medium item per large bin, the largest that fits
        room = capacity - sum(size for _, size in contents)
        for k, (_, size) in enumerate(medium):
            if size <= room:
                contents.append(medium.pop(k))
                break
    for contents in reversed(bins):  # two small items into large bins without a medium one
        if any(capacity / 3 < size <= capacity / 2 for _, size in contents) or len(small) < 2:
            continue
        room = capacity - sum(size for _, size in contents)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        for k in range(len(small) - 1, -1, -1):
            if small[k][1] <= room - first[1]:
                contents.extend([first, small.pop(k)])
                break
    rest = sorted(medium + small + tiny, key=lambda it: it[1], reverse=True)
    for contents in bins:  # fill each bin with the largest items that fit
        while rest:
            room = capacity - sum(size for _, size in contents)
            if room < rest[-1][1]:
                break
            k = next((k for k, (_, size) in enumerate(rest) if size <= room), None)
            if k is None:
                break
            contents.append(rest.pop(k))
    leftover_bins: list[list[tuple[int, int]]] = [[]]
    loads = [0]  # ascending; only the emptiest leftover bin is tried
    for item in rest:
        if item[1] <= capacity - loads[0]:
            contents, load = leftover_bins.pop(0), loads.pop(0)
        else:
            contents, load = [], 0
        contents.append(item)
        load += item[1]
        where = bisect_right(loads, load)
        leftover_bins.insert(where, contents)
        loads.insert(where, load)
    bins.extend(leftover_bins)
    return [[index for index, _ in contents] for contents in bins if contents]


def pack_with(algorithm: str, lengths: np.ndarray) -> list[list[int]]:
    return get_packer(algorithm, CAPACITY, seed=0).pack(lengths)


def timed_packing(run: Callable[[], list[list[int]]], count: int) -> tuple[list[list[int]], dict[str, float]]:
    """Bins and timing from the same calls (262,144 lengths: one call, which already takes seconds for some)."""
    produced: list[list[list[int]]] = []
    record = lambda: produced.append(run())  # keeps the bins of the timed calls
    if count >= 100_000:
        timed = measure(record, warmup=0, repeats=1, min_time_s=0.0)
    else:
        timed = measure(record, warmup=1, repeats=5 if count > 2000 else 20, min_time_s=0.2)
    return produced[-1], timed


def algorithm_rows(sizes: tuple[int, ...]) -> list[dict]:
    rows = []
    for distribution in DISTRIBUTIONS:
        for count in sizes:
            lengths = make_lengths(distribution, count)
            bound = theoretical_min_bins(lengths, CAPACITY)
            runs = [(a.value, "tritonrec", partial(pack_with, a.value, lengths)) for a in PackingAlgorithm]
            runs.append(
                (ANCHOR, "anchor: pure-Python re-implementation", partial(nemo_rl_mffd, lengths.tolist(), CAPACITY))
            )
            for name, source, run in runs:
                row = {"distribution": distribution, "n": count, "capacity": CAPACITY, "algorithm": name}
                row |= {"source": source, "lower_bound": bound}
                if name == ANCHOR and count > 16384:
                    skipped = {"bins": "", "gap_pct": "", "median_ms": "", "note": "skipped: quadratic scans"}
                    rows.append(row | skipped | {"load_1min": ""})
                    continue
                bins, timed = timed_packing(run, count)
                assert sorted(i for b in bins for i in b) == list(range(count))
                assert max(int(lengths[b].sum()) for b in bins) <= CAPACITY
                gap = 100.0 * (len(bins) - bound) / bound
                note = f"p10 {timed['p10_ms']:.2f} ms, p90 {timed['p90_ms']:.2f} ms, {int(timed['repeats'])} runs"
                ms = timed["median_ms"]
                row |= {"bins": len(bins), "gap_pct": round(gap, 3), "median_ms": round(ms, 2), "note": note}
                rows.append(row | {"load_1min": round(os.getloadavg()[0], 2)})  # the 2-core machine is shared
                print(f"{distribution:9s} {count:7d} {name:34s} {len(bins):6d} bins (+{gap:.3f} %) {ms:9.2f} ms")
    return rows


def balance_rows(sizes: tuple[int, ...]) -> list[dict]:
    """Tokens per rank (max / mean) when bins are dealt round-robin to 8 ranks, as shard_by_batch_size does, with
    the packer's order and after balance_bins_across_ranks (bins never split, so never over capacity)."""
    rows = []
    for distribution in DISTRIBUTIONS:
        for count in sizes:
            lengths = make_lengths(distribution, count)
            for algorithm in PackingAlgorithm:
                packer = get_packer(algorithm, CAPACITY, min_bin_count=RANKS, bin_count_multiple=RANKS, seed=0)
                bins = packer.pack(lengths)
                started = time.perf_counter()
                balanced = balance_bins_across_ranks(bins, lengths, RANKS)
                balance_ms = (time.perf_counter() - started) * 1e3
                rows.append(
                    {
                        "distribution": distribution,
                        "n": count,
                        "algorithm": algorithm.value,
                        "ranks": RANKS,
                        "bins": len(bins),
                        "round_robin_max_over_mean": round(rank_imbalance(lengths, bins, RANKS), 5),
                        "kk_balanced_max_over_mean": round(rank_imbalance(lengths, balanced, RANKS), 5),
                        "balance_ms": round(balance_ms, 2),
                    }
                )
    return rows


def kernel_rows(count: int) -> list[dict]:
    """Pack then unpack on CPU with the torch twin (the CPU path); GB/s counts real tokens read and written."""
    rows = []
    lengths = make_lengths("uniform", count, seed=1)
    bins = get_packer("best_two_fit", CAPACITY).pack(lengths)
    order, bin_offsets = bin_assignment(bins)
    width = int(lengths.max())
    cases = [("token ids int64 [B, S]", torch.int64, ()), ("hidden fp32 [B, S, 16]", torch.float32, (16,))]
    for label, dtype, feature in cases:
        for capacity in (None, CAPACITY):
            plan = make_packing_plan(
                order, bin_offsets, lengths=torch.from_numpy(lengths), padded_len=width, capacity=capacity
            )
            values = torch.ones((len(lengths), width, *feature), dtype=dtype)
            packed = pack_sequences(values, plan, backend="torch")
            moved = 2 * int(lengths.sum()) * tensor_bytes(values[0, :1])  # each real token read once, written once
            anchor = copy_bandwidth_gbps(moved // 2)
            for op, run in (
                ("pack", lambda v=values, p=plan: pack_sequences(v, p, backend="torch")),
                ("unpack", lambda t=packed.tokens, p=plan: unpack_sequences(t, p, backend="torch")),
            ):
                timed = measure(run, warmup=2, repeats=10)
                rows.append(
                    {
                        "case": label,
                        "layout": "flat [T, *]" if capacity is None else f"bins [{plan.num_bins}, {capacity}, *]",
                        "op": op,
                        "backend": "torch twin (CPU); Triton not timed: no GPU",
                        "sequences": len(lengths),
                        "tokens": int(lengths.sum()),
                        "median_ms": round(timed["median_ms"], 3),
                        "gbps": round(gbps(moved, timed["median_ms"]), 3),
                        "copy_anchor_gbps": round(anchor, 3),
                        "load_1min": round(os.getloadavg()[0], 2),
                    }
                )
    return rows


def read_rows(name: str) -> list[dict]:
    """This run's CSV, or the committed one when this run wrote none (``--plot-only``)."""
    path = results_dir() / name
    with (path if path.exists() else RESULTS_DIR / name).open() as handle:
        return list(csv.DictReader(handle))


def plot(path: Path | None = None) -> None:
    path = path or results_dir() / PLOT
    path.parent.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_rows(ALGORITHMS_CSV) if r["bins"]]
    names = [a.value for a in PackingAlgorithm] + [ANCHOR]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    for column, distribution in enumerate(DISTRIBUTIONS):
        for name in names:
            mine = sorted(
                (int(r["n"]), float(r["gap_pct"]), float(r["median_ms"]))
                for r in rows
                if r["distribution"] == distribution and r["algorithm"] == name
            )
            if not mine:
                continue
            sizes, gaps, times = zip(*mine, strict=True)
            style = {"linestyle": "--", "marker": "s"} if name == ANCHOR else {"marker": "o"}
            axes[0, column].plot(sizes, np.maximum(gaps, 1e-3), label=name, **style)
            axes[1, column].plot(sizes, times, label=name, **style)
        axes[0, column].axhline(0.2, color="grey", linewidth=0.8, linestyle=":")
        title = f"{distribution}: bins above the lower bound (%, 0 drawn at 0.001)"
        axes[0, column].set(xscale="log", yscale="log", title=title)
        axes[1, column].axhline(30, color="grey", linewidth=0.8, linestyle=":")
        axes[1, column].set(
            xscale="log", yscale="log", xlabel="sequences", title=f"{distribution}: packing time (ms, CPU)"
        )
    axes[0, 0].legend(fontsize=8)
    figure.suptitle(f"Sequence packing at capacity {CAPACITY} (dotted: 0.2 % and 30 ms goals)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the CSVs")
    parser.add_argument("--quick", action="store_true", help="1,024 lengths only; print, write nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.plot_only:
        sizes = SIZES[:1] if args.quick else SIZES
        algorithms = algorithm_rows(sizes)
        columns = ["distribution", "n", "algorithm", "bins", "lower_bound", "gap_pct", "median_ms", "note", "load_1min"]
        print_table(algorithms, columns)
        balance = balance_rows(sizes[:2])
        print_table(balance, list(balance[0]))
        kernel = kernel_rows(256 if args.quick else 4096)
        print_table(kernel, ["case", "layout", "op", "median_ms", "gbps", "copy_anchor_gbps", "load_1min"])
        if args.quick:
            return
        append_csv(ALGORITHMS_CSV, algorithms)
        append_csv(BALANCE_CSV, balance)
        append_csv(KERNEL_CSV, kernel)
    plot()


if __name__ == "__main__":
    main()
