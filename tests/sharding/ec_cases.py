"""Rank-side cases for the sharded EmbeddingCollection: per sequence sharding type (data parallel, table-wise,
column-wise, table-column-wise, row-wise with even and uneven row blocks), dense forward and gradients and 10 fused
steps, with and without index dedup, against the unsharded EC on the global batch (uneven split, empty bags, a table
with fewer rows than ranks; dims 1/3/8/64 in the mixed plan, where each sharding's tables share a width)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tests.sharding.ebc_cases import BATCH_PER_RANK, FEATURES, LR, TABLES, global_batch, kjt_slice, max_diff

EQUAL_DIMS = [(name, rows, 8, features) for name, rows, _, features in TABLES]


@dataclass
class ECCase:
    name: str
    tables: list
    plans: dict[str, Callable[[int], Any]]
    optimizer: str | None = None
    dedup: bool = False
    steps: int = 1


def _configs(tables: list) -> list:
    from tritonrec.modules import EmbeddingConfig

    return [EmbeddingConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=list(f)) for t, n, d, f in tables]


def plans() -> dict[str, dict[str, Callable[[int], Any]]]:
    from tritonrec.dist import column_wise, data_parallel, row_wise, table_column_wise, table_wise

    names = [t for t, *_ in TABLES]
    return {
        "table_wise": {t: (lambda w, i=i: table_wise(rank=(i + 1) % w)) for i, t in enumerate(names)},
        "row_wise": {t: (lambda w: row_wise()) for t in names},
        "row_wise_uneven": {  # sizes_placement: 12 rows as 9+3, 1 row on rank 1 only, 9 as 2+7, 20 on rank 0 only
            "t0": lambda w: row_wise(([9, 3], "cpu")),
            "t1": lambda w: row_wise(([0, 1], "cpu")),
            "t2": lambda w: row_wise(([2, 7], "cpu")),
            "t3": lambda w: row_wise(([20, 0], "cpu")),
        },
        "data_parallel": {t: (lambda w: data_parallel()) for t in names},
        "column_wise": {
            "t0": lambda w: column_wise(ranks=[0, w - 1]),
            "t1": lambda w: column_wise(ranks=[1, 1]),
            "t2": lambda w: column_wise(ranks=[w - 1, 0]),
            "t3": lambda w: column_wise(ranks=[0, 1]),
        },
        "column_wise_uneven": {  # size_per_rank blocks of the width-8 tables: refused (one row width on the wire)
            "t0": lambda w: column_wise(size_per_rank=[5, 3]),
            "t1": lambda w: column_wise(ranks=[1, 0], size_per_rank=[1, 7]),
            "t2": lambda w: column_wise(ranks=[w - 1], size_per_rank=[8]),
            "t3": lambda w: column_wise(ranks=[0, 1, 1], size_per_rank=[2, 2, 4]),
        },
        "table_column_wise": {t: (lambda w: table_column_wise(ranks=[1, 0])) for t in names},
        "mixed": {  # dims 8 / 3 / 1 / 64: one width per sharding
            "t0": lambda w: row_wise(),
            "t1": lambda w: table_wise(rank=w - 1),
            "t2": lambda w: data_parallel(),
            "t3": lambda w: column_wise(ranks=[1, 0]),
        },
    }


def ec_cases() -> list[ECCase]:
    cases = []
    optimizers = ["EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "ADAM"]
    for k, kind in enumerate(["table_wise", "row_wise", "data_parallel", "column_wise", "table_column_wise"]):
        cases.append(ECCase(f"{kind}-dense", EQUAL_DIMS, plans()[kind]))
        cases.append(ECCase(f"{kind}-{optimizers[k % 3]}", EQUAL_DIMS, plans()[kind], optimizers[k % 3], steps=10))
    cases.append(ECCase("mixed-dense", TABLES, plans()["mixed"]))
    cases.append(ECCase("mixed-ADAM", TABLES, plans()["mixed"], "ADAM", steps=10))
    cases.append(ECCase("mixed-EXACT_ADAGRAD", TABLES, plans()["mixed"], "EXACT_ADAGRAD", steps=10))
    cases.append(ECCase("row_wise-dedup-dense", EQUAL_DIMS, plans()["row_wise"], dedup=True))
    cases.append(ECCase("row_wise_uneven-dense", EQUAL_DIMS, plans()["row_wise_uneven"]))
    cases.append(ECCase("row_wise_uneven-ADAM", EQUAL_DIMS, plans()["row_wise_uneven"], "ADAM", steps=10))
    adagrad = "EXACT_ROWWISE_ADAGRAD"
    cases.append(ECCase(f"mixed-dedup-{adagrad}", TABLES, plans()["mixed"], adagrad, dedup=True, steps=10))
    return cases


def _build(case: ECCase, world: int, codecs: Any = None):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from tritonrec.dist import EmbeddingCollectionSharder, ShardingEnv, construct_module_sharding_plan
    from tritonrec.modules import EmbeddingCollection, FusedEmbeddingCollection

    torch.manual_seed(11)
    configs = _configs(case.tables)
    fused_params = None
    if case.optimizer is None:
        reference = EmbeddingCollection(configs, backend="torch")
    else:
        kwargs = {"lr": LR[case.optimizer]}
        reference = FusedEmbeddingCollection(
            configs, case.optimizer, kwargs, backend="torch", stochastic_rounding=False
        )
        fused_params = {"optimizer": case.optimizer, **kwargs, "stochastic_rounding": False}
    source = copy.deepcopy(reference)
    sharder = EmbeddingCollectionSharder(
        fused_params=fused_params, use_index_dedup=case.dedup, qcomm_codecs_registry=codecs
    )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    generators = {t: g(world) for t, g in case.plans.items()}
    plan = construct_module_sharding_plan(source, generators, sharder, local, world, "cpu")
    for sharding in plan.values():
        sharding.compute_kernel = "dense" if case.optimizer is None else "fused"
    sharded = sharder.shard(source, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    for sharding in sharded.shardings:
        sharding.lookup.backend = "torch"
    return reference, sharded


def run_ec_case(case: ECCase, rank: int, world: int) -> dict[str, float]:
    reference, sharded = _build(case, world)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    hi = lo + batch[rank]
    result = {"forward": 0.0, "lengths": 0.0, "grad": 0.0, "weights": 0.0}

    def block(tensor: torch.Tensor, spec: Any) -> torch.Tensor:
        return tensor[spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols]

    for step in range(case.steps):
        lengths, values, _ = global_batch(step, total, False)
        mine = sharded(kjt_slice(lengths, values, [], lo, hi)).wait()
        full = reference(kjt_slice(lengths, values, [], 0, total))
        loss_mine, loss_full = 0.0, 0.0
        for i, f in enumerate(FEATURES):
            start, stop = int(lengths[i, :lo].sum()), int(lengths[i, :hi].sum())
            rows = full[f].values()
            weight = torch.randn(rows.shape, generator=torch.Generator().manual_seed(100 * step + i))
            if step == 0:
                result["forward"] = max(result["forward"], max_diff(mine[f].values(), rows[start:stop]))
                result["lengths"] = max(result["lengths"], float((mine[f].lengths() != lengths[i, lo:hi]).any()))
            loss_mine = loss_mine + (mine[f].values() * weight[start:stop]).sum()
            loss_full = loss_full + (rows * weight).sum()
        loss_mine.backward()
        loss_full.backward()
        if step == 0 and case.optimizer is None:
            for table, module in sharded.embeddings.items():
                for k, (shard, _) in enumerate(module.local):
                    spec, param = shard.spec, getattr(module, "weight" if k == 0 else f"weight_{k}")
                    expected = block(reference.embeddings[table].weight.grad, spec)
                    result["grad"] = max(result["grad"], max_diff(param.grad, expected))
    for table, module in sharded.embeddings.items():
        for k, (shard, _) in enumerate(module.local):
            spec, param = shard.spec, getattr(module, "weight" if k == 0 else f"weight_{k}")
            expected = block(reference.embeddings[table].weight, spec)
            result["weights"] = max(result["weights"], max_diff(param, expected))
    return result


def uneven_refusal(world: int) -> str:
    """Uneven column blocks (``column_wise(size_per_rank=...)``) cannot share the sequence all-to-all's one row
    width: sharding must refuse them (the same way on every rank, before any batch)."""
    try:
        _build(ECCase("column_wise_uneven", EQUAL_DIMS, plans()["column_wise_uneven"]), world)
    except ValueError as err:
        return str(err)
    return "not refused"


def codec_case(rank: int, world: int, kind: str) -> dict[str, float]:
    """FP16 on the sequence all-to-all: rows within half an fp16 ulp of the exact ones (rows travel unsummed), and
    the codec really on both wires (outputs and gradients change)."""
    from tritonrec.dist import QCommsConfig, get_qcomm_codecs_registry

    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision="fp16", backward_precision="fp16"))
    batch = BATCH_PER_RANK[world]
    lo = sum(batch[:rank])
    lengths, values, _ = global_batch(0, sum(batch), False)
    runs = []
    for codecs in (None, registry):
        _, sharded = _build(ECCase(kind, EQUAL_DIMS, plans()[kind]), world, codecs)
        out = sharded(kjt_slice(lengths, values, [], lo, lo + batch[rank])).wait()
        rows = torch.cat([out[f].values() for f in FEATURES])
        rows.backward(torch.ones_like(rows) * 1.3)
        grads = torch.cat([p.grad.reshape(-1) for p in sharded.parameters() if p.grad is not None])
        runs.append((rows.detach(), grads))
    (exact, exact_grads), (coded, coded_grads) = runs
    bound = 2**-11 * exact.abs().amax(dim=1, keepdim=True) + 1e-12
    return {
        "forward": float(((coded - exact).abs() / bound).max()),
        "changed": float((coded != exact).any()) * float((coded_grads != exact_grads).any()),
    }


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    try:
        out: dict[str, Any] = {case.name: run_ec_case(case, rank, world) for case in ec_cases()}
        out["codecs"] = {kind: codec_case(rank, world, kind) for kind in CODEC_KINDS}
        out["uneven_refused"] = uneven_refusal(world)
        return out
    finally:
        set_gradient_division(True)


CODEC_KINDS = ["table_wise", "row_wise"]
