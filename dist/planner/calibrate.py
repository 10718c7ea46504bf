"""Measure this machine for the planner's perf model and write the coefficients JSON.

    python -m tritonrec.dist.planner.calibrate                      # default file (see calibration.py)
    python -m tritonrec.dist.planner.calibrate --out calib.json --device cpu --world-size 2

* Lookups: a ``FusedEmbeddingBagCollection`` (rowwise Adagrad, the training default) on tables of several widths
  and batches of several pooling factors, timed forward and backward (the fused update) through the module, i.e. the
  ``tritonrec.kernels.embedding`` lookup the sharded modules run; ``call_s``, ``id_s`` and ``bytes_per_s`` are the
  non-negative least-squares fit of ``time = call_s + ids x id_s + bytes / bytes_per_s`` (bytes: ids x dim x 4).
* Collectives: ``--world-size`` local processes (gloo on cpu; NCCL on cuda when there is one GPU per process, else
  gloo) time the comm ops the sharded modules use - pooled all-to-all, reduce-scatter, all-gather - and DDP's
  all-reduce at several message sizes; each gets ``latency_s`` and ``bytes_per_s`` per rank on the wire.

Times are medians of repeated calls on distinct inputs; a loaded machine gives pessimistic numbers (re-run when quiet).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonrec.dist.planner.calibration import (
    COLLECTIVES,
    DEFAULT_COEFFICIENTS,
    CommCoefficients,
    LookupCoefficients,
    PerfCoefficients,
    default_calibration_path,
)

# (rows, dims, batch, pooling factors) of the lookup sweep, and per-rank message sizes (bytes) of the collectives
FULL_LOOKUPS = (200_000, (16, 64, 256), 2048, (1, 8, 32))
QUICK_LOOKUPS = (1_000, (8, 32), 64, (1, 4))
FULL_MESSAGES = (64 * 1024, 1024**2, 8 * 1024**2)
UNMEASURABLE_RATE = 1e15  # bytes/s written when the bytes explain none of a lookup's time
QUICK_MESSAGES = (4 * 1024, 64 * 1024)

__all__ = ["calibrate", "fit_latency_and_rate", "fit_nonnegative", "main", "measure_collectives", "measure_lookups"]


def _median_s(fn: Callable[[int], Any], repeats: int, device: torch.device, barrier: bool = False) -> float:
    """Median seconds of ``fn(i)`` over ``repeats`` calls after one warm-up (``i`` picks a distinct input)."""
    fn(repeats)
    samples = []
    for i in range(repeats):
        if barrier:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fit_nonnegative(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Least-squares ``seconds ~ sum_k coef_k features[k]`` with every ``coef_k >= 0``: the best fit over the subsets
    of features whose unconstrained solution is non-negative (few features, so the subsets are few)."""
    x, y = np.asarray(features, dtype=np.float64).T, np.asarray(seconds, dtype=np.float64)
    if x.shape[0] != y.shape[0] or y.shape[0] < 2:
        raise ValueError(f"need at least two (features, time) points, got {x.shape[0]} and {y.shape[0]}")
    best: tuple[float, tuple[int, ...], np.ndarray] | None = None
    for size in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(range(x.shape[1]), size):
            coef = np.linalg.lstsq(x[:, subset], y, rcond=None)[0]
            if (coef < 0).any():
                continue
            residual = float(((x[:, subset] @ coef - y) ** 2).sum())
            if best is None or residual < best[0]:
                best = (residual, subset, coef)
    out = [0.0] * x.shape[1]
    if best is not None:
        for k, value in zip(best[1], best[2], strict=True):
            out[k] = float(value)
    return out


def fit_latency_and_rate(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """``seconds = latency + sizes / rate`` with ``latency >= 0``, ``rate > 0``. When the sizes explain nothing (noise
    on tiny inputs) the whole time is put on the bandwidth: zero latency, the best observed rate."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, time) points, got {len(sizes)} sizes and {len(seconds)} times")
    latency, per_byte = fit_nonnegative([[1.0] * len(sizes), list(sizes)], list(seconds))
    if per_byte <= 0:
        return 0.0, max(x / y for x, y in zip(sizes, seconds, strict=True) if y > 0)
    return latency, 1.0 / per_byte


def _lookup_times(
    ebc: torch.nn.Module, kjts: list[Any], grad: torch.Tensor, repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds of the forward and of the backward alone (the forward before it untimed)."""

    def forward(i: int) -> None:
        with torch.no_grad():
            ebc(kjts[i])

    backward_s = []
    for i in range(repeats + 1):
        out = ebc(kjts[i]).values()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        backward_s.append(time.perf_counter() - start)
    return _median_s(forward, repeats, device), statistics.median(backward_s[1:])  # [0] was the warm-up


def measure_lookups(
    device: torch.device,
    rows: int,
    dims: tuple[int, ...],
    batch: int,
    poolings: tuple[int, ...],
    repeats: int = 5,
    backend: str = "auto",
) -> LookupCoefficients:
    """Time the fused module forward and backward over the sweep (see module docstring); ``backend`` as the
    modules take it (``"auto"``: Triton on CUDA, the torch twin on CPU)."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType

    ids, sizes, fwd_s, bwd_s = [], [], [], []
    gen = torch.Generator().manual_seed(0)
    for dim in dims:
        config = EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name="t", feature_names=["f"])
        ebc = FusedEmbeddingBagCollection(
            [config], OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 1e-3}, device=device, backend=backend
        )
        for pooling in poolings:
            kjts = [
                KeyedJaggedTensor(
                    keys=["f"],
                    values=torch.randint(0, rows, (batch * pooling,), generator=gen).to(device),
                    lengths=torch.full((batch,), pooling, dtype=torch.int64, device=device),
                )
                for _ in range(repeats + 1)
            ]
            fwd, bwd = _lookup_times(ebc, kjts, torch.ones(batch, dim, device=device), repeats, device)
            ids.append(float(batch * pooling))
            sizes.append(float(batch * pooling * dim * 4))
            fwd_s.append(fwd)
            bwd_s.append(bwd)
    features = [[1.0] * len(ids), ids, sizes]
    fwd_call, fwd_id, fwd_per_byte = fit_nonnegative(features, fwd_s)
    bwd_call, bwd_id, bwd_per_byte = fit_nonnegative(features, bwd_s)
    rate = lambda per_byte: 1.0 / per_byte if per_byte > 0 else UNMEASURABLE_RATE
    return LookupCoefficients(rate(fwd_per_byte), fwd_call, rate(bwd_per_byte), bwd_call, fwd_id, bwd_id)


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
            points[name][1].append(_median_s(op, repeats, device, barrier=True))
    return {name: fit_latency_and_rate(*points[name]) for name in COLLECTIVES}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _comm_rank(
    rank: int, world: int, port: int, backend: str, device_type: str, messages: tuple[int, ...], results: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device(device_type)
    if backend == "nccl":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        fitted = measure_collectives(None, device, messages)
        results.put((rank, fitted))
    except BaseException as err:  # reported to the parent, which raises
        results.put((rank, repr(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_collectives(
    world: int, device_type: str, messages: tuple[int, ...], timeout_s: float = 300.0
) -> tuple[dict[str, tuple[float, float]], str]:
    use_nccl = device_type == "cuda" and torch.cuda.device_count() >= world
    backend = "nccl" if use_nccl else "gloo"
    comm_device = device_type if use_nccl else "cpu"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_comm_rank, args=(r, world, port, backend, comm_device, messages, results), daemon=True)
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
        raise TimeoutError(f"collective calibration: ranks {sorted(set(range(world)) - set(outputs))} timed out")
    failed = {r: p for r, p in outputs.items() if isinstance(p, str)}
    if failed:
        raise RuntimeError(f"collective calibration failed on rank {min(failed)}: {failed[min(failed)]}")
    return outputs[0], backend


def calibrate(
    device_type: str = "cpu",
    world_size: int = 2,
    quick: bool = False,
    skip_comms: bool = False,
    backend: str = "auto",
) -> PerfCoefficients:
    """Measure lookups (this process) and collectives (``world_size`` spawned processes) on this machine."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    rows, dims, batch, poolings = QUICK_LOOKUPS if quick else FULL_LOOKUPS
    repeats = 3 if quick else 5
    lookup = measure_lookups(torch.device(device_type), rows, dims, batch, poolings, repeats, backend)
    defaults = DEFAULT_COEFFICIENTS[device_type]
    comms, comm_backend = dict(defaults.comms), "none (defaults)"
    if not skip_comms:
        fitted, comm_backend = _spawn_collectives(world_size, device_type, QUICK_MESSAGES if quick else FULL_MESSAGES)
        comms = {name: CommCoefficients(lat, rate) for name, (lat, rate) in fitted.items()}
    measured_on = {
        "host": platform.node(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "backend": comm_backend,
        "world_size": world_size,
        "device": torch.cuda.get_device_name() if device_type == "cuda" else platform.processor() or "cpu",
        "quick": quick,
        "lookup_backend": backend,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return PerfCoefficients(device_type, lookup, comms, defaults.inter_host_bw, measured_on)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: the planner's default file)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=2, help="processes for the collectives (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sweep (seconds; for smoke tests, not planning)")
    parser.add_argument("--skip-comms", action="store_true", help="keep the default collective coefficients")
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto", help="lookup backend")
    args = parser.parse_args(argv)
    coefficients = calibrate(args.device, args.world_size, args.quick, args.skip_comms, args.backend)
    path = coefficients.save(args.out or default_calibration_path(args.device))
    lk = coefficients.lookup
    print(
        f"lookup: fwd {lk.fwd_bytes_per_s / 1e9:.2f} GB/s + {lk.fwd_id_s * 1e9:.1f} ns/id + "
        f"{lk.fwd_call_s * 1e6:.0f} us/call, bwd {lk.bwd_bytes_per_s / 1e9:.2f} GB/s + {lk.bwd_id_s * 1e9:.1f} ns/id + "
        f"{lk.bwd_call_s * 1e6:.0f} us/call"
    )
    for name, c in coefficients.comms.items():
        print(f"{name}: {c.bytes_per_s / 1e9:.2f} GB/s per rank + {c.latency_s * 1e6:.0f} us latency")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
