"""Independent references for tests/metrics: each metric's formula as a plain Python loop over samples (floats, no
torch ops beyond reading values), and the random batch streams both the single-process and the 2-rank tests feed."""

from __future__ import annotations

import math

import torch

ETA = 1e-12


def _floats(*tensors: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in t.reshape(-1)] for t in tensors]


def ne(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    ce = pos = neg = total = 0.0
    for pi, yi, wi in zip(ps, ys, ws, strict=True):
        pc = min(max(pi, ETA), 1 - ETA)
        ce += -wi * yi * math.log2(pc) - wi * (1 - yi) * math.log2(1 - pc)
        pos += wi * yi
        neg += wi * (1 - yi)
        total += wi
    q = min(max(pos / max(total, ETA), ETA), 1 - ETA)
    return ce / (-pos * math.log2(q) - neg * math.log2(1 - q))


def logloss(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    ce = sum(
        -wi * yi * math.log2(min(max(pi, ETA), 1 - ETA)) - wi * (1 - yi) * math.log2(1 - min(max(pi, ETA), 1 - ETA))
        for pi, yi, wi in zip(ps, ys, ws, strict=True)
    )
    return ce / max(sum(ws), ETA)


def auc(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    """Weighted Mann-Whitney: over (positive i, negative j) pairs, weight w_i w_j, 1 if p_i > p_j, 1/2 if tied."""
    ps, ys, ws = _floats(p, y, w)
    num = 0.0
    for pi, yi, wi in zip(ps, ys, ws, strict=True):
        for pj, yj, wj in zip(ps, ys, ws, strict=True):
            num += wi * yi * wj * (1 - yj) * (1.0 if pi > pj else 0.5 if pi == pj else 0.0)
    pos = sum(wi * yi for yi, wi in zip(ys, ws, strict=True))
    neg = sum(wi * (1 - yi) for yi, wi in zip(ys, ws, strict=True))
    return 0.5 if pos * neg == 0 else num / (pos * neg)


def _weighted_mean(values: list[float], ws: list[float]) -> float:
    total = sum(ws)
    return 0.0 if total == 0 else sum(v * wi for v, wi in zip(values, ws, strict=True)) / total


def ctr(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    _, ys, ws = _floats(p, y, w)
    return _weighted_mean(ys, ws)


def calibration(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    denom = sum(yi * wi for yi, wi in zip(ys, ws, strict=True))
    return 0.0 if denom <= 0 else sum(pi * wi for pi, wi in zip(ps, ws, strict=True)) / denom


def accuracy(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, threshold: float = 0.5) -> float:
    ps, ys, ws = _floats(p, y, w)
    return _weighted_mean([float((pi >= threshold) == (yi == 1.0)) for pi, yi in zip(ps, ys, strict=True)], ws)


def mse(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    return _weighted_mean([(yi - pi) ** 2 for pi, yi in zip(ps, ys, strict=True)], ws)


def rmse(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    return math.sqrt(mse(p, y, w))


def mae(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    return _weighted_mean([abs(yi - pi) for pi, yi in zip(ps, ys, strict=True)], ws)


def r_squared(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    ps, ys, ws = _floats(p, y, w)
    mean = _weighted_mean(ys, ws)
    total = sum(wi * (yi - mean) ** 2 for yi, wi in zip(ys, ws, strict=True))
    err = sum(wi * (yi - pi) ** 2 for pi, yi, wi in zip(ps, ys, ws, strict=True))
    return 1.0 - err / total


def stream(seed: int, steps: int, batch: int, tasks: int = 2) -> list[dict[str, torch.Tensor]]:
    """``steps`` model outputs {l{t}, p{t}, w{t}: [batch]} per task t: 0/1 labels, predictions in (0, 1) (a few
    exactly 0 or 1, to exercise NE's clamping), weights in [0, 2) with some zeros."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = {}
        for t in range(tasks):
            step[f"l{t}"] = torch.randint(0, 2, (batch,), generator=gen).float()
            p = torch.rand(batch, generator=gen)
            p[0] = float(t % 2)  # saturated predictions
            step[f"p{t}"] = p
            step[f"w{t}"] = 2 * torch.rand(batch, generator=gen) * (torch.rand(batch, generator=gen) > 0.1)
        out.append(step)
    return out


def cat_steps(steps: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    return torch.cat([step[key] for step in steps]) if steps else torch.zeros(0)
