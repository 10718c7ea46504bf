"""What ``calibrate`` measures of the lookups: a ``FusedEmbeddingBagCollection`` (rowwise Adagrad) timed forward and
backward (the fused update) over a sweep of table counts, widths, batch sizes and pooling factors, and the
non-negative fit of ``call_s``, ``table_s``, ``bag_s``, ``id_s`` and ``bytes_per_s`` to those times; on spawned ranks
sharing one host, also how much faster the sweep runs on one rank alone (``alone_speedup``). See
:mod:`~tritonrec.dist.planner.calibrate`, which re-exports these."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.planner.calibrate_fit import fit_nonnegative, median_s
from tritonrec.dist.planner.calibration import LookupCoefficients

UNMEASURABLE_RATE = 1e15  # bytes/s written when the bytes explain none of a lookup's time

__all__ = ["UNMEASURABLE_RATE", "measure_host_lookups", "measure_lookups"]


def _lookup_times(
    ebc: torch.nn.Module, kjts: list[Any], grad: torch.Tensor, repeats: int, device: torch.device, barrier: bool
) -> tuple[float, float]:
    """Median seconds of the forward and of the backward alone (the forward before it untimed), after two warm-up
    steps (first touches of the tables' pages, allocator growth)."""

    def forward(i: int) -> None:
        with torch.no_grad():
            ebc(kjts[i])

    backward_s = []
    for i in range(repeats + 2):
        out = ebc(kjts[i % len(kjts)]).values()
        if barrier:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        backward_s.append(time.perf_counter() - start)
    return median_s(forward, repeats, device, barrier), statistics.median(backward_s[2:])


def _lookup_sweep(
    device: torch.device,
    rows: int,
    dims: tuple[int, ...],
    batches: tuple[int, ...],
    poolings: tuple[int, ...],
    table_counts: tuple[int, ...],
    repeats: int,
    backend: str,
    barrier: bool,
) -> tuple[list[list[float]], list[float], list[float]]:
    """``(features per point [1, tables, bags, ids, bytes], forward seconds, backward seconds)`` of the sweep."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType

    points: list[list[float]] = []
    fwd_s, bwd_s = [], []
    gen = torch.Generator().manual_seed(0)
    for tables, dim in itertools.product(table_counts, dims):
        configs = [
            EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{t}", feature_names=[f"f{t}"])
            for t in range(tables)
        ]
        ebc = FusedEmbeddingBagCollection(
            configs, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 1e-3}, device=device, backend=backend
        )
        keys = [f"f{t}" for t in range(tables)]
        for batch, pooling in itertools.product(batches, poolings):
            ids = tables * batch * pooling
            kjts = [
                KeyedJaggedTensor(
                    keys=keys,
                    values=torch.randint(0, rows, (ids,), generator=gen).to(device),
                    lengths=torch.full((tables * batch,), pooling, dtype=torch.int64, device=device),
                )
                for _ in range(repeats + 1)
            ]
            grad = torch.ones(batch, tables * dim, device=device)
            fwd, bwd = _lookup_times(ebc, kjts, grad, repeats, device, barrier)
            points.append([1.0, float(tables), float(tables * batch), float(ids), float(ids * dim * 4)])
            fwd_s.append(fwd)
            bwd_s.append(bwd)
    return points, fwd_s, bwd_s


def measure_lookups(
    device: torch.device,
    rows: int,
    dims: tuple[int, ...],
    batches: tuple[int, ...],
    poolings: tuple[int, ...],
    table_counts: tuple[int, ...] = (1,),
    repeats: int = 5,
    backend: str = "auto",
    barrier: bool = False,
    alone_speedup: float = 1.0,
) -> LookupCoefficients:
    """Time the fused module forward and backward over the sweep and fit the coefficients (see module docstring);
    ``backend`` as the modules take it (``"auto"``: Triton on CUDA, the torch twin on CPU); ``barrier``: start every
    timed call together with the other ranks of the default group (all ranks run the same sweep)."""
    points, fwd_s, bwd_s = _lookup_sweep(device, rows, dims, batches, poolings, table_counts, repeats, backend, barrier)
    return _fit_lookups(points, fwd_s, bwd_s, alone_speedup)


def _fit_lookups(
    points: list[list[float]], fwd_s: list[float], bwd_s: list[float], alone_speedup: float
) -> LookupCoefficients:
    features = [list(column) for column in zip(*points, strict=True)]
    fwd_call, fwd_table, fwd_bag, fwd_id, fwd_per_byte = fit_nonnegative(features, fwd_s, relative=True)
    bwd_call, bwd_table, bwd_bag, bwd_id, bwd_per_byte = fit_nonnegative(features, bwd_s, relative=True)
    rate = lambda per_byte: 1.0 / per_byte if per_byte > 0 else UNMEASURABLE_RATE
    return LookupCoefficients(
        rate(fwd_per_byte), fwd_call, rate(bwd_per_byte), bwd_call, fwd_id, bwd_id,
        fwd_bag_s=fwd_bag, bwd_bag_s=bwd_bag, fwd_table_s=fwd_table, bwd_table_s=bwd_table,
        alone_speedup=alone_speedup,
    )  # fmt: skip


def measure_host_lookups(
    device: torch.device, sweep: tuple[Any, ...], repeats: int, backend: str
) -> LookupCoefficients:
    """On every rank of the default group (one host): the lookup sweep with all ranks computing at once (the
    coefficients), then on rank 0 alone while the others wait (``alone_speedup``: all-busy over alone time of the
    whole sweep, at least 1). Only rank 0's result is meaningful."""
    rows, dims, batches, poolings, tables = sweep
    points, fwd_s, bwd_s = _lookup_sweep(device, rows, dims, batches, poolings, tables, repeats, backend, True)
    dist.barrier()
    speedup = 1.0
    if dist.get_rank() == 0:
        _, alone_fwd, alone_bwd = _lookup_sweep(device, rows, dims, batches, poolings, tables, repeats, backend, False)
        speedup = max(1.0, (sum(fwd_s) + sum(bwd_s)) / (sum(alone_fwd) + sum(alone_bwd)))
    dist.barrier()
    return _fit_lookups(points, fwd_s, bwd_s, speedup)
