"""Measure this machine for the planner's perf model and write the coefficients JSON.

    python -m tritonrec.dist.planner.calibrate                      # default file (see calibration.py)
    python -m tritonrec.dist.planner.calibrate --out calib.json --device cpu --world-size 2

* Lookups: a ``FusedEmbeddingBagCollection`` (rowwise Adagrad, the training default) of 1 or 4 tables of several
  widths, batches of several sizes and pooling factors, timed forward and backward (the fused update) through the
  module, i.e. the ``tritonrec.kernels.embedding`` lookup the sharded modules run; ``call_s``, ``table_s``,
  ``bag_s``, ``id_s`` and ``bytes_per_s`` are the non-negative least-squares fit (relative errors) of
  ``time = call_s + tables x table_s + bags x bag_s + ids x id_s + bytes / bytes_per_s`` (bytes: ids x dim x 4).
  With collectives measured, the lookups run on every spawned rank at once, as in training: ranks sharing a host
  share its cores and memory bandwidth (``--threads`` torch threads each), and a lone process would be too fast.
* Collectives: ``--world-size`` local processes (gloo on cpu; NCCL on cuda when there is one GPU per process, else
  gloo) time the comm ops the sharded modules use - pooled all-to-all, reduce-scatter, all-gather - and DDP's
  all-reduce at several message sizes, from a few KB (where the per-call latency shows) to MBs; each gets
  ``latency_s`` and ``bytes_per_s`` per rank on the wire.
* Groups: the same ranks time a training step of a tiny one-table group per sharding type through
  ``DistributedModelParallel``: the per-group fixed cost (``group_step_s``, see calibration.py).
* Input dist: the same ranks time the sparse ``KJTAllToAll`` (splits, lengths and values: its whole fixed cost is
  ``input_dist.latency_s``, the time per id received beyond the wire bytes ``id_s``) and the row-wise
  ``block_bucketize_sparse_features`` (``bucketize_call_s`` + ids x ``bucketize_id_s``).

Times are medians of repeated calls on distinct inputs after warm-up calls; a loaded machine gives pessimistic
numbers (re-run when quiet). The lookup sweep lives in :mod:`~tritonrec.dist.planner.calibrate_lookups`, the input
dist and group steps in :mod:`~tritonrec.dist.planner.calibrate_dist`, the fits in
:mod:`~tritonrec.dist.planner.calibrate_fit`; this module times the collectives, spawns the ranks and writes the
file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonrec.dist.planner.calibrate_dist import measure_group_steps, measure_input_dist
from tritonrec.dist.planner.calibrate_fit import fit_latency_and_rate, fit_nonnegative, median_s
from tritonrec.dist.planner.calibrate_lookups import (
    UNMEASURABLE_RATE,  # noqa: F401  (re-exported: it used to live here)
    measure_host_lookups,
    measure_lookups,
)
from tritonrec.dist.planner.calibration import (
    COLLECTIVES,
    DEFAULT_COEFFICIENTS,
    CommCoefficients,
    InputDistCoefficients,
    LookupCoefficients,
    PerfCoefficients,
    default_calibration_path,
)
from tritonrec.dist.planner.shard_estimators import INDEX_BYTES
from tritonrec.dist.rendezvous import hold_local_store, init_local_rank
from tritonrec.kernels.checks import check_int

# (rows, dims, batches, pooling factors, table counts) of the lookup sweep, per-rank message sizes (bytes) of the
# collectives, and ids per rank of the input-dist sweep
FULL_LOOKUPS = (50_000, (16, 64, 256), (256, 1024), (1, 8, 32), (1, 4))
QUICK_LOOKUPS = (1_000, (8, 32), (32, 64), (1, 4), (1, 2))
FULL_MESSAGES = (4 * 1024, 64 * 1024, 1024**2, 8 * 1024**2)
QUICK_MESSAGES = (4 * 1024, 64 * 1024)
QUICK_GROUP_KINDS = ("table_wise", "row_wise")
FULL_INPUT_IDS = (256, 4096, 65_536, 262_144)
QUICK_INPUT_IDS = (64, 1024)

__all__ = [
    "calibrate",
    "fit_latency_and_rate",
    "fit_nonnegative",
    "main",
    "measure_collectives",
    "measure_group_steps",
    "measure_host_lookups",
    "measure_input_dist",
    "measure_lookups",
]


def _rank_sweep(
    device: torch.device, quick: bool, lookup_backend: str
) -> tuple[dict[str, tuple[float, float]], LookupCoefficients, InputDistCoefficients, dict[str, tuple[float, float]]]:
    """What one spawned rank measures, in lock-step with its peers: collectives, lookups, input dist."""
    world = dist.get_world_size()
    repeats = 3 if quick else 5
    fitted = measure_collectives(None, device, QUICK_MESSAGES if quick else FULL_MESSAGES, repeats)
    lookup = measure_host_lookups(device, QUICK_LOOKUPS if quick else FULL_LOOKUPS, repeats, lookup_backend)
    inputs = measure_input_dist(None, device, QUICK_INPUT_IDS if quick else FULL_INPUT_IDS, 2 * repeats - 1)
    # the model adds the all-to-all's wire bytes (8-byte ids, (W-1)/W of them remote) at the all-to-all rate itself
    wire_s = INDEX_BYTES * (world - 1) / world / fitted["all_to_all"][1]
    inputs = InputDistCoefficients(
        inputs.latency_s, max(0.0, inputs.id_s - wire_s), inputs.bucketize_call_s, inputs.bucketize_id_s
    )
    groups = measure_group_steps(device, 5, QUICK_GROUP_KINDS) if quick else measure_group_steps(device, 21)
    return fitted, lookup, inputs, groups


def _collective_ops(
    inputs: list[torch.Tensor], group: dist.ProcessGroup, world: int, dim: int
) -> dict[str, tuple[Callable[[int], Any], float]]:
    """Collective -> (call on input ``i``, bytes each rank puts on the wire) for ``[rows, dim]`` fp32 inputs."""
    from tritonrec.dist.comm_ops import all_gather_base_pooled, alltoall_pooled, reduce_scatter_base_pooled

    rows = inputs[0].shape[0]
    wire = (world - 1) / world * rows * dim * 4
    batch = [rows // world] * world
    return {
        "all_to_all": (lambda i: alltoall_pooled(inputs[i], batch, [dim] * world, group=group).wait(), wire),
        "reduce_scatter": (lambda i: reduce_scatter_base_pooled(inputs[i], group=group).wait(), wire),
        "all_gather": (lambda i: all_gather_base_pooled(inputs[i][: rows // world], group=group).wait(), wire),
        "all_reduce": (lambda i: dist.all_reduce(inputs[i], group=group), 2 * wire),
    }


def measure_collectives(
    pg: dist.ProcessGroup | None, device: torch.device, message_bytes: tuple[int, ...], repeats: int = 5
) -> dict[str, tuple[float, float]]:
    """On every rank of ``pg``: time each collective at each per-rank message size; returns (rank-local) collective
    -> ``(latency_s, bytes_per_s)`` fitted on the bytes each rank puts on the wire."""
    group = pg if pg is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    points: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in COLLECTIVES}
    dim = 64
    for nbytes in message_bytes:
        rows = max(world, nbytes // (4 * dim) // world * world)  # per-rank buffer [rows, dim] fp32, rows % world == 0
        inputs = [torch.randn(rows, dim, device=device) for _ in range(repeats + 1)]
        ops = _collective_ops(inputs, group, world, dim)
        for name, (op, wire) in ops.items():
            points[name][0].append(wire)
            points[name][1].append(median_s(op, repeats, device, barrier=True))
    return {name: fit_latency_and_rate(*points[name]) for name in COLLECTIVES}


def _comm_rank(
    rank: int,
    world: int,
    port: int,
    backend: str,
    device_type: str,
    quick: bool,
    lookup_backend: str,
    threads: int,
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # time the steady state: cross-rank metadata checks (the first calls of each op) off
    os.environ["TRITONREC_DIST_CHECKS"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one host
    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device(device_type)
    if backend == "nccl":
        torch.cuda.set_device(device)
    try:
        init_local_rank(backend, port, rank, world)
        results.put((rank, _rank_sweep(device, quick, lookup_backend)))
    except BaseException as err:  # reported to the parent, which raises
        results.put((rank, repr(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_ranks(
    world: int, device_type: str, quick: bool, lookup_backend: str, threads: int, timeout_s: float = 600.0
) -> tuple[tuple[Any, ...], str]:
    """Rank 0's :func:`_rank_sweep` of ``world`` spawned processes, and the backend they used."""
    use_nccl = device_type == "cuda" and torch.cuda.device_count() >= world
    backend = "nccl" if use_nccl else "gloo"
    comm_device = device_type if use_nccl else "cpu"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = hold_local_store()  # bound for as long as the ranks run
    port = store.port
    procs = [
        ctx.Process(
            target=_comm_rank,
            args=(r, world, port, backend, comm_device, quick, lookup_backend, threads, results),
            daemon=True,
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(outputs) < world and time.monotonic() < deadline:
            try:
                rank, payload = results.get(timeout=1.0)
            except Exception:  # queue.Empty: keep waiting until the deadline
                continue
            outputs[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if len(outputs) < world:
        raise TimeoutError(f"calibration: ranks {sorted(set(range(world)) - set(outputs))} timed out")
    failed = {r: p for r, p in outputs.items() if isinstance(p, str)}
    if failed:
        raise RuntimeError(f"calibration failed on rank {min(failed)}: {failed[min(failed)]}")
    return outputs[0], backend


def calibrate(
    device_type: str = "cpu",
    world_size: int = 2,
    quick: bool = False,
    skip_comms: bool = False,
    backend: str = "auto",
    threads: int | None = None,
) -> PerfCoefficients:
    """Measure collectives, input dist and lookups on ``world_size`` spawned processes running at once (``threads``
    torch threads each; default: this host's cores shared among them), or with ``skip_comms`` the lookups alone in
    this process (collective and input-dist coefficients: the defaults)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    world_size = check_int(world_size, "world_size", 2)
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    threads = check_int(threads, "threads", 1)
    defaults = DEFAULT_COEFFICIENTS[device_type]
    if skip_comms:
        rows, dims, batches, poolings, tables = QUICK_LOOKUPS if quick else FULL_LOOKUPS
        lookup = measure_lookups(
            torch.device(device_type), rows, dims, batches, poolings, tables, 3 if quick else 5, backend
        )
        comms, inputs, comm_backend = dict(defaults.comms), defaults.input_dist, "none (defaults)"
        groups = dict(defaults.group_step_s)
    else:
        (fitted, lookup, inputs, groups), comm_backend = _spawn_ranks(world_size, device_type, quick, backend, threads)
        comms = {name: CommCoefficients(lat, rate) for name, (lat, rate) in fitted.items()}
    measured_on = {
        "host": platform.node(),
        "threads": threads if not skip_comms else torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "backend": comm_backend,
        "world_size": world_size,
        "device": torch.cuda.get_device_name() if device_type == "cuda" else platform.processor() or "cpu",
        "quick": quick,
        "lookup_backend": backend,
        "lookups_on": "one process" if skip_comms else f"{world_size} ranks at once",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return PerfCoefficients(device_type, lookup, comms, defaults.inter_host_bw, measured_on, inputs, groups)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: the planner's default file)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=2, help="processes for the collectives (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--quick", action="store_true", help="tiny sweep (seconds; for smoke tests, not planning)")
    parser.add_argument("--skip-comms", action="store_true", help="keep the default collective coefficients")
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto", help="lookup backend")
    args = parser.parse_args(argv)
    coefficients = calibrate(args.device, args.world_size, args.quick, args.skip_comms, args.backend, args.threads)
    path = coefficients.save(args.out or default_calibration_path(args.device))
    lk, ind = coefficients.lookup, coefficients.input_dist
    for way in ("fwd", "bwd"):

        def get(name: str, way: str = way) -> float:
            return float(getattr(lk, f"{way}_{name}"))

        print(
            f"lookup {way}: {get('call_s') * 1e6:.0f} us/call + {get('table_s') * 1e6:.1f} us/table + "
            f"{get('bag_s') * 1e9:.1f} ns/bag + {get('id_s') * 1e9:.1f} ns/id + {get('bytes_per_s') / 1e9:.2f} GB/s"
        )
    print(f"lookups alone on the host: {lk.alone_speedup:.2f}x faster than with every rank busy")
    for name, c in coefficients.comms.items():
        print(f"{name}: {c.bytes_per_s / 1e9:.2f} GB/s per rank + {c.latency_s * 1e6:.0f} us latency")
    print(
        f"input dist: {ind.latency_s * 1e6:.0f} us + {ind.id_s * 1e9:.1f} ns/id; bucketize "
        f"{ind.bucketize_call_s * 1e6:.0f} us + {ind.bucketize_id_s * 1e9:.1f} ns/id"
    )
    for kind, (fwd, bwd) in coefficients.group_step_s.items():
        print(f"group of {kind}: {fwd * 1e3:.2f} ms forward + {bwd * 1e3:.2f} ms backward per step")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
