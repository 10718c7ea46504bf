"""Compile every Triton kernel of tritonrec for real GPU targets, without a GPU.

    python -m tritonrec.kernels.aot --targets sm80 sm90 gfx942 [--sweep full|ci] [--out aot_compile.csv]

1. **Capture** (a subprocess under ``TRITON_INTERPRET=1``): run :mod:`~tritonrec.kernels.aot_workloads` (every public
   op on small CPU inputs over dtypes, flags and size classes, then on ``meta`` tensors at production sizes) and
   record each launch through :mod:`~tritonrec.kernels.launch_capture`. Each launch becomes one compile job per
   autotune config that fits it, with its heuristics applied; identical jobs are merged and keep the largest grid
   any launch gave them.
2. **Compile** (a pool of processes without the interpreter): :func:`~tritonrec.kernels.aot_compile.compile_job`
   per job and target.
3. **Report**: one CSV row per job and target (kernel, config, specialisation, shared memory and its limit,
   registers, spills, local / scratch memory, occupancy, largest grid, status). The command exits 1 when any
   compile fails, exceeds the target's shared memory, spills because its registers ran out (unless
   ``--allow-spills``; see :func:`~tritonrec.kernels.aot_compile.spill_status` for the small spills Triton's ptxas
   flags cause, reported as ``minor-spill``), or has a grid over the target's limits.

``--sweep ci`` is the representative subset ``.ci/run`` compiles (one dtype combination, the widest size classes,
each launch's default config); ``full`` (the default) is every dtype, size class and autotune config.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import inspect
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tritonrec.kernels.aot_compile import (
    TARGETS,
    Target,
    compile_job,
    describe_arg,
    grid_problems,
    init_worker,
    spill_status,
)
from tritonrec.kernels.aot_coverage import unreached_kernels

CSV_FIELDS = [
    "kernel", "config", "target", "specialisation", "num_warps", "num_stages", "shared_bytes", "shared_limit",
    "registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes", "local_bytes", "sgprs", "vgpr_spills",
    "sgpr_spills", "scratch_bytes", "occupancy", "grid", "workload", "status",
]  # fmt: skip


def _job_of(variant: Any, label: str) -> dict[str, Any]:
    """A JSON compile job for one :class:`~tritonrec.kernels.launch_capture.Variant`: constexprs by value, other
    arguments as descriptors (a tensor's dtype, an int's width)."""
    names = [p for p in inspect.signature(inspect.unwrap(_python_function(variant.jit))).parameters]
    args = [v if n in variant.constexprs else describe_arg(v) for n, v in zip(names, variant.args, strict=True)]
    dtypes = sorted({d["tensor"] for d in args if isinstance(d, dict) and "tensor" in d})
    spec = ",".join(f"{k}={v}" for k, v in sorted(variant.constexprs.items())) + "|" + ",".join(dtypes)
    return {"kernel": variant.name, "config": variant.config, "specialisation": spec, "args": args,
            "kwargs": variant.options, "constexprs": variant.constexprs, "grid": list(variant.grid),
            "workload": label}  # fmt: skip


def _python_function(kernel: Any) -> Any:
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def capture_jobs(sweep: str = "full") -> dict[str, Any]:
    """Run the workloads (needs ``TRITON_INTERPRET=1``) -> ``{"jobs": [...], "launched": [kernel names]}``."""
    from tritonrec.kernels import aot_workloads, checks
    from tritonrec.kernels._triton import interpreter_enabled
    from tritonrec.kernels.launch_capture import capture_launches, expand_launch

    if not interpreter_enabled():
        raise RuntimeError("capture_jobs runs the kernels under the interpreter: set TRITON_INTERPRET=1 first")
    jobs: dict[str, dict[str, Any]] = {}
    launched: set[str] = set()

    def add(launches: list, all_configs: bool) -> None:
        for launch in launches:
            for variant in expand_launch(launch, all_configs=all_configs):
                launched.add(variant.name)
                job = _job_of(variant, launch.label)
                key = json.dumps([job["kernel"], job["config"], job["args"], job["kwargs"]], sort_keys=True)
                if key in jobs:
                    old = jobs[key]
                    old["grid"] = [max(a, b) for a, b in zip(old["grid"], job["grid"], strict=True)]
                    if job["grid"] == old["grid"]:
                        old["workload"] = job["workload"]
                else:
                    jobs[key] = job

    all_configs = sweep == "full"
    for name, workload in aot_workloads.small_workloads(sweep).items():
        with capture_launches(label=name) as launches:
            workload()
        add(launches, all_configs)
    checks.set_value_checks(False)  # they read tensor values, which meta tensors do not have
    try:
        for name, workload in aot_workloads.production_workloads().items():
            with capture_launches(execute=False, label=name) as launches:
                workload()
            add(launches, all_configs)
    finally:
        checks.set_value_checks(None)  # back to the default (TRITONREC_VALUE_CHECKS)
    return {"jobs": list(jobs.values()), "launched": sorted(launched)}


def capture_in_subprocess(sweep: str) -> dict[str, Any]:
    """:func:`capture_jobs` in a fresh interpreter-mode process (kernels decide their mode at import)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "jobs.json"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        code = "import json, sys; from tritonrec.kernels.aot import capture_jobs as c; "
        code += f"json.dump(c({sweep!r}), open(sys.argv[1], 'w'))"
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True)
        return json.loads(out.read_text())


def representative(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One job per kernel for the CI subset: its largest specialisation (the greatest product of integer constexprs,
    i.e. the widest tile, where spills start)."""
    best: dict[str, dict[str, Any]] = {}
    for job in jobs:
        size = math.prod(
            v for v in job["constexprs"].values() if isinstance(v, int) and not isinstance(v, bool) and v > 0
        )
        if job["kernel"] not in best or size > best[job["kernel"]]["_size"]:
            best[job["kernel"]] = {**job, "_size": size}
    return [{k: v for k, v in job.items() if k != "_size"} for job in best.values()]


def _num_warps(job: dict[str, Any]) -> int:
    return int(job["kwargs"].get("num_warps", 4))


def _restatus(row: dict[str, Any]) -> dict[str, Any]:
    """A kept CSV row with its spill status re-derived from its columns (the rule may have changed since)."""
    if row["status"] in ("ok", "spills", "minor-spill"):
        status = spill_status(row, int(row["num_warps"]), TARGETS[row["target"]])
        row = {**row, "status": status or "ok"}
    return row


def _fails(status: str, allow_spills: bool) -> bool:
    return status not in ("ok", "minor-spill") and not (allow_spills and status == "spills")


def _describe(problem: str, job: dict[str, Any], target: str) -> str:
    return f"{problem}: {job['kernel']} [{job['config']}] {job['specialisation']} on {target}"


def _compile_one(job: dict[str, Any], target_name: str) -> dict[str, Any]:
    return compile_job(job, TARGETS[target_name])


def _row(job: dict[str, Any], target: Target, stats: dict[str, Any]) -> dict[str, Any]:
    num_warps = _num_warps(job)
    problems = grid_problems(tuple(job["grid"]), num_warps, target)
    if "error" in stats:
        status = f"error: {stats['error']}"
    elif stats["shared_bytes"] > target.shared_limit:
        status = f"over shared limit ({stats['shared_bytes']} > {target.shared_limit})"
    elif problems:
        status = "; ".join(problems)
    else:
        status = spill_status(stats, num_warps, target) or "ok"
    row = {k: stats.get(k, "") for k in CSV_FIELDS}
    row |= {"kernel": job["kernel"], "config": job["config"], "target": target.name, "status": status,
            "specialisation": job["specialisation"], "num_warps": num_warps, "shared_limit": target.shared_limit,
            "num_stages": job["kwargs"].get("num_stages", ""), "grid": "x".join(map(str, job["grid"])),
            "workload": job["workload"]}  # fmt: skip
    return row


def compile_all(jobs: list[dict[str, Any]], targets: Sequence[str], workers: int) -> list[dict[str, Any]]:
    """Compile every job for every target in ``workers`` spawned processes (never under the interpreter)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker) as pool:
            tasks = [(job, t) for job in sorted(jobs, key=lambda j: j["kernel"]) for t in targets]
            futures = [pool.submit(_compile_one, job, t) for job, t in tasks]
            rows = []
            for done, ((job, t), future) in enumerate(zip(tasks, futures, strict=True), start=1):
                rows.append(_row(job, TARGETS[t], future.result()))
                if _fails(rows[-1]["status"], allow_spills=False):  # as it happens: a full sweep takes a while
                    print(f"  {_describe(rows[-1]['status'], job, t)}", file=sys.stderr, flush=True)
                if done % 50 == 0 or done == len(tasks):
                    print(f"compiled {done}/{len(tasks)}", file=sys.stderr, flush=True)
            return rows
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["kernel"], r["target"], r["specialisation"], r["config"]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonrec.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--sweep", choices=("full", "ci"), default="full")
    parser.add_argument("--out", type=Path, help="CSV to write (one row per kernel variant and target)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--allow-spills", action="store_true", help="report spills without failing")
    parser.add_argument(
        "--kernels",
        nargs="+",
        help="compile only kernels whose name contains one of these (their rows replace theirs in an existing --out)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    captured = capture_in_subprocess(args.sweep)
    jobs = captured["jobs"]
    if args.kernels:
        jobs = [j for j in jobs if any(k in j["kernel"] for k in args.kernels)]
    print(f"captured {len(jobs)} kernel variants of {len(captured['launched'])} kernels", file=sys.stderr)
    missed = unreached_kernels(set(captured["launched"]))
    for name in missed:
        print(f"not reached by any workload (add one to tritonrec.kernels.aot_workloads): {name}")
    chosen = representative(jobs) if args.sweep == "ci" else jobs
    rows = compile_all(chosen, args.targets, max(1, args.jobs))
    if args.out:
        if args.kernels and args.out.is_file():  # recompiled some kernels: keep the other kernels' rows
            with args.out.open() as f:
                kept = [r for r in csv.DictReader(f) if not any(k in r["kernel"] for k in args.kernels)]
            rows = [_restatus(r) for r in kept] + rows
        write_csv(rows, args.out)
    failed = [_describe(r["status"], r, r["target"]) for r in rows if _fails(r["status"], args.allow_spills)]
    compiled = {id(j) for j in chosen}
    for job in (j for j in jobs if id(j) not in compiled):  # not compiled here: still check its grid
        for t in args.targets:
            for problem in grid_problems(tuple(job["grid"]), _num_warps(job), TARGETS[t]):
                failed.append(_describe(problem, job, t))
    if failed:
        print("\n".join(failed))
    minor = sum(r["status"] == "minor-spill" for r in rows)
    print(f"{len(rows)} compiles, {len(failed)} problems, {minor} minor spills, {time.perf_counter() - start:.0f} s",
          file=sys.stderr)  # fmt: skip
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
