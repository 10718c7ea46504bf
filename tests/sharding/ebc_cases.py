"""Rank-side cases for the sharded EmbeddingBagCollection: every rank shards the same module by a plan, runs its
part of a global batch (split unevenly across ranks, empty bags, dims 1/3/8/64, a table with fewer rows than ranks,
uneven row and column blocks) and compares with the unsharded module run on the whole global batch in the same
process.

Gradient division is off inside the cases, so each rank's loss ``sum(out * R[rank's rows])`` makes the sharded
gradients equal the unsharded module's gradient of ``sum(out * R)`` on the global batch.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tritonrec.data import KeyedJaggedTensor

# name, rows, dim, features: a shared two-feature table, one with fewer rows than ranks, D=1, D=64
TABLES = [("t0", 12, 8, ["f0", "f1"]), ("t1", 1, 3, ["f2"]), ("t2", 9, 1, ["f3"]), ("t3", 20, 64, ["f4"])]
FEATURES = [f for _, _, _, fs in TABLES for f in fs]
BATCH_PER_RANK = {2: [3, 5], 4: [2, 4, 1, 3]}
LR = {"EXACT_SGD": 0.1, "EXACT_ROWWISE_ADAGRAD": 0.1, "ADAM": 0.01, "EXACT_ADAGRAD": 0.1}


@dataclass
class Case:
    """One module configuration: a plan per table (``plans[t](world)`` -> generator), pooling, weights, kernel."""

    name: str
    plans: dict[str, Callable[[int], Any]]
    pooling: str = "SUM"  # "SUM" | "MEAN"
    weighted: bool = False
    optimizer: str | None = None  # None: dense kernel (gradients checked); else fused, 10 steps
    steps: int = 1
    precision: str = "FP32"
    extra: dict[str, Any] = field(default_factory=dict)
    tables: list = field(default_factory=lambda: TABLES)  # (name, rows, dim, features); features may be shared


def features_of(tables: list) -> list[str]:
    """The KJT keys ``tables`` read, each once, in table order."""
    return list(dict.fromkeys(f for _, _, _, fs in tables for f in fs))


def make_tables(pooling: str, precision: str = "FP32", tables: list = TABLES) -> list:
    from tritonrec.modules import DataType, EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            num_embeddings=rows,
            embedding_dim=dim,
            name=name,
            feature_names=list(features),
            pooling=PoolingType[pooling],
            data_type=DataType[precision],
        )
        for name, rows, dim, features in tables
    ]


def global_batch(
    step: int, total: int, weighted: bool, tables: list = TABLES
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``lengths [F, total]`` (0..4, so some bags are empty) and per-feature values (and weights); a feature's ids
    stay below the rows of every table reading it."""
    g = torch.Generator().manual_seed(1000 + step)
    rows: dict[str, int] = {}
    for _, n, _, fs in tables:
        for f in fs:
            rows[f] = min(rows.get(f, n), n)
    features = features_of(tables)
    lengths = torch.randint(0, 5, (len(features), total), generator=g)
    values = [torch.randint(0, rows[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(features)]
    weights = [torch.rand(v.numel(), generator=g) + 0.5 for v in values] if weighted else []
    return lengths, values, weights


def kjt_slice(
    lengths: torch.Tensor,
    values: list[torch.Tensor],
    weights: list[torch.Tensor],
    lo: int,
    hi: int,
    features: list[str] = FEATURES,
):
    """The KJT of samples ``[lo, hi)`` of the global batch."""
    out_lengths, out_values, out_weights = [], [], []
    for i in range(len(features)):
        start, n = int(lengths[i, :lo].sum()), int(lengths[i, lo:hi].sum())
        out_lengths.append(lengths[i, lo:hi])
        out_values.append(values[i][start : start + n])
        if weights:
            out_weights.append(weights[i][start : start + n])
    return KeyedJaggedTensor(
        features, torch.cat(out_values), torch.cat(out_weights) if weights else None, lengths=torch.cat(out_lengths)
    )


def build_pair(case: Case, rank: int, world: int, codecs: Any = None):
    """(unsharded reference, sharded module): same initial weights."""
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.modules import EmbeddingBagCollection, FusedEmbeddingBagCollection

    torch.manual_seed(7)
    tables = make_tables(case.pooling, case.precision, case.tables)
    if case.optimizer is None:
        reference = EmbeddingBagCollection(tables, is_weighted=case.weighted, backend="torch")
        fused_params = None
    else:
        kwargs = {"lr": LR[case.optimizer], **case.extra.get("optimizer_kwargs", {})}
        reference = FusedEmbeddingBagCollection(
            tables, case.optimizer, kwargs, is_weighted=case.weighted, backend="torch", stochastic_rounding=False
        )
        fused_params = {"optimizer": case.optimizer, **kwargs, "stochastic_rounding": False}
    source = copy.deepcopy(reference) if case.extra.get("meta") is None else case.extra["meta"](tables, case)
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=codecs)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = construct_module_sharding_plan(
        source, {t: gen(world) for t, gen in case.plans.items()}, sharder, local, world, "cpu"
    )
    for sharding in plan.values():  # data_parallel() defaults to dense: every table follows the case
        sharding.compute_kernel = "dense" if case.optimizer is None else "fused"
    sharded = sharder.shard(source, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    for sharding in sharded.shardings:
        sharding.lookup.backend = "torch"
        handler = getattr(sharding.lookup, "_handler", None)
        if "exchange" in case.extra and handler is not None:  # data-parallel fused: force one exchange
            handler.exchange = case.extra["exchange"]
        if "max_align" in case.extra and hasattr(handler, "max_align"):  # data-parallel: rows copied, not in place
            handler.max_align = case.extra["max_align"]
    return reference, sharded


def shard_slices(sharded) -> list[tuple[str, str, Any, Any]]:  # type: ignore[no-untyped-def]
    """(table, parameter name, shard spec, parameter) of every local shard."""
    out = []
    for table, module in sharded.embedding_bags.items():
        for k, (shard, _) in enumerate(module.local):
            name = "weight" if k == 0 else f"weight_{k}"
            out.append((table, name, shard.spec, getattr(module, name)))
    return out


def _block(tensor: torch.Tensor, spec: Any) -> torch.Tensor:
    return tensor[spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b| / (1 + |b|)``: absolute near zero, relative for large values (optimizer state grows)."""
    if not a.numel():
        return 0.0
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (1 + b.abs())).max())


def run_ebc_case(case: Case, rank: int, world: int, codecs: Any = None) -> dict[str, float]:
    """Forward (and, dense, gradient) max differences at step 0; fused: weights and state after ``steps``.

    ``case.extra["division"]``: gradient division on (every sharding's gradient is the global one over W), against
    the unsharded module trained on the loss divided by W."""
    from tritonrec.dist import get_gradient_division, set_gradient_division

    division = bool(case.extra.get("division", False))
    before = get_gradient_division()
    set_gradient_division(division)
    try:
        return _run_ebc_case(case, rank, world, codecs, 1.0 / world if division else 1.0)
    finally:
        set_gradient_division(before)


def _run_ebc_case(case: Case, rank: int, world: int, codecs: Any, reference_scale: float) -> dict[str, float]:
    reference, sharded = build_pair(case, rank, world, codecs)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    hi = lo + batch[rank]
    result: dict[str, Any] = {"forward": 0.0, "grad": 0.0, "weights": 0.0, "state": 0.0}
    features = features_of(case.tables)
    for step in range(case.steps):
        lengths, values, weights = global_batch(step, total, case.weighted, case.tables)
        out = sharded(kjt_slice(lengths, values, weights, lo, hi, features)).wait()
        full = reference(kjt_slice(lengths, values, weights, 0, total, features))
        grad_out = torch.randn(full.values().shape, generator=torch.Generator().manual_seed(50 + step))
        if step == 0:  # same weights on both sides: the lookup itself is compared
            result["forward"] = max_diff(out.values(), full.values()[lo:hi])
            result["keys"] = (list(out.keys()), list(full.keys()), out.length_per_key() == full.length_per_key())
        (out.values() * grad_out[lo:hi]).sum().backward()
        (full.values() * grad_out * reference_scale).sum().backward()
        if step == 0 and case.optimizer is None:
            for table, _, spec, param in shard_slices(sharded):
                expected = _block(reference.embedding_bags[table].weight.grad, spec)
                result["grad"] = max(result["grad"], max_diff(param.grad, expected))
    for table, _, spec, param in shard_slices(sharded):
        ref_param = reference.embedding_bags[table].weight
        result["weights"] = max(result["weights"], max_diff(param.detach(), _block(ref_param.detach(), spec)))
        if case.optimizer is not None:
            mine = sharded.fused_optimizer.state[param]
            theirs = reference.fused_optimizer.state[ref_param]
            for key in ("momentum1", "momentum2"):
                if key not in theirs:
                    continue
                expected = theirs[key]
                if expected.dim() == 1:  # rowwise: per row
                    expected = expected[spec.row_offset : spec.row_offset + spec.rows]
                else:
                    expected = _block(expected, spec)
                result["state"] = max(result["state"], max_diff(mine[key], expected))
            if int(mine["step"]) != int(theirs["step"]):
                result["state"] = float("inf")
    return result


# ------------------------------------------------------------------------------------------------------- the matrix
def _tw(world: int) -> dict[str, Callable[[int], Any]]:
    from tritonrec.dist import table_wise

    return {t: (lambda w, i=i: table_wise(rank=i % w)) for i, (t, *_) in enumerate(TABLES)}


def _all(generator: Callable[[int], Any]) -> dict[str, Callable[[int], Any]]:
    return {t: generator for t, *_ in TABLES}


def plans_by_type() -> dict[str, dict[str, Callable[[int], Any]]]:
    from tritonrec.dist import (
        column_wise,
        data_parallel,
        grid_shard,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )

    def hosts(w: int) -> int:
        return w // int(os.environ.get("LOCAL_WORLD_SIZE", w))

    return {
        "table_wise": {t: (lambda w, i=i: table_wise(rank=(i + 1) % w)) for i, (t, *_) in enumerate(TABLES)},
        "row_wise": _all(lambda w: row_wise()),
        # uneven row blocks (sizes_placement, 2 ranks): 12 rows as 9+3, the 1-row table only on rank 1 (rank 0 holds
        # none), 9 as 2+7, 20 all on rank 0; device types as one string and as a list
        "row_wise_uneven": {
            "t0": lambda w: row_wise(([9, 3], "cpu")),
            "t1": lambda w: row_wise(([0, 1], ["cpu", "cpu"])),
            "t2": lambda w: row_wise(([2, 7], "cpu")),
            "t3": lambda w: row_wise(([20, 0], "cpu")),
        },
        "data_parallel": _all(lambda w: data_parallel()),
        # D=8 over two ranks, D=3 in three blocks with a repeated rank, D=1 whole, D=64 in four blocks (two per rank)
        "column_wise": {
            "t0": lambda w: column_wise(ranks=[0, w - 1]),
            "t1": lambda w: column_wise(ranks=[1, 0, 1]),
            "t2": lambda w: column_wise(ranks=[w - 1]),
            "t3": lambda w: column_wise(ranks=[0, 1, 0, 1]),
        },
        # uneven column blocks (size_per_rank): D=8 as 5+3, D=3 as 1+2 placed 1, 0, D=64 as 7+33+24 on 0, 1, 0
        "column_wise_uneven": {
            "t0": lambda w: column_wise(size_per_rank=[5, 3]),
            "t1": lambda w: column_wise(ranks=[1, 0], size_per_rank=[1, 2]),
            "t2": lambda w: column_wise(size_per_rank=[1]),
            "t3": lambda w: column_wise(ranks=[0, 1, 0], size_per_rank=[7, 33, 24]),
        },
        "table_column_wise": {
            "t0": lambda w: table_column_wise(ranks=[0, 1]),
            "t1": lambda w: table_column_wise(ranks=[1]),
            "t2": lambda w: table_column_wise(ranks=[w - 1]),
            "t3": lambda w: table_column_wise(ranks=[w - 1, w - 2]),
        },
        "table_row_wise": {
            t: (lambda w, i=i: table_row_wise(host_index=i % hosts(w))) for i, (t, *_) in enumerate(TABLES)
        },
        "grid_shard": {
            "t0": lambda w: grid_shard(host_indexes=list(range(hosts(w))) * (2 // hosts(w))),
            "t1": lambda w: grid_shard(host_indexes=[hosts(w) - 1]),
            "t2": lambda w: grid_shard(host_indexes=[0]),
            "t3": lambda w: grid_shard(host_indexes=[hosts(w) - 1, 0]),
        },
        "mixed": {
            "t0": lambda w: row_wise(),
            "t1": lambda w: table_wise(rank=w - 1),
            "t2": lambda w: data_parallel(),
            "t3": lambda w: column_wise(ranks=[1, 0]),
        },
    }


OPTIMIZERS = ["EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "ADAM", "EXACT_ADAGRAD"]
POOLINGS = [("sum", "SUM", False), ("mean", "MEAN", False), ("weighted", "SUM", True)]


def ebc_cases(types: list[str]) -> list[Case]:
    """Per sharding type: the dense kernel under sum, mean and weighted pooling (forward + gradients), and 10 fused
    steps of each optimizer (pooling rotating so each optimizer meets each pooling across types)."""
    plans = plans_by_type()
    cases = []
    for k, kind in enumerate(types):
        for label, pooling, weighted in POOLINGS:
            cases.append(Case(f"{kind}-dense-{label}", plans[kind], pooling, weighted))
        for j, optimizer in enumerate(OPTIMIZERS):
            label, pooling, weighted = POOLINGS[(j + k) % len(POOLINGS)]
            cases.append(Case(f"{kind}-{optimizer}-{label}", plans[kind], pooling, weighted, optimizer, steps=10))
        if kind == "data_parallel":  # both exchanges of the fused data-parallel update, whatever "auto" picks
            for exchange in ("sparse", "dense"):
                extra = {"exchange": exchange}
                cases.append(Case(f"{kind}-ADAM-{exchange}", plans[kind], "MEAN", True, "ADAM", 5, extra=extra))
            # the sparse exchange's gathered rows copied into one block (widths past max_align), and scaled by 1/W
            extra = {"exchange": "sparse", "max_align": 1, "division": True}
            cases.append(Case(f"{kind}-ROWWISE-unaligned-division", plans[kind], "SUM", False,
                              "EXACT_ROWWISE_ADAGRAD", 5, extra=extra))  # fmt: skip
        if kind == "mixed":  # every sharding's fused update with gradient division on (the default)
            extra = {"exchange": "sparse", "division": True}
            cases.append(Case(f"{kind}-ROWWISE-division", plans[kind], "MEAN", False, "EXACT_ROWWISE_ADAGRAD", 5,
                              extra=extra))  # fmt: skip
    return cases


TYPES_BY_WORLD = {
    2: ["table_wise", "row_wise", "data_parallel", "column_wise", "column_wise_uneven", "table_column_wise",
        "table_row_wise", "grid_shard", "mixed", "row_wise_uneven"],
    4: ["table_row_wise", "grid_shard", "row_wise", "column_wise", "mixed"],
}  # fmt: skip


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    try:
        return {case.name: run_ebc_case(case, rank, world) for case in ebc_cases(TYPES_BY_WORLD[world])}
    finally:
        set_gradient_division(True)
