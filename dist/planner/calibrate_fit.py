"""Timing and fitting helpers of ``calibrate``: the median of repeated calls, the non-negative least-squares fit of
a cost model, and the latency + bandwidth fit of a collective."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["fit_latency_and_rate", "fit_nonnegative", "median_s"]


def median_s(fn: Callable[[int], Any], repeats: int, device: torch.device, barrier: bool = False) -> float:
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


def fit_nonnegative(features: list[list[float]], seconds: list[float], relative: bool = False) -> list[float]:
    """Least-squares ``seconds ~ sum_k coef_k features[k]`` with every ``coef_k >= 0``: the best fit over the subsets
    of features whose unconstrained solution is non-negative (few features, so the subsets are few). ``relative``:
    minimise relative errors (each point weighted by ``1 / seconds``), so that the fixed costs fitted on short calls
    are not drowned by the absolute errors of long ones."""
    x, y = np.asarray(features, dtype=np.float64).T, np.asarray(seconds, dtype=np.float64)
    if x.shape[0] != y.shape[0] or y.shape[0] < 2:
        raise ValueError(f"need at least two (features, time) points, got {x.shape[0]} and {y.shape[0]}")
    if relative:
        if (y <= 0).any():
            raise ValueError("relative fit needs positive times")
        x, y = x / y[:, None], np.ones_like(y)
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
    latency, per_byte = fit_nonnegative([[1.0] * len(sizes), list(sizes)], list(seconds), relative=True)
    if per_byte <= 0:
        return 0.0, max(x / y for x, y in zip(sizes, seconds, strict=True) if y > 0)
    return latency, 1.0 / per_byte
