"""The one benchmark harness: timing with warm-up and repeats, throughput, and CSV rows that say where they came from.

Every benchmark script defines its cases and anchors and calls :func:`measure` for each implementation, so ours and
the anchor are timed the same way in the same run. On CUDA, timing uses ``triton.testing.do_bench`` (events, cache
flush); on CPU, wall-clock ``perf_counter`` over individually timed calls.

Rows appended with :func:`append_csv` carry device, versions, thread count and date, so a committed CSV is
self-describing.

Where results go: a run writes under ``benchmarks/results/runs/<date>/`` (git-ignored), so trying a benchmark never
rewrites the committed CSVs and plots. To update those, pass ``--commit-results`` to any benchmark script (the
harness takes the flag off ``sys.argv`` when imported, before the script parses its arguments), set
``TRITONREC_COMMIT_RESULTS=1``, or call :func:`set_commit_results`; files then go to ``benchmarks/results/``.
"""

from __future__ import annotations

import csv
import datetime
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COMMIT_FLAG = "--commit-results"
_COMMIT_ENV = "TRITONREC_COMMIT_RESULTS"
_commit_override: bool | None = None


def take_commit_flag(argv: list[str]) -> bool:
    """Remove ``--commit-results`` from ``argv`` (in place); whether it was there."""
    found = COMMIT_FLAG in argv
    argv[:] = [arg for arg in argv if arg != COMMIT_FLAG]
    return found


def set_commit_results(enabled: bool | None) -> None:
    """Write results over the committed files (``True``), into the dated run folder (``False``), or as the command
    line and ``TRITONREC_COMMIT_RESULTS`` say (``None``)."""
    global _commit_override
    _commit_override = enabled


def commit_results() -> bool:
    if _commit_override is not None:
        return _commit_override
    return os.environ.get(_COMMIT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def results_dir() -> Path:
    """Where this run's CSVs and plots go: ``benchmarks/results/`` when committing, else
    ``benchmarks/results/runs/<date>/``."""
    if commit_results():
        return RESULTS_DIR
    return RESULTS_DIR / "runs" / datetime.date.today().isoformat()


if take_commit_flag(sys.argv):  # once, for every benchmark script: their own parsers never see the flag
    _commit_override = True


def measure(
    fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 20, min_time_s: float = 0.2, device: str = "cpu"
) -> dict[str, float]:
    """Time ``fn()``: returns ``median_ms``, ``p10_ms``, ``p90_ms`` and ``repeats`` (the number of timed calls).

    On CPU, at least ``repeats`` calls and at least ``min_time_s`` of timed work after ``warmup`` untimed calls.
    """
    if device.startswith("cuda"):
        import triton.testing

        median, p10, p90 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.1, 0.9])
        return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "repeats": float("nan")}
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - started < min_time_s:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 50 * repeats:
            break
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p10_ms": samples[int(0.1 * (len(samples) - 1))],
        "p90_ms": samples[int(0.9 * (len(samples) - 1))],
        "repeats": float(len(samples)),
    }


def mean_call_ms(fn: Callable[[], Any], calls: int, device: str = "cpu", warmup: int = 0) -> float:
    """Milliseconds per call over ``calls`` consecutive calls of ``fn`` after ``warmup`` untimed ones (wall clock; on
    CUDA from the first call's launch to the last one's completion): what a job spends per call, with calls that
    cost more now and then (a source generating its data in chunks) counted in full, where :func:`measure`'s median
    drops them."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - began) * 1e3 / calls


def gbps(num_bytes: float, ms: float) -> float:
    """Throughput in GB/s (1e9 bytes) for ``num_bytes`` moved in ``ms`` milliseconds."""
    return num_bytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copy_bandwidth_gbps(num_bytes: int, device: str = "cpu") -> float:
    """Same-run anchor: GB/s of a plain device copy of ``num_bytes`` (read + write counted)."""
    src = torch.empty(max(num_bytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device=device)
    return gbps(2 * src.numel() * 4, timing["median_ms"])


CPUINFO = "/proc/cpuinfo"


def device_name(device: str = "cpu") -> str:
    """The GPU's name, or the CPU's model, its widest vector ISA and core count. Ratios against FBGEMM compare only
    between rows of one CPU: its forward + fused backward took 46.7 ms on one 2-core VM and 8.3 ms on another (ours
    18.3 and 14.8 ms; ``cpu_sized``, 1 thread), and the rows before 2026-11-27 say only ``x86_64 (2 cores)``."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: the architecture alone
        pass
    isa = next((name for name in ("avx512f", "avx2", "neon", "asimd") if name in flags), "")
    return f"{model}{', ' + isa if isa else ''} ({os.cpu_count()} cores)"


def environment(device: str = "cpu") -> dict[str, Any]:
    """Columns that identify the run: device, versions, threads, date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    fbgemm_version = "absent"
    logging.disable(logging.INFO)  # fbgemm_gpu logs a screen of INFO lines on import
    try:
        import fbgemm_gpu

        fbgemm_version = getattr(fbgemm_gpu, "__version__", "present")
    except Exception:  # any import failure means the anchor is unavailable
        pass
    finally:
        logging.disable(logging.NOTSET)
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "fbgemm_gpu": fbgemm_version,
        "threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
    }


def append_csv(path: str | Path, rows: Iterable[Mapping[str, Any]], device: str = "cpu") -> Path:
    """Append ``rows`` (each merged with :func:`environment`) to ``path``, writing a header for a new file.

    A relative ``path`` is taken inside :func:`results_dir` (the dated run folder unless committing results).
    """
    if not str(path):
        raise ValueError("path is empty: name the CSV file (or skip writing it)")
    path = Path(path)
    if not path.is_absolute():
        path = results_dir() / path
    path.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    # a row's own value wins (e.g. the threads each spawned rank ran with, which this process's count is not); the
    # columns stay in the same order either way
    full_rows = [{**row, **{k: v for k, v in env.items() if k not in row}} for row in rows]
    if not full_rows:
        return path
    fields = list(full_rows[0].keys())
    new_file = not path.exists()
    if not new_file:
        with path.open() as handle:
            existing = next(csv.reader(handle), None)
        if existing and existing != fields:
            raise ValueError(f"{path} has columns {existing}, rows have {fields}; write to a new file")
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new_file:
            writer.writeheader()
        writer.writerows(full_rows)
    return path


def print_table(rows: list[Mapping[str, Any]], columns: list[str]) -> None:
    """Fixed-width table on stdout, so a benchmark run shows ours next to its anchors."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float | None = None) -> dict[int, Any]:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes that meet at a rendezvous
    store this process holds on ``port`` (each joins with :func:`~tritonrec.dist.rendezvous.init_local_rank`). Each
    rank puts ``(rank, ok, payload)`` on ``queue``: its result, or its traceback when ``ok`` is False. Returns
    ``{rank: payload}``; the first rank that failed raises a ``RuntimeError`` carrying its traceback (the other ranks
    are then stopped rather than left waiting in a collective)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from tritonrec.dist.rendezvous import hold_local_store  # here: single-process benchmarks skip tritonrec.dist

    store = hold_local_store()  # bound for as long as the ranks run
    procs = [ctx.Process(target=target, args=(rank, world, store.port, *args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, payload = queue.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = payload
    except BaseException:
        for proc in procs:
            proc.terminate()
        raise
    for proc in procs:
        proc.join()
    return outputs
