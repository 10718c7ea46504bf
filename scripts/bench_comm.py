"""Pooled-embedding all-to-all (``alltoall_pooled``, the output dist of table-wise sharding): message sizes x codecs x
world sizes -> latency, algorithm GB/s and bytes on the wire, next to the same collective without any codec (plain
``torch.distributed.all_to_all_single``) measured in the same run.

    python scripts/bench_comm.py                                  # CPU: gloo ranks spawned here, default sweep
    python scripts/bench_comm.py world_sizes=[2] message_kib=[1024] codecs=[fp32,mx4]
    torchrun --nproc_per_node 8 scripts/bench_comm.py             # GPUs: NCCL, the world torchrun launched

Per rank, the input is ``[W * B, D]`` fp32 (``message_kib`` of it); rank ``r`` gets rows ``r * B ...`` of every
rank's columns. Rows: ``anchor`` (``all_to_all_single`` of the fp32 input), ``fp32`` (our op, no codec) and one per
codec (``QCommsConfig(forward_precision=...)``). Columns: median latency (the median over ``rounds`` interleaved
rounds of the slowest rank's median of ``repeats`` timed calls) and p90, ``algbw_gbps`` = fp32 message bytes /
median time (what the caller moves, so a codec that pays off shows higher throughput), ``wire_bytes`` handed to the
backend per call and ``wire_gbps``, ``max_abs_err`` against the fp32 path (N(0, 1) data). Appends to ``<csv>`` in
this run's folder ``benchmarks/results/runs/<date>/`` (``commit_results=true`` or ``--commit-results``: the committed
``benchmarks/results/``; ``csv=`` empty: print only) and plots next to it. On CPU the codecs run their torch twins.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import append_csv, gbps, measure, print_table, set_commit_results

from tritonrec.dist.comm_ops import alltoall_pooled
from tritonrec.dist.qcomm_codec import CommType
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs
from tritonrec.dist.rendezvous import hold_local_store, init_local_rank

CODEC_NAMES = tuple(t.value for t in CommType)


@dataclass
class BenchCommConfig:
    """One sweep. Under torchrun, ``world_sizes`` is ignored: the launched world is measured."""

    world_sizes: list[int] = field(default_factory=lambda: [2, 4])  # spawned gloo worlds (CPU)
    message_kib: list[int] = field(default_factory=lambda: [64, 1024, 8192])  # fp32 input per rank
    codecs: list[str] = field(default_factory=lambda: list(CODEC_NAMES))  # "fp32" = our op without a codec
    embedding_dim: int = 128  # D of every rank's tables (a multiple of 32: no row padding)
    warmup: int = 1  # untimed calls per point and round
    repeats: int = 5  # timed calls per point and round (the same on every rank: each call is a collective)
    rounds: int = 3  # interleaved rounds over the points of one message size
    threads: int = 1  # torch threads per rank (spawned CPU ranks share the machine's cores)
    csv: str = "comm_alltoall_cpu.csv"  # in this run's results folder unless absolute; "": print only, write nothing
    plot: bool = True  # write <csv stem>.png next to the CSV (needs matplotlib)
    commit_results: bool = False  # write into the committed benchmarks/results/ instead of runs/<date>/


def check_config(cfg: BenchCommConfig) -> BenchCommConfig:
    for name in ("world_sizes", "message_kib"):
        values = getattr(cfg, name)
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise ValueError(f"{name} must be a non-empty list of positive ints, got {name}={values!r}")
    unknown = [c for c in cfg.codecs if c not in CODEC_NAMES]
    if not cfg.codecs or unknown:
        raise ValueError(f"codecs must be a non-empty list drawn from {list(CODEC_NAMES)}, got codecs={cfg.codecs!r}")
    for name in ("embedding_dim", "repeats", "rounds", "threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={getattr(cfg, name)!r}")
    if cfg.warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got warmup={cfg.warmup!r}")
    return cfg


def _time_collective(fn: Callable[[], object], cfg: BenchCommConfig, device: torch.device) -> dict[str, float]:
    """The slowest rank's median and p90 ms. ``min_time_s=0`` keeps the call count fixed (every call is a collective
    all ranks must join); on CUDA each call synchronizes, so wall-clock time covers the kernels."""

    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.barrier()
    timing = measure(call, warmup=cfg.warmup, repeats=cfg.repeats, min_time_s=0.0)
    slowest = torch.tensor([timing["median_ms"], timing["p90_ms"]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"median_ms": float(slowest[0]), "p90_ms": float(slowest[1])}


@dataclass
class _Point:
    """One measured line of the table: what to call, and what it puts on the wire."""

    row: dict[str, Any]
    call: Callable[[], object]
    round_medians: list[float] = field(default_factory=list)
    round_p90s: list[float] = field(default_factory=list)


def _points(cfg: BenchCommConfig, device: torch.device, kib: int) -> list[_Point]:
    world, rank = dist.get_world_size(), dist.get_rank()
    local_batch = max(kib * 1024 // (4 * cfg.embedding_dim * world), 1)
    batch, dims = [local_batch] * world, [cfg.embedding_dim] * world
    x = torch.randn(local_batch * world, cfg.embedding_dim, generator=torch.Generator().manual_seed(rank)).to(device)
    received = torch.empty_like(x)
    base = {"world_size": world, "backend": dist.get_backend(), "message_bytes": x.numel() * 4}
    points = [
        _Point({**base, "impl": "anchor: all_to_all_single", "codec": "none", "wire_bytes": x.numel() * 4,
                "max_abs_err": 0.0}, lambda: dist.all_to_all_single(received, x))
    ]  # fmt: skip
    reference = alltoall_pooled(x, batch, dims).wait()
    for codec in cfg.codecs:
        codecs = None if codec == "fp32" else get_qcomm_codecs(QCommsConfig(forward_precision=CommType(codec)))
        request = alltoall_pooled(x, batch, dims, codecs=codecs)
        error = float((request.wait() - reference).abs().max()) if reference.numel() else 0.0
        row = {**base, "impl": "tritonrec: alltoall_pooled", "codec": codec,
               "wire_bytes": request.forward_traffic.send_bytes, "max_abs_err": error}  # type: ignore[union-attr]  # fmt: skip
        points.append(_Point(row, lambda c=codecs: alltoall_pooled(x, batch, dims, codecs=c).wait()))
    return points


def sweep(cfg: BenchCommConfig, device: torch.device) -> list[dict[str, Any]]:
    """Every (message size, codec) point on the current world; rows are only meaningful on rank 0.

    Points of one message size are timed in ``rounds`` interleaved rounds (anchor, fp32, codecs, anchor, ...) and
    each reports the median of its round medians, so load drifting during the run biases no point against another.
    """
    rows: list[dict[str, Any]] = []
    for kib in cfg.message_kib:
        points = _points(cfg, device, kib)
        for _ in range(cfg.rounds):
            for point in points:
                timing = _time_collective(point.call, cfg, device)
                point.round_medians.append(timing["median_ms"])
                point.round_p90s.append(timing["p90_ms"])
        for point in points:
            median_ms = statistics.median(point.round_medians)
            row = {**point.row, "median_ms": median_ms, "p90_ms": max(point.round_p90s)}
            row["algbw_gbps"] = gbps(row["message_bytes"], median_ms)
            row["wire_gbps"] = gbps(row["wire_bytes"], median_ms)
            rows.append(row)
    return rows


def _spawned_rank(rank: int, world: int, port: int, cfg: BenchCommConfig, results: Any) -> None:
    torch.set_num_threads(cfg.threads)
    init_local_rank("gloo", port, rank, world, datetime.timedelta(seconds=300))
    try:
        rows = sweep(cfg, torch.device("cpu"))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def _spawn_world(cfg: BenchCommConfig, world: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = hold_local_store()  # bound for as long as the ranks run
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, store.port, cfg, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    if failed or results.empty():
        raise RuntimeError(f"benchmark ranks {failed} of a world of {world} failed (see their output above)")
    return results.get()


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        mine = [r for r in rows if r["world_size"] == world]
        for codec in dict.fromkeys(r["codec"] for r in mine):
            series = sorted((r["message_bytes"], r["algbw_gbps"]) for r in mine if r["codec"] == codec)
            style = {"linestyle": "--", "color": "black"} if codec == "none" else {"marker": "o"}
            label = "all_to_all_single (anchor)" if codec == "none" else codec
            ax.plot([s / 2**20 for s, _ in series], [g for _, g in series], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fp32 message per rank (MiB)")
        ax.set_ylabel("algorithm GB/s (fp32 bytes / time)")
        ax.set_title(f"alltoall_pooled, {world} ranks, {mine[0]['backend']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: DictConfig | BenchCommConfig) -> list[dict[str, Any]]:
    """The sweep: spawned gloo worlds on CPU, or the torchrun world (NCCL when CUDA is there). Returns the rows
    (rank 0; other torchrun ranks return [])."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    cfg = check_config(cfg)  # type: ignore[arg-type]
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        use_cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            rows = sweep(cfg, device)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return []
        device_kind = "cuda" if use_cuda else "cpu"
    else:
        rows = [row for world in cfg.world_sizes for row in _spawn_world(cfg, world)]
        device_kind = "cpu"
    columns = ["world_size", "message_bytes", "impl", "codec", "median_ms", "p90_ms", "algbw_gbps", "wire_bytes",
               "wire_gbps", "max_abs_err"]  # fmt: skip
    print_table(rows, columns)
    if not cfg.csv:
        print("csv is empty: nothing written")
        return rows
    if cfg.commit_results:
        set_commit_results(True)
    path = append_csv(cfg.csv, [{c: r[c] for c in [*columns, "backend"]} for r in rows], device=device_kind)
    print(f"appended {len(rows)} rows to {path}")
    if cfg.plot:
        png = path.with_suffix(".png")
        plot(rows, png)
        print(f"plot: {png}")
    return rows


ConfigStore.instance().store(name="bench_comm_schema", node=BenchCommConfig)


@hydra.main(config_path="../configs", config_name="bench_comm", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
