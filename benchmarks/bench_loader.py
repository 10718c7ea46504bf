"""Loader throughput: samples/s of reading Criteo TSV and npy files into model batches (dense features + KJT +
labels), in-process and with 1 and 2 DataLoader workers, and of the batch cache (memory-mapped cached batches turned
into model batches). In the same run and on the same files, the anchors: torchrec 1.8's Criteo readers where
installed (``criteo_kaggle``'s TSV datapipe batched by ``torch.utils.data.datapipes``' Batcher, plus the row-to-KJT
step torchrec leaves to the user; ``InMemoryBinaryCriteoIterDataPipe`` for npy, twice: with ``mmap_mode`` it reads
and hashes per batch as ours does (the like-for-like anchor), by default it loads the files and hashes every id in
its constructor, untimed, so its passes only slice memory: that one is the anchor of our batch cache, the other
precomputed path) and the default DLRM's train step on the same batches (the loader must reach 3x its samples/s so
it never bounds a rank's step).

    python benchmarks/bench_loader.py [--rows 60000] [--batch-size 2048] [--repeats 3] [--out loader_cpu.csv] [--plot]

One timed call is one whole pass over the file (every batch distinct). torchrec's readers have no per-worker
sharding of one file (its TSV pipe splits by file, its npy pipe not at all), so they are timed in-process and
compared with our in-process rows; the worker rows show how ours scale.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import append_csv, measure, print_table

from tritonrec.data.batch import Batch
from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.criteo import CriteoTSVSource
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy, npy_paths
from tritonrec.data.group_loader import GroupLoader
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.data.loader import make_rank_loader
from tritonrec.dist.train.builders import DataSources, build_dense_optimizer, build_model
from tritonrec.dist.train.config import DLRMConfig, OptimConfig
from tritonrec.dist.train.loop import train_step

HASH = 50_000
KEYS = [f"cat_{i}" for i in range(26)]


def write_tsv(path: Path, rows: int, seed: int = 0) -> None:
    """Criteo-like lines: counts with Criteo's missing rate, 8-digit hex ids, some empty."""
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            counts = rng.integers(-1, 300, (n, 13))
            ids = rng.integers(0, 2**32, (n, 26))
            missing = rng.random((n, 26)) < 0.1
            labels = rng.integers(0, 2, n)
            for i in range(n):
                ints = [str(c) if c >= 0 else "" for c in counts[i]]
                cats = ["" if m else f"{v:08x}" for v, m in zip(ids[i], missing[i], strict=True)]
                handle.write("\t".join([str(labels[i]), *ints, *cats]) + "\n")


def cpu_seconds(run: Callable[[], Any], repeats: int) -> float:
    """Fewest CPU seconds of this process over ``repeats`` calls: robust to other jobs on a loaded machine, but blind
    to work done in worker processes (so only in-process rows report it)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best


def passes(make_batches: Callable[[], Iterable[Any]]) -> Callable[[], int]:
    """One whole pass; returns the number of samples seen (each batch's size, padding excluded)."""

    def run() -> int:
        seen = 0
        for batch in make_batches():
            seen += int(batch.labels.shape[0]) if not isinstance(batch, Batch) else batch.num_valid()
        return seen

    return run


# ----------------------------------------------------------------------------------------------- torchrec anchors
def torchrec_tsv_pass(path: Path, batch_size: int) -> Callable[[], Iterable[Any]]:
    import torch.utils.data.datapipes as dp
    from torchrec.datasets.criteo import criteo_kaggle
    from torchrec.datasets.utils import Batch as TorchrecBatch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

    def to_batch(rows: list[dict[str, Any]]) -> TorchrecBatch:
        """The user's part of torchrec's TSV path: dict rows -> dense + KJT (hashed, empty ids as empty bags)."""
        dense = torch.tensor([[row[f"int_{i}"] for i in range(13)] for row in rows], dtype=torch.float32)
        values, lengths = [], []
        for key in KEYS:
            for row in rows:
                text = row[key]
                lengths.append(1 if text else 0)
                if text:
                    values.append(int(text, 16) % HASH)
        sparse = TorchrecKJT.from_lengths_sync(KEYS, torch.tensor(values), torch.tensor(lengths, dtype=torch.int32))
        labels = torch.tensor([row["label"] for row in rows], dtype=torch.float32)
        return TorchrecBatch(torch.sign(dense) * torch.log1p(dense.abs()), sparse, labels)

    return lambda: (to_batch(rows) for rows in dp.iter.Batcher(criteo_kaggle(str(path)), batch_size))


def torchrec_npy_pass(prefix: Path, batch_size: int, mmap_mode: bool) -> Callable[[], Iterable[Any]]:
    """In memory (the default): files loaded and ids hashed in the constructor, untimed; ``mmap_mode``: read and
    hashed per batch, as ours are."""
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    dense, sparse, labels = (str(p) for p in npy_paths(prefix))
    pipe = InMemoryBinaryCriteoIterDataPipe(
        "train", [dense], [sparse], [labels], batch_size, rank=0, world_size=1, hashes=[HASH] * 26,
        mmap_mode=mmap_mode,
    )  # fmt: skip
    return lambda: iter(pipe)


def torchrec_npy_files(ours: Path, theirs: Path) -> None:
    """torchrec's npy layout: a missing id is 0 (ours: -1), labels ``[N, 1]``."""
    dense, sparse, labels = (np.load(p) for p in npy_paths(ours))
    for array, path in zip((dense, np.maximum(sparse, 0), labels.reshape(-1, 1)), npy_paths(theirs), strict=True):
        np.save(path, array)


# ------------------------------------------------------------------------------------------------ the batch cache
def cached_group(prefix: Path, location: Path, batch_size: int) -> DataGroup:
    """A cache of model-ready arrays (hashed ids with -1 for missing, dense, labels), filled once, untimed."""
    dense, sparse, labels = (np.load(p, mmap_mode="r") for p in npy_paths(prefix))
    layouts = {"dense": ((13,), torch.float32), "ids": ((26,), torch.int64), "labels": ((), torch.float32)}
    group = DataGroup(batch_size, range(len(labels)), {"row": ((), torch.int64)}, layouts, location)

    def fill(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
        arrays["row"].fill_(item)

    for batch in GroupLoader(fill, group):
        if batch.uncached:
            rows = batch.get_array("row").numpy()
            ids = np.where(sparse[rows] >= 0, sparse[rows] % HASH, -1)
            batch.cache({"dense": torch.from_numpy(np.ascontiguousarray(dense[rows])), "ids": torch.from_numpy(ids),
                         "labels": torch.from_numpy(labels[rows].astype(np.float32))})  # fmt: skip
        batch.release()
    return group


def cached_pass(group: DataGroup) -> Callable[[], Iterable[Batch]]:
    def to_batch(ids: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor) -> Batch:
        present = (ids >= 0).T  # key-major
        sparse = KeyedJaggedTensor(KEYS, ids.T[present], lengths=present.reshape(-1).to(torch.int32))
        return Batch(dense, sparse, labels, torch.ones(labels.shape[0], dtype=torch.bool))

    def batches() -> Iterable[Batch]:
        for cached in GroupLoader(lambda *_: None, group):
            with cached:
                yield to_batch(cached.get_array("ids"), cached.get_array("dense"), cached.get_array("labels"))

    return batches


# ---------------------------------------------------------------------------------------------------- train step
def train_step_rates(prefix: Path, batch_size: int) -> tuple[dict[str, float], float]:
    """The default DLRM's optimizer step on distinct batches of the npy data (tables of HASH rows per feature):
    ``(wall timing, CPU samples/s)``."""
    source = CriteoNPYSource(prefix, HASH)
    sources = DataSources(source, None, source.element_spec, source.num_embeddings)
    model = build_model(DLRMConfig(backend="torch"), sources, OptimConfig())
    optimizer = build_dense_optimizer(model, OptimConfig())
    batches = list(make_rank_loader(source, batch_size, drop_remainder=True))
    position = [0]

    def step() -> None:
        batch = batches[position[0] % len(batches)]
        position[0] += 1
        train_step(model, optimizer, batch)

    timing = measure(step, warmup=2, repeats=10, min_time_s=0.5)
    return timing, batch_size / cpu_seconds(step, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="loader_cpu.csv")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        root = Path(tmp)
        tsv = root / "day_0.tsv"
        write_tsv(tsv, args.rows)
        criteo_tsv_to_npy(tsv, root / "ours" / "day_0")
        prefix = root / "ours" / "day_0"
        B = args.batch_size
        cases: list[tuple[str, str, int, Callable[[], Iterable[Any]]]] = []
        for workers in (0, 1, 2):
            tsv_loader = make_rank_loader(CriteoTSVSource(tsv, HASH), B, num_workers=workers)
            npy_loader = make_rank_loader(CriteoNPYSource(prefix, HASH), B, num_workers=workers)
            cases.append(("tritonrec CriteoTSVSource -> Batch", "tsv", workers, lambda loader=tsv_loader: loader))
            cases.append(("tritonrec CriteoNPYSource -> Batch", "npy", workers, lambda loader=npy_loader: loader))
        cases.append(("tritonrec batch cache (mmap .npy) -> Batch", "cache", 0, cached_pass(
            cached_group(prefix, root / "cache", B))))  # fmt: skip
        anchor_notes: dict[str, str] = {}
        try:
            cases.append(("anchor: torchrec criteo_kaggle datapipe + Batcher + KJT", "tsv", 0,
                          torchrec_tsv_pass(tsv, B)))  # fmt: skip
            (root / "torchrec").mkdir()
            torchrec_npy_files(prefix, root / "torchrec" / "day_0")
            cases.append(("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (mmap_mode)", "npy", 0,
                          torchrec_npy_pass(root / "torchrec" / "day_0", B, mmap_mode=True)))  # fmt: skip
            cases.append(("anchor: torchrec InMemoryBinaryCriteoIterDataPipe (in memory, pre-hashed)", "npy_mem", 0,
                          torchrec_npy_pass(root / "torchrec" / "day_0", B, mmap_mode=False)))  # fmt: skip
        except ImportError as error:
            anchor_notes["tsv"] = anchor_notes["npy"] = f"torchrec anchor unavailable: {error}"
        load = os.getloadavg()[0]
        for impl, fmt, workers, make in cases:
            run = passes(make)
            samples = run()
            timing = measure(run, warmup=1, repeats=args.repeats, min_time_s=0.0)
            cpu = samples / cpu_seconds(run, args.repeats) if workers == 0 else None
            rows_out.append({
                "bench": "loader", "impl": impl, "format": fmt, "workers": workers, "rows": samples,
                "batch_size": B, **timing, "samples_per_s": samples / (timing["median_ms"] * 1e-3),
                "cpu_samples_per_s": cpu, "load_1min": load,
            })  # fmt: skip
        timing, step_cpu = train_step_rates(prefix, B)
        rows_out.append({"bench": "loader", "impl": "bar: default DLRM train step (same batches)", "format": "step",
                         "workers": 0, "rows": B, "batch_size": B, **timing,
                         "samples_per_s": B / (timing["median_ms"] * 1e-3), "cpu_samples_per_s": step_cpu,
                         "load_1min": load})  # fmt: skip
    anchors = {r["format"]: r for r in rows_out if r["impl"].startswith("anchor")}
    step = rows_out[-1]
    for row in rows_out:
        anchor = anchors.get(row["format"] if row["format"] != "cache" else "npy_mem")
        for column in ("samples_per_s", "cpu_samples_per_s"):
            mine, theirs, bar = row[column], anchor[column] if anchor else None, step[column]
            row[f"{column}_vs_torchrec"] = mine / theirs if mine and theirs else None
            row[f"{column}_vs_train_step"] = mine / bar if mine and bar else None
        row["note"] = anchor_notes.get(row["format"], "")
    print_table(rows_out, ["impl", "format", "workers", "samples_per_s", "cpu_samples_per_s",
                           "cpu_samples_per_s_vs_torchrec", "samples_per_s_vs_train_step",
                           "cpu_samples_per_s_vs_train_step"])  # fmt: skip
    path = append_csv(args.out, rows_out)
    print(f"appended {len(rows_out)} rows to {path} (threads={args.threads}, load {load:.1f})", file=sys.stderr)
    if args.plot:
        plot(rows_out, path.with_suffix(".png"))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Two bars per row: wall-clock samples/s, and samples per CPU second of the process (in-process rows only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    positions = np.arange(len(rows))
    labels = [f"{r['impl']}\n({r['format']}, {r['workers']} workers)" for r in rows]
    anchor = ["tab:gray" if r["impl"].startswith(("anchor", "bar")) else "tab:blue" for r in rows]
    ax.barh(positions - 0.2, [float(r["samples_per_s"]) for r in rows], height=0.4, color=anchor, label="wall-clock")
    cpu = [float(r["cpu_samples_per_s"] or "nan") for r in rows]
    ax.barh(positions + 0.2, cpu, height=0.4, color=anchor, alpha=0.45, hatch="//", label="per CPU second")
    ax.set_yticks(positions, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("samples/s (log scale); grey: torchrec anchors and the train-step bar")
    load = float(rows[0]["load_1min"])
    ax.set_title(f"Criteo into batches of {rows[0]['batch_size']}, CPU, one run (2 shared cores, load {load:.0f})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
