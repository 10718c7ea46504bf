"""Rank-side cases for what rides on the wire: quantized comm codecs on every output dist (forward values and
gradients within the codec's documented bound, and actually lossy), and variable batch per feature (VBE) inputs,
compared with the unsharded module on the expanded batch.

Codec bounds (tests/distributed/codec_cases.py): one decoded value of a row whose largest magnitude is ``M`` is off by
at most ``c * M`` (``c``: fp16 2**-11, bf16 2**-8, fp8 E4M3 2**-4, int8 2/255, mx4 1/6); an output summing ``W``
decoded pieces (reduce-scatter) by ``W`` such bounds. Gradients: the output gradient has magnitudes in [1, 2], so
each decoded gradient value is off by at most the documented absolute bound ``b``, and a table row's gradient, the
sum of its ``n`` looked-up values' gradients, by ``n * b``.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.ebc_cases import (
    BATCH_PER_RANK,
    FEATURES,
    TABLES,
    Case,
    build_pair,
    features_of,
    global_batch,
    kjt_slice,
    max_diff,
    plans_by_type,
    shard_slices,
)
from tritonrec.data import KeyedJaggedTensor

# name -> (forward precision, relative forward bound c, backward absolute bound b for |grad| in [1, 2])
CODECS = {
    "fp16": ("FP16", 2**-11, 2**-10),
    "bf16": ("BF16", 2**-8, 2**-7),
    "fp8": ("FP8", 2**-4, 2**-2),
    "int8": ("INT8", 2 / 255, 4 / 510 + 1e-5),
    "mx4": ("MX4", 1 / 6, 0.5),
}
CODEC_PLANS = ["mixed", "table_row_wise"]


def _registry(precision: str) -> dict[str, Any]:
    from tritonrec.dist import QCommsConfig, get_qcomm_codecs_registry

    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=precision, backward_precision=precision))


def _unit_grad(shape: torch.Size, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return signs * (1 + torch.rand(shape, generator=g))


def _run_once(case: Case, rank: int, world: int, codecs: Any) -> tuple[torch.Tensor, dict[tuple, torch.Tensor]]:
    """Output and, per local shard ``(table, spec)``, its gradient after one backward."""
    _, sharded = build_pair(case, rank, world, codecs)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    lengths, values, weights = global_batch(0, total, False)
    out = sharded(kjt_slice(lengths, values, weights, lo, lo + batch[rank])).wait().values()
    grad = _unit_grad(torch.Size([total, out.shape[1]]), 11)[lo : lo + batch[rank]]
    (out * grad).sum().backward()
    grads = {(t, s): p.grad.clone() for t, _, s, p in shard_slices(sharded)}
    return out.detach(), grads


def _row_counts(world: int) -> dict[str, torch.Tensor]:
    """Per table, how many looked-up values hit each row in the global batch."""
    _, values, _ = global_batch(0, sum(BATCH_PER_RANK[world]), False)
    counts = {}
    for name, rows, _, features in TABLES:
        hits = [values[FEATURES.index(f)] for f in features]
        counts[name] = torch.bincount(torch.cat(hits), minlength=rows).float()
    return counts


def codec_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Per (plan, codec): forward error over its bound and gradient error over its bound (both must be <= 1), and
    whether the codec changed anything at all."""
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    plans = plans_by_type()
    counts = _row_counts(world)
    out: dict[str, dict[str, float]] = {}
    try:
        for plan in CODEC_PLANS:
            case = Case(plan, plans[plan])
            exact_out, exact_grads = _run_once(case, rank, world, None)
            scale = float(exact_out.abs().max())
            for name, (precision, c, b) in CODECS.items():
                got_out, got_grads = _run_once(case, rank, world, _registry(precision))
                forward = float((got_out - exact_out).abs().max()) / (world * c * scale)
                grad_ratio, changed = 0.0, float((got_out != exact_out).any())
                for (table, spec), grad in got_grads.items():
                    key = (table, spec)
                    rows = counts[table][spec.row_offset : spec.row_offset + spec.rows]
                    bound = 1.5 * rows[:, None] * b + 1e-6
                    if grad.numel():
                        grad_ratio = max(grad_ratio, float(((grad - exact_grads[key]).abs() / bound).max()))
                        changed = max(changed, float((grad != exact_grads[key]).any()))
                out[f"{plan}-{name}"] = {"forward": forward, "grad": grad_ratio, "changed": changed}
    finally:
        set_gradient_division(True)
    return out


def vbe_batch(step: int, world: int, tables: list = TABLES) -> list[dict[str, Any]]:
    """Per rank: per feature a compressed batch of ``b_f`` bags and ``inverse [B_r]`` into it."""
    g = torch.Generator().manual_seed(500 + step)
    rows: dict[str, int] = {}
    for _, n, _, fs in tables:
        for f in fs:
            rows[f] = min(rows.get(f, n), n)  # a shared feature's ids index every table reading it
    ranks = []
    for batch in BATCH_PER_RANK[world]:
        per_feature = []
        for f in features_of(tables):
            b = int(torch.randint(1, batch + 1, (1,), generator=g))
            lengths = torch.randint(0, 4, (b,), generator=g)
            values = torch.randint(0, rows[f], (int(lengths.sum()),), generator=g)
            # every compressed bag is used (a deduplicated batch): an unused bag would still be looked up and, under
            # Adam, move its rows with a zero gradient, which the expanded batch never looks up
            uses = torch.cat([torch.arange(b), torch.randint(0, b, (batch - b,), generator=g)])
            inverse = uses[torch.randperm(batch, generator=g)]
            per_feature.append((lengths, values, inverse))
        ranks.append({"features": per_feature, "batch": batch})
    return ranks


def vbe_kjt(data: dict[str, Any], features: list[str] = FEATURES) -> KeyedJaggedTensor:
    lengths = torch.cat([f[0] for f in data["features"]])
    values = torch.cat([f[1] for f in data["features"]])
    strides = [[f[0].numel()] for f in data["features"]]
    inverse = torch.stack([f[2] for f in data["features"]])
    return KeyedJaggedTensor(
        features, values, lengths=lengths, stride_per_key_per_rank=strides, inverse_indices=(features, inverse)
    )


def expanded_kjt(ranks: list[dict[str, Any]], features: list[str] = FEATURES) -> KeyedJaggedTensor:
    """Every rank's samples, each feature's bag looked up through its inverse index (what VBE stands for)."""
    lengths, values = [], []
    for f in range(len(features)):
        for data in ranks:
            bag_lengths, bag_values, inverse = data["features"][f]
            starts = torch.cumsum(bag_lengths, 0) - bag_lengths
            for i in inverse.tolist():
                lengths.append(int(bag_lengths[i]))
                values.append(bag_values[int(starts[i]) : int(starts[i]) + int(bag_lengths[i])])
    return KeyedJaggedTensor(features, torch.cat(values), lengths=torch.tensor(lengths))


VBE_CASES = [
    ("table_wise", "SUM", None),
    ("row_wise", "MEAN", None),
    ("column_wise", "SUM", None),
    ("data_parallel", "MEAN", None),
    ("table_wise", "MEAN", "EXACT_ROWWISE_ADAGRAD"),
    ("row_wise", "SUM", "ADAM"),
]


def vbe_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    plans = plans_by_type()
    out = {}
    try:
        for kind, pooling, optimizer in VBE_CASES:
            case = Case(kind, plans[kind], pooling, False, optimizer, steps=1 if optimizer is None else 3)
            reference, sharded = build_pair(case, rank, world)
            lo = sum(BATCH_PER_RANK[world][:rank])
            result = {"forward": 0.0, "grad": 0.0, "weights": 0.0}
            for step in range(case.steps):
                ranks = vbe_batch(step, world)
                got = sharded(vbe_kjt(ranks[rank])).wait().values()
                full = reference(expanded_kjt(ranks)).values()
                mine = full[lo : lo + ranks[rank]["batch"]]
                if step == 0:
                    result["forward"] = max_diff(got, mine)
                grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(step))
                (got * grad[lo : lo + got.shape[0]]).sum().backward()
                (full * grad).sum().backward()
            for table, _, spec, param in shard_slices(sharded):
                ref = reference.embedding_bags[table].weight
                rows = slice(spec.row_offset, spec.row_offset + spec.rows)
                cols = slice(spec.col_offset, spec.col_offset + spec.cols)
                if optimizer is None:
                    result["grad"] = max(result["grad"], max_diff(param.grad, ref.grad[rows, cols]))
                result["weights"] = max(result["weights"], max_diff(param, ref[rows, cols]))
            out[f"{kind}-{pooling.lower()}-{optimizer or 'dense'}"] = result
    finally:
        set_gradient_division(True)
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    return {"codecs": codec_cases(rank, world), "vbe": vbe_cases(rank, world)}
