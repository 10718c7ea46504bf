"""Rank-side cases for shared features (one KJT key read by several tables, output ``feature@table``): the sharded
EBC (every sharding type, dense forward / gradients and fused steps, a variable batch per feature), the sharded EC
(every sequence type, with index dedup) and the sharded feature-processed EBC, each against its unsharded module on
the global batch. The input dist sends a shared feature once per table (or column block) reading it, to every rank
that needs it; outputs must carry the unsharded names in the unsharded order.

A case that raises is recorded as ``{"error": traceback}`` (construction fails alike on every rank, before any
collective), so the other cases still report.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.sharding.ebc_cases import (
    BATCH_PER_RANK,
    Case,
    build_pair,
    features_of,
    global_batch,
    kjt_slice,
    make_tables,
    max_diff,
    run_ebc_case,
    shard_slices,
)
from tests.sharding.wire_cases import expanded_kjt, vbe_batch, vbe_kjt

# f1 is read by t0, t1 and t2 (twice on one rank under the table-wise plan), f3 by t2 and t3; f0 and f2 once
SHARED_TABLES = [("t0", 12, 8, ["f0", "f1"]), ("t1", 9, 3, ["f2", "f1"]), ("t2", 20, 8, ["f1", "f3"]),
                 ("t3", 6, 3, ["f3"])]  # fmt: skip
EQUAL_DIMS = [(name, rows, 4, features) for name, rows, _, features in SHARED_TABLES]  # sequence: one width


def shared_plans() -> dict[str, dict[str, Callable[[int], Any]]]:
    from tritonrec.dist import (
        column_wise,
        data_parallel,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )

    names = [t for t, *_ in SHARED_TABLES]
    return {
        "table_wise": {t: (lambda w, i=i: table_wise(rank=i % w)) for i, t in enumerate(names)},
        "row_wise": {t: (lambda w: row_wise()) for t in names},
        "data_parallel": {t: (lambda w: data_parallel()) for t in names},
        "column_wise": {  # f1's blocks: t0 on both ranks, t1 in three blocks, t2 on both ranks
            "t0": lambda w: column_wise(ranks=[0, 1]),
            "t1": lambda w: column_wise(ranks=[1, 0, 1]),
            "t2": lambda w: column_wise(ranks=[1, 0]),
            "t3": lambda w: column_wise(ranks=[0]),
        },
        "table_column_wise": {
            "t0": lambda w: table_column_wise(ranks=[1, 0]),
            "t1": lambda w: table_column_wise(ranks=[1]),
            "t2": lambda w: table_column_wise(ranks=[0, 1]),
            "t3": lambda w: table_column_wise(ranks=[0]),
        },
        "table_row_wise": {t: (lambda w: table_row_wise(host_index=0)) for t in names},
        "mixed": {  # f1 through row-wise, table-wise and data-parallel shardings; f3 data-parallel and column-wise
            "t0": lambda w: row_wise(),
            "t1": lambda w: table_wise(rank=w - 1),
            "t2": lambda w: data_parallel(),
            "t3": lambda w: column_wise(ranks=[1, 0, 1]),
        },
    }


SEQUENCE_KINDS = ["table_wise", "row_wise", "data_parallel", "column_wise", "table_column_wise"]


def sequence_plans(kind: str) -> dict[str, Callable[[int], Any]]:
    """A sequence sharding sends one row width: column-wise tables all in two blocks of 2 (f1's on both ranks)."""
    from tritonrec.dist import column_wise, table_column_wise

    if kind not in ("column_wise", "table_column_wise"):
        return shared_plans()[kind]
    generator = column_wise if kind == "column_wise" else table_column_wise
    ranks = {"t0": [0, 1], "t1": [1, 0], "t2": [1, 1], "t3": [0, 0]}
    return {t: (lambda w, r=r: generator(ranks=r)) for t, r in ranks.items()}


def _guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc()}


# --------------------------------------------------------------------------------------------------------- EBC
def ebc_shared_cases() -> list[Case]:
    plans = shared_plans()
    cases = []
    for kind, plan in plans.items():
        cases.append(Case(f"{kind}-dense-sum", plan, "SUM", tables=SHARED_TABLES))
        cases.append(Case(f"{kind}-dense-mean", plan, "MEAN", tables=SHARED_TABLES))
        cases.append(Case(f"{kind}-ROWWISE-weighted", plan, "SUM", True, "EXACT_ROWWISE_ADAGRAD", 3,
                          tables=SHARED_TABLES))  # fmt: skip
    return cases


VBE_KINDS = [
    ("table_wise", "SUM"),
    ("row_wise", "MEAN"),
    ("data_parallel", "SUM"),
    ("column_wise", "MEAN"),
    ("mixed", "SUM"),
]


def vbe_case(kind: str, pooling: str, rank: int, world: int) -> dict[str, Any]:
    """A variable batch per feature: the output expanded by the KJT's inverse indices, which are keyed by feature
    (not by the ``feature@table`` output names)."""
    case = Case(kind, shared_plans()[kind], pooling, tables=SHARED_TABLES)
    reference, sharded = build_pair(case, rank, world)
    features = features_of(SHARED_TABLES)
    ranks = vbe_batch(0, world, SHARED_TABLES)
    got = sharded(vbe_kjt(ranks[rank], features)).wait()
    full = reference(expanded_kjt(ranks, features))
    lo = sum(BATCH_PER_RANK[world][:rank])
    grad = torch.randn(full.values().shape, generator=torch.Generator().manual_seed(4))
    (got.values() * grad[lo : lo + got.values().shape[0]]).sum().backward()
    (full.values() * grad).sum().backward()
    result = {"forward": max_diff(got.values(), full.values()[lo : lo + ranks[rank]["batch"]]), "grad": 0.0}
    result["keys"] = (list(got.keys()), list(full.keys()), got.length_per_key() == full.length_per_key())
    for table, _, spec, param in shard_slices(sharded):
        ref = reference.embedding_bags[table].weight.grad
        block = ref[spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols]
        result["grad"] = max(result["grad"], max_diff(param.grad, block))
    return result


# ---------------------------------------------------------------------------------------------------------- EC
def ec_case(kind: str, optimizer: str | None, dedup: bool, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tritonrec.dist import EmbeddingCollectionSharder, ShardingEnv, construct_module_sharding_plan
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig, FusedEmbeddingCollection

    torch.manual_seed(13)
    configs = [EmbeddingConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=list(f))
               for t, n, d, f in EQUAL_DIMS]  # fmt: skip
    fused_params = None
    if optimizer is None:
        reference = EmbeddingCollection(configs, backend="torch")
    else:
        reference = FusedEmbeddingCollection(
            configs, optimizer, {"lr": 0.1}, backend="torch", stochastic_rounding=False
        )
        fused_params = {"optimizer": optimizer, "lr": 0.1, "stochastic_rounding": False}
    sharder = EmbeddingCollectionSharder(fused_params=fused_params, use_index_dedup=dedup)
    source = copy.deepcopy(reference)
    generators = {t: g(world) for t, g in sequence_plans(kind).items()}
    plan = construct_module_sharding_plan(source, generators, sharder, world, world, "cpu")
    for sharding in plan.values():
        sharding.compute_kernel = "dense" if optimizer is None else "fused"
    sharded = sharder.shard(source, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    for sharding in sharded.shardings:
        sharding.lookup.backend = "torch"
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    hi = lo + batch[rank]
    features = features_of(EQUAL_DIMS)
    result: dict[str, Any] = {"forward": 0.0, "lengths": 0.0, "grad": 0.0, "weights": 0.0}
    for step in range(1 if optimizer is None else 3):
        lengths, values, _ = global_batch(step, total, False, EQUAL_DIMS)
        mine = sharded(kjt_slice(lengths, values, [], lo, hi, features)).wait()
        full = reference(kjt_slice(lengths, values, [], 0, total, features))
        if step == 0:
            result["keys"] = (list(mine), list(full))
        loss_mine, loss_full = 0.0, 0.0
        for k, (name, jt) in enumerate(full.items()):
            start, stop = int(jt.lengths()[:lo].sum()), int(jt.lengths()[:hi].sum())
            weight = torch.randn(jt.values().shape, generator=torch.Generator().manual_seed(100 * step + k))
            if step == 0:
                result["forward"] = max(result["forward"], max_diff(mine[name].values(), jt.values()[start:stop]))
                result["lengths"] = max(result["lengths"], float((mine[name].lengths() != jt.lengths()[lo:hi]).any()))
            loss_mine = loss_mine + (mine[name].values() * weight[start:stop]).sum()
            loss_full = loss_full + (jt.values() * weight).sum()
        loss_mine.backward()
        loss_full.backward()
        for table, module in sharded.embeddings.items():
            for k, (shard, _) in enumerate(module.local):
                spec, param = shard.spec, getattr(module, "weight" if k == 0 else f"weight_{k}")
                rows = slice(spec.row_offset, spec.row_offset + spec.rows)
                cols = slice(spec.col_offset, spec.col_offset + spec.cols)
                ref = reference.embeddings[table].weight
                if step == 0 and optimizer is None:
                    result["grad"] = max(result["grad"], max_diff(param.grad, ref.grad[rows, cols]))
                result["weights"] = max(result["weights"], max_diff(param, ref[rows, cols]))
    return result


# ------------------------------------------------------------------------------------------------------ FP-EBC
def fp_case(rank: int, world: int) -> dict[str, Any]:
    """Position weights keyed by feature (torchrec): f1's weights feed three tables, f3's two, on a mixed plan."""
    from tests.sharding.fp_cases import shard_fp_dense
    from tritonrec.modules import (
        EmbeddingBagCollection,
        FeatureProcessedEmbeddingBagCollection,
        PositionWeightedModuleCollection,
    )

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(make_tables("SUM", tables=SHARED_TABLES), is_weighted=True, backend="torch")
    processors = PositionWeightedModuleCollection({f: 4 for f in ("f0", "f1", "f3")})  # f2 weighs 1
    with torch.no_grad():
        for w in processors.position_weights.values():
            w.copy_(torch.rand(w.shape) + 0.5)
    reference = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    sharded = shard_fp_dense(reference, {t: g(world) for t, g in shared_plans()["mixed"].items()}, world)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    features = features_of(SHARED_TABLES)
    lengths, values, _ = global_batch(0, total, False, SHARED_TABLES)
    out = sharded(kjt_slice(lengths, values, [], lo, lo + batch[rank], features)).wait()
    full = reference(kjt_slice(lengths, values, [], 0, total, features))
    grad = torch.randn(full.values().shape, generator=torch.Generator().manual_seed(9))
    (out.values() * grad[lo : lo + batch[rank]]).sum().backward()
    (full.values() * grad).sum().backward()
    result: dict[str, Any] = {"forward": max_diff(out.values(), full.values()[lo : lo + batch[rank]])}
    result["keys"] = (list(out.keys()), list(full.keys()))
    mine = {n: p.grad for n, p in sharded.named_parameters() if "position" in n}
    theirs = {n: p.grad for n, p in reference.named_parameters() if "position" in n}
    result["position_grad"] = max((max_diff(mine[n], g) for n, g in theirs.items()), default=float("inf"))
    if set(mine) != set(theirs):
        result["position_grad"] = float("inf")
    return result


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    try:
        out: dict[str, Any] = {}
        for case in ebc_shared_cases():
            out[f"ebc-{case.name}"] = _guarded(lambda case=case: run_ebc_case(case, rank, world))
        for kind, pooling in VBE_KINDS:
            out[f"vbe-{kind}"] = _guarded(lambda k=kind, p=pooling: vbe_case(k, p, rank, world))
        for kind in SEQUENCE_KINDS:
            out[f"ec-{kind}-dense"] = _guarded(lambda k=kind: ec_case(k, None, False, rank, world))
            out[f"ec-{kind}-ADAM"] = _guarded(lambda k=kind: ec_case(k, "ADAM", False, rank, world))
        out["ec-row_wise-dedup"] = _guarded(lambda: ec_case("row_wise", "EXACT_SGD", True, rank, world))
        out["fp-mixed"] = _guarded(lambda: fp_case(rank, world))
        return out
    finally:
        set_gradient_division(True)
