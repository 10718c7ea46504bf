"""Rank-side cases for the data-parallel fused update on rows whose gradient is exactly zero: a row the lookup read
is touched, whatever its gradient, and the rule applies to it (weight decay, Adam's moments) as in the unsharded
module trained on the global batch.

Two patterns, after one ordinary step (so Adam has moments to decay):

* ``local_zero``: rank 0's bags get a zero upstream gradient, so the rows only rank 0 read have a zero gradient on
  every rank.
* ``cancel``: rank 1's first three samples repeat rank 0's three (same ids) with the opposite upstream gradient and
  its last two get none, so every row read has gradients that cancel exactly across ranks (dyadic values: the sums
  are exact in any order).

Each case reports the weights' and state's largest difference from the unsharded module, and how many rows read
with a zero global gradient the unsharded module moved (so the case is known to exercise such rows).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.ebc_cases import TABLES, Case, build_pair, features_of, kjt_slice, max_diff

BATCH_PER_RANK = [3, 5]
MIRRORED = 3  # rank 1's samples [3, 6) repeat rank 0's [0, 3)
STEPS = 3
RULES = [
    ("EXACT_SGD", {"weight_decay": 0.1}),
    ("EXACT_ROWWISE_ADAGRAD", {"weight_decay": 0.1}),
    ("EXACT_ADAGRAD", {"weight_decay": 0.1}),
    ("ADAM", {}),
    ("ADAM", {"weight_decay": 0.1}),
]
PATTERNS = ("local_zero", "cancel")
EXCHANGES = ("sparse", "dense")


def cases() -> dict[str, tuple[str, dict[str, float], str, str]]:
    """Case name -> (rule, its keyword arguments, exchange, pattern)."""
    return {
        f"{optim}-wd{kwargs.get('weight_decay', 0.0)}-{exchange}-{pattern}": (optim, kwargs, exchange, pattern)
        for optim, kwargs in RULES
        for exchange in EXCHANGES
        for pattern in PATTERNS
    }


def _batch(step: int, pattern: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``lengths [F, 8]`` (1 or 2 ids per bag) and per-feature ids; under ``cancel`` samples [3, 6) repeat [0, 3)."""
    g = torch.Generator().manual_seed(2000 + step)
    features = features_of(TABLES)
    rows = {f: n for _, n, _, fs in TABLES for f in fs}
    lengths = torch.randint(1, 3, (len(features), sum(BATCH_PER_RANK)), generator=g)
    values = []
    for i, f in enumerate(features):
        bags = [torch.randint(0, rows[f], (int(n),), generator=g) for n in lengths[i]]
        if pattern == "cancel":
            lengths[i, MIRRORED : 2 * MIRRORED] = lengths[i, :MIRRORED]
            bags[MIRRORED : 2 * MIRRORED] = [b.clone() for b in bags[:MIRRORED]]
        values.append(torch.cat(bags))
    return lengths, values


def _upstream(step: int, shape: torch.Size, pattern: str) -> torch.Tensor:
    """The pooled outputs' gradient ``[8, sum(D)]``: multiples of 1/8 in [-1, 1] (exact sums)."""
    grad = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(70 + step)).float() / 8
    if step == 0:
        return grad
    if pattern == "local_zero":
        grad[: BATCH_PER_RANK[0]] = 0.0
    else:
        grad[MIRRORED : 2 * MIRRORED] = -grad[:MIRRORED]
        grad[2 * MIRRORED :] = 0.0
    return grad


def _zero_gradient_rows(lengths: torch.Tensor, values: list[torch.Tensor], pattern: str) -> dict[str, torch.Tensor]:
    """Per table, the rows read this step whose global gradient is exactly zero (steps after the first)."""
    features = features_of(TABLES)
    out = {}
    for name, _, _, fs in TABLES:
        read, live = [], []
        for f in fs:
            i = features.index(f)
            cut = int(lengths[i, : BATCH_PER_RANK[0]].sum())
            read.append(values[i])
            if pattern == "local_zero":
                live.append(values[i][cut:])  # rank 1's bags carry the only nonzero gradient
        read_rows = torch.cat(read).unique()
        live_rows = torch.cat(live).unique() if live else read_rows.new_zeros(0)
        out[name] = read_rows[~torch.isin(read_rows, live_rows)]
    return out


def run_zero_case(optim: str, kwargs: dict[str, float], exchange: str, pattern: str, rank: int, world: int) -> dict:
    from tritonrec.dist import data_parallel

    plans = {t: (lambda w: data_parallel()) for t, *_ in TABLES}
    case = Case("dp-zero", plans, "SUM", False, optim, extra={"exchange": exchange, "optimizer_kwargs": kwargs})
    reference, sharded = build_pair(case, rank, world)
    lo = sum(BATCH_PER_RANK[:rank])
    hi = lo + BATCH_PER_RANK[rank]
    total = sum(BATCH_PER_RANK)
    features = features_of(TABLES)
    zero_rows, moved = 0, 0
    for step in range(STEPS):
        lengths, values = _batch(step, pattern)
        before = {t: reference.embedding_bags[t].weight.detach().clone() for t, *_ in TABLES}
        out = sharded(kjt_slice(lengths, values, [], lo, hi, features)).wait()
        full = reference(kjt_slice(lengths, values, [], 0, total, features))
        grad = _upstream(step, full.values().shape, pattern)
        (out.values() * grad[lo:hi]).sum().backward()
        (full.values() * grad).sum().backward()
        if step:
            for table, rows in _zero_gradient_rows(lengths, values, pattern).items():
                after = reference.embedding_bags[table].weight.detach()
                zero_rows += rows.numel()
                moved += int((after[rows] != before[table][rows]).any(dim=1).sum())
    result: dict[str, Any] = {"weights": 0.0, "state": 0.0, "zero_rows": zero_rows, "moved": moved}
    for table, module in sharded.embedding_bags.items():
        assert len(module.local) == 1  # data parallel: the whole table on every rank
        ref_param = reference.embedding_bags[table].weight
        result["weights"] = max(result["weights"], max_diff(module.weight.detach(), ref_param.detach()))
        mine = sharded.fused_optimizer.state[module.weight]
        theirs = reference.fused_optimizer.state[ref_param]
        for key in ("momentum1", "momentum2"):
            if key in theirs:
                result["state"] = max(result["state"], max_diff(mine[key], theirs[key]))
    return result


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import get_gradient_division, set_gradient_division

    before = get_gradient_division()
    set_gradient_division(False)
    try:
        return {name: run_zero_case(*args, rank, world) for name, args in cases().items()}
    finally:
        set_gradient_division(before)
