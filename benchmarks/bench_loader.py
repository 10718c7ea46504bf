"""Loader throughput: samples/s of reading Criteo TSV and npy files into model batches (dense features + KJT +
labels), in-process and with 1 and 2 DataLoader workers, and of the batch cache (memory-mapped cached batches turned
into model batches). Our npy rows: the key-major layout with ids hashed when written (``criteo_tsv_to_npy(...,
num_embeddings=...)``, the fast path) and torchrec's rows layout with raw ids (hashed per read).

In the same run and on the same files, the anchors: torchrec 1.8's Criteo readers where installed
(``criteo_kaggle``'s TSV datapipe batched by ``torch.utils.data.datapipes``' Batcher, plus the row-to-KJT step
torchrec leaves to the user; ``InMemoryBinaryCriteoIterDataPipe`` for npy, with ``mmap_mode`` and ``hashes`` read
and hashed per batch (the like-for-like anchor), wrapped in a ``DataLoader(batch_size=None)`` as the reference DLRM
script does (facebookresearch/dlrm, ``torchrec_dlrm/data/dlrm_dataloader.py``), and also iterated bare; by default
it loads the files and hashes every id in its constructor, untimed, so its passes only slice memory: that one, in a
``DataLoader`` as well and also bare, is the anchor of our batch cache) and the default DLRM's train step on the same
batches (the loader must reach 3x its samples/s so it never bounds a rank's step).

    python benchmarks/bench_loader.py [--rows 122880] [--batch-sizes 2048 8192] [--rounds 5] [--out loader_cpu.csv]
        [--plot] [--cases npy npy_rows npy_hashed ...] [--workers 0]

Batch sizes: 2048 (the criteo_kaggle TSV experiment's) and 8192 (the criteo_terabyte_npy experiment's). One timed
call is one whole pass over the file (every batch distinct); the train-step bar is timed over 5 steps. The
machine may be shared: every case is timed once per round, round after round, in a new random order each round
(interleaved, so load changes hit all cases alike, and no case always inherits the same predecessor's leftovers in the
caches); every batch is read once as its consumer would (``loader_cases.read_once``: the sums of its dense values,
ids and lengths), so batches that are views of a memory-mapped cache pay the reads they defer; wall-clock rates use
the median pass, per-CPU-second rates the pass with the fewest CPU seconds of this process (blind to worker
processes, so in-process rows only). The cases themselves (the TSV, passes, the batch cache, the train steps) are in
``loader_cases``, the torchrec anchors in ``loader_anchors``.

With workers, torchrec's readers are run the way its users parallelise them, in a ``DataLoader`` with as many workers
as ours, which hands batches over through torch's default per-tensor shared memory: its TSV pipe gives each worker
whole files (so the same rows are written as one file per worker for it), its npy pipe takes a ``(rank,
world_size)`` that each worker sets to its own id and count. Our worker rows are compared with those
(``*_vs_torchrec``, like for like) and with torchrec's in-process readers (``*_vs_torchrec_in_process``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import append_csv, print_table
from loader_anchors import (
    HASH,
    split_tsv,
    torchrec_npy_files,
    torchrec_npy_pass,
    torchrec_npy_workers_pass,
    torchrec_tsv_pass,
)
from loader_cases import (
    cached_group,
    cached_pass,
    passes,
    read_once,  # noqa: F401  (re-exported: it used to live here)
    train_steps,
    write_tsv,
)

from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.criteo import CriteoTSVSource
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy
from tritonrec.data.loader import make_rank_loader


def interleaved(runs: list[Callable[[], int]], rounds: int) -> list[tuple[int, list[float], list[float]]]:
    """Each run called once per round, ``rounds`` rounds after one untimed warm-up round, in a new random order each
    round (so no run always follows the same one, whose leftovers in the caches and the heap it would inherit): per
    run ``(samples, wall ms per call, CPU seconds of this process per call)``."""
    results = [(run(), [], []) for run in runs]  # warm-up (page cache, workers, allocator)
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for index in order.permutation(len(runs)).tolist():
            _, walls, cpus = results[index]
            cpu, wall = time.process_time(), time.perf_counter()
            runs[index]()
            walls.append((time.perf_counter() - wall) * 1e3)
            cpus.append(time.process_time() - cpu)
    return results


def timing(walls: list[float]) -> dict[str, float]:
    """The harness's timing columns (median, p10, p90, count) from per-call wall milliseconds."""
    ordered, last = sorted(walls), len(walls) - 1
    return {
        "median_ms": statistics.median(ordered), "p10_ms": ordered[int(0.1 * last)], "p90_ms": ordered[int(0.9 * last)],
        "repeats": len(ordered),
    }  # fmt: skip


class Selection:
    """Which cases run (``--cases`` formats, ``--workers`` counts; ``None``: all); the train-step bar is ``step``."""

    def __init__(self, formats: list[str] | None, workers: list[int] | None) -> None:
        self.formats, self.workers = formats, workers

    def __call__(self, fmt: str, workers: int = 0) -> bool:
        fmt_ok = self.formats is None or fmt in self.formats or (fmt.startswith("cache") and "cache" in self.formats)
        return fmt_ok and (self.workers is None or workers in self.workers)


def bench_batch_size(
    tsv: Path, root: Path, B: int, rounds: int, wanted: Selection | None = None
) -> list[dict[str, Any]]:
    """The ``wanted`` cases at batch size ``B``, interleaved; one CSV row each, with its ratios to its anchor and the
    bar (a case is built only when wanted: the batch caches are filled when built)."""
    wanted = wanted or Selection(None, None)
    rows_prefix, hashed_prefix = root / "rows" / "day_0", root / "hashed" / "day_0"
    cases: list[tuple[str, str, int, Callable[[], Iterable[Any]]]] = []
    for workers in (0, 1, 2):
        if wanted("tsv", workers):
            tsv_loader = make_rank_loader(CriteoTSVSource(tsv, HASH), B, num_workers=workers)
            cases.append(("tritonrec CriteoTSVSource -> Batch", "tsv", workers, lambda lo=tsv_loader: lo))
        if wanted("npy", workers):
            npy_loader = make_rank_loader(CriteoNPYSource(hashed_prefix, HASH), B, num_workers=workers)
            cases.append(("tritonrec CriteoNPYSource (key-major, hashed when written) -> Batch", "npy", workers,
                          lambda lo=npy_loader: lo))  # fmt: skip
    if wanted("npy_rows"):
        rows_loader = make_rank_loader(CriteoNPYSource(rows_prefix, HASH), B)
        cases.append(("tritonrec CriteoNPYSource (rows layout, raw ids) -> Batch", "npy_rows", 0, lambda: rows_loader))
    torchrec_files = root / "torchrec" / "day_0"
    if wanted("npy_rows_torchrec") and torchrec_files.with_name("day_0_sparse.npy").exists():
        # the anchor's own files (a missing id is 0, labels [N, 1]): both readers do exactly the same work
        theirs_loader = make_rank_loader(CriteoNPYSource(torchrec_files, HASH), B)
        cases.append(("tritonrec CriteoNPYSource on torchrec's own npy files (rows, missing id = 0) -> Batch",
                      "npy_rows_torchrec", 0, lambda: theirs_loader))  # fmt: skip
    kjt_cache = root / f"cache_kjt_{B}"
    caches: list[tuple[str, str, Callable[[], DataGroup]]] = [
        ("tritonrec batch cache (defaults: copies, row-major ids) -> Batch", "cache",
         lambda: cached_group(rows_prefix, root / f"cache_{B}", B)),
        ("tritonrec batch cache (cache_views, cache_key_major ids) -> Batch", "cache_key_major",
         lambda: cached_group(rows_prefix, root / f"cache_km_{B}", B, tuned=True)),
        ("tritonrec batch cache (views, key-major; missing id = 0 as torchrec's files)", "cache_one_id",
         lambda: cached_group(rows_prefix, root / f"cache_zero_{B}", B, True, True)),
        ("tritonrec batch cache (defaults: copies; ids as a KJTLayout, empty bags)", "cache_kjt",
         lambda: cached_group(rows_prefix, kjt_cache, B, kjt=True)),
        ("tritonrec batch cache (cache_views; ids as a KJTLayout, empty bags)", "cache_kjt_views",
         lambda: cached_group(rows_prefix, kjt_cache, B, tuned=True, kjt=True)),
        ("tritonrec batch cache (defaults: copies; ids as an int32 KJTLayout, empty bags)", "cache_kjt32",
         lambda: cached_group(rows_prefix, root / f"cache_kjt32_{B}", B, kjt=True, ids_dtype=torch.int32)),
    ]  # fmt: skip
    cases += [(impl, fmt, 0, cached_pass(group())) for impl, fmt, group in caches if wanted(fmt)]
    anchor_notes: dict[str, str] = {}
    try:
        theirs, theirs_hashed = root / "torchrec" / "day_0", root / "torchrec_hashed" / "day_0"
        anchor_cases: list[tuple[str, str, int, Callable[[], Callable[[], Iterable[Any]]]]] = [
            ("anchor: torchrec criteo_kaggle datapipe + Batcher + KJT", "tsv", 0, lambda: torchrec_tsv_pass([tsv], B)),
            ("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (mmap_mode) in a DataLoader", "npy", 0,
             lambda: torchrec_npy_pass(theirs, B, mmap_mode=True, data_loader=True)),
            # the same work as our key-major reader: files hashed when written, read with hashes=None
            ("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (mmap_mode, files hashed when written) in a "
             "DataLoader", "npy_hashed", 0,
             lambda: torchrec_npy_pass(theirs_hashed, B, mmap_mode=True, data_loader=True, hashed_files=True)),
            ("torchrec InMemoryBinaryCriteoIterDataPipe (mmap_mode), bare", "npy_bare", 0,
             lambda: torchrec_npy_pass(theirs, B, mmap_mode=True)),
            # its default mode, wrapped as the reference DLRM script wraps it (ours run in a DataLoader too), and bare
            ("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (in memory, pre-hashed) in a DataLoader", "npy_mem", 0,
             lambda: torchrec_npy_pass(theirs, B, mmap_mode=False, data_loader=True)),
            ("torchrec InMemoryBinaryCriteoIterDataPipe (in memory, pre-hashed), bare", "npy_mem_bare", 0,
             lambda: torchrec_npy_pass(theirs, B, mmap_mode=False)),
        ]  # fmt: skip
        for workers in (1, 2):
            anchor_cases += [
                ("anchor: torchrec CriteoIterDataPipe + Batcher + KJT in a DataLoader (a file per worker)", "tsv",
                 workers, lambda w=workers: torchrec_tsv_pass([tsv] if w == 1 else split_tsv(tsv, w), B, w)),
                ("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (mmap_mode), DataLoader, rank = worker", "npy",
                 workers, lambda w=workers: torchrec_npy_workers_pass(theirs, B, w)),
            ]  # fmt: skip
        cases += [(impl, fmt, workers, make()) for impl, fmt, workers, make in anchor_cases if wanted(fmt, workers)]
    except ImportError as error:
        anchor_notes["tsv"] = anchor_notes["npy"] = f"torchrec anchor unavailable: {error}"
    runs = [passes(make) for *_, make in cases]
    labels = [(impl, fmt, workers) for impl, fmt, workers, _ in cases]
    if wanted("step"):
        runs.append(train_steps(rows_prefix, B, steps=5))
        labels.append(("bar: default DLRM train step (same batches)", "step", 0))
    load = os.getloadavg()[0]
    results = interleaved(runs, rounds)
    load = (load + os.getloadavg()[0]) / 2
    rows_out: list[dict[str, Any]] = []
    for (impl, fmt, workers), (samples, walls, cpus) in zip(labels, results, strict=True):
        wall = timing(walls)
        rows_out.append({
            "bench": "loader", "impl": impl, "format": fmt, "workers": workers, "rows": samples, "batch_size": B,
            **wall, "samples_per_s": samples / (wall["median_ms"] * 1e-3),
            "cpu_samples_per_s": samples / min(cpus) if workers == 0 else None, "load_1min": load,
        })  # fmt: skip
    anchors = {(r["format"], r["workers"]): r for r in rows_out if r["impl"].startswith("anchor")}
    anchor_of = {"npy_rows": "npy", "npy_rows_torchrec": "npy", "npy_bare": "npy", "npy_mem_bare": "npy_mem"}
    anchor_of |= {
        cached: "npy_mem"
        for cached in ("cache", "cache_key_major", "cache_one_id", "cache_kjt", "cache_kjt_views", "cache_kjt32")
    }
    step = next((row for row in rows_out if row["format"] == "step"), None)
    for row in rows_out:
        fmt = anchor_of.get(row["format"], row["format"])
        like, in_process = anchors.get((fmt, row["workers"])), anchors.get((fmt, 0))
        for column in ("samples_per_s", "cpu_samples_per_s"):
            mine, bar = row[column], step[column] if step else None
            for suffix, anchor in (("vs_torchrec", like), ("vs_torchrec_in_process", in_process)):
                theirs_rate = anchor[column] if anchor else None
                row[f"{column}_{suffix}"] = mine / theirs_rate if mine and theirs_rate else None
            row[f"{column}_vs_train_step"] = mine / bar if mine and bar else None
        row["note"] = anchor_notes.get(fmt, "")
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=122_880)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="loader_cpu.csv")
    parser.add_argument("--plot", action="store_true")
    parser.add_argument(
        "--cases", nargs="+", default=None, metavar="FORMAT",
        help="run only these formats (ours and anchors): tsv npy npy_rows npy_rows_torchrec npy_hashed npy_bare "
        "npy_mem npy_mem_bare cache (all cache_*) or one cache_* format, step (the train-step bar); default: all",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="only these loader worker counts")
    args = parser.parse_args()
    wanted = Selection(args.cases, args.workers)
    torch.set_num_threads(args.threads)
    rows_out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        root = Path(tmp)
        tsv = root / "day_0.tsv"
        write_tsv(tsv, args.rows)
        criteo_tsv_to_npy(tsv, root / "rows" / "day_0")
        criteo_tsv_to_npy(tsv, root / "hashed" / "day_0", num_embeddings=HASH)
        opened = time.process_time()
        CriteoNPYSource(root / "hashed" / "day_0", HASH)
        open_ms = (time.process_time() - opened) * 1e3  # the key-major files are validated when opened
        try:
            (root / "torchrec").mkdir()
            torchrec_npy_files(root / "rows" / "day_0", root / "torchrec" / "day_0")
            (root / "torchrec_hashed").mkdir()
            torchrec_npy_files(root / "rows" / "day_0", root / "torchrec_hashed" / "day_0", hashed=True)
        except ImportError:
            pass
        for B in args.batch_sizes:
            rows_out += bench_batch_size(tsv, root, B, args.rounds, wanted)
    print_table(rows_out, ["impl", "format", "workers", "batch_size", "samples_per_s", "cpu_samples_per_s",
                           "samples_per_s_vs_torchrec", "samples_per_s_vs_torchrec_in_process",
                           "cpu_samples_per_s_vs_torchrec",
                           "samples_per_s_vs_train_step", "cpu_samples_per_s_vs_train_step"])  # fmt: skip
    for B in args.batch_sizes:
        of_size = [r for r in rows_out if r["batch_size"] == B]
        ours = next(
            (r for r in of_size if r["format"] == "npy" and r["workers"] == 0 and r["impl"].startswith("trit")), None
        )
        for fmt, what in (("npy_hashed", "mmap pipe on files hashed when written (the same work)"),
                          ("npy_bare", "bare mmap pipe"), ("npy_mem", "in-RAM pipe in a DataLoader"),
                          ("npy_mem_bare", "bare in-RAM pipe")):  # fmt: skip
            other = next((r for r in of_size if r["format"] == fmt), None)
            if ours and other:
                wall, cpu = (ours[c] / other[c] for c in ("samples_per_s", "cpu_samples_per_s"))
                print(f"B={B}: key-major npy vs torchrec's {what}: {wall:.2f}x wall, {cpu:.2f}x per CPU second")
        mmap_pipe = next(
            (r for r in of_size if r["format"] == "npy" and r["workers"] == 0 and r["impl"].startswith("anchor")), None
        )
        in_ram = next((r for r in of_size if r["format"] == "npy_mem"), None)
        for cached in (r for r in of_size if r["format"].startswith("cache") and mmap_pipe and in_ram):
            print(
                f"B={B}: {cached['format']} vs torchrec's mmap npy pipe in a DataLoader: "
                f"{cached['samples_per_s'] / mmap_pipe['samples_per_s']:.2f}x wall "
                f"({cached['cpu_samples_per_s'] / mmap_pipe['cpu_samples_per_s']:.2f}x per CPU second); "
                f"vs its in-RAM pipe in a DataLoader {cached['samples_per_s'] / in_ram['samples_per_s']:.2f}x "
                f"({cached['cpu_samples_per_s'] / in_ram['cpu_samples_per_s']:.2f}x)"
            )
    print(f"opening (validating) the key-major day of {args.rows} rows: {open_ms:.1f} ms of CPU")
    path = append_csv(args.out, rows_out)
    load = max(r["load_1min"] for r in rows_out)
    print(f"appended {len(rows_out)} rows to {path} (threads={args.threads}, load up to {load:.1f})", file=sys.stderr)
    if args.plot:
        plot(rows_out, path.with_suffix(".png"))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per batch size, two bars per case: wall-clock samples/s, and samples per CPU second of the process
    (in-process rows only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["batch_size"] for r in rows})
    cases = max(sum(r["batch_size"] == size for r in rows) for size in sizes)
    # ~0.55 inch a case: three lines of label each, without overlapping their neighbours'
    height = max(7.0, 0.55 * cases)
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes) + 2, height), sharey=True, squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        panel = [r for r in rows if r["batch_size"] == size]
        positions = np.arange(len(panel))
        grey = ["tab:gray" if r["impl"].startswith(("anchor", "bar", "torchrec")) else "tab:blue" for r in panel]
        wall = [float(r["samples_per_s"]) for r in panel]
        cpu = [float(r["cpu_samples_per_s"] or "nan") for r in panel]
        ax.barh(positions - 0.2, wall, height=0.4, color=grey, label="wall-clock")
        ax.barh(positions + 0.2, cpu, height=0.4, color=grey, alpha=0.45, hatch="//", label="per CPU second")
        names = [textwrap.fill(f"{r['impl']} ({r['format']}, {r['workers']} workers)", 48) for r in panel]
        ax.set_yticks(positions, names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("samples/s (log scale); grey: torchrec and the train-step bar")
        ax.set_title(f"batches of {size} (load {float(panel[0]['load_1min']):.0f} on 2 shared cores)", fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle("Criteo TSV / npy into model batches, CPU, 1 thread, one interleaved run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
