"""Rank-side cases (2 ranks): torchrec's way of choosing the embedding optimizer, ``apply_optimizer_in_backward`` on
a plain EBC's tables before DistributedModelParallel (torchrec's dlrm_main does this), against the same DLRM trained
in one process on the global batch.

For SGD and per-element Adagrad the reference is torch's own optimizer stepping each unsharded table inside the
backward (``apply_optimizer_in_backward`` in eager: dense gradients, so an untouched row has a zero gradient, which
moves neither rule); Adam steps untouched rows in torch (its moments), so its reference is the unsharded
``FusedEmbeddingBagCollection`` with ``torch.optim.Adam``. The dense layers train with SGD + momentum on both sides.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.model_parallel.dlrm_cases import (
    BATCH_PER_RANK,
    DENSE_IN,
    DIM,
    SHARDED_PATH,
    TABLES,
    batch_slice,
    dense_optimizer,
    global_batch,
    local_shards,
    loss_of,
    max_diff,
    wrap,
)


def _wrap(model: nn.Module, kind: str, world: int) -> Any:
    """``wrap`` (dlrm_cases' plans), plus ``dp-default``: every table ``data_parallel()`` with no kernel named, and
    ``tw-dense``: table-wise on the dense kernel."""
    from tritonrec.dist import (
        EmbeddingBagCollectionSharder,
        ShardingPlan,
        construct_module_sharding_plan,
        data_parallel,
        table_wise,
    )
    from tritonrec.dist.model_parallel import DistributedModelParallel

    if kind not in ("dp-default", "tw-dense"):
        return wrap(model, kind, world)
    ebc = model.get_submodule(SHARDED_PATH)
    gens = {n: data_parallel() if kind == "dp-default" else table_wise(rank=0, compute_kernel="dense")
            for n, _ in TABLES}  # fmt: skip
    plan = construct_module_sharding_plan(ebc, gens, EmbeddingBagCollectionSharder(), world, world, "cpu")
    dmp = DistributedModelParallel(model, plan=ShardingPlan({SHARDED_PATH: plan}))
    for sharding in dmp.module.get_submodule(SHARDED_PATH).shardings:
        sharding.lookup.backend = "torch"
    return dmp


STEPS = 5
# case -> (plan kind, optimizer class, its kwargs)
CASES: dict[str, tuple[str, type, dict[str, Any]]] = {
    "adagrad-tw": ("tw", torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "adagrad-rw": ("rw", torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "adagrad-planner": ("planner", torch.optim.Adagrad, {"lr": 0.1}),
    "sgd-cw": ("cw", torch.optim.SGD, {"lr": 0.2}),
    "adam-tw": ("tw", torch.optim.Adam, {"lr": 0.02, "betas": (0.8, 0.99)}),
    # data_parallel() without a kernel: fused for such tables (dense would hand them to the dense optimizer)
    "adagrad-dp": ("dp-default", torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5}),
}


def _plain_dlrm(seed: int = 5) -> nn.Module:
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from tritonrec.modules.dlrm import DLRM

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=DIM, name=n, feature_names=[f"f_{n}"])
              for n, rows in TABLES]  # fmt: skip
    return DLRM(EmbeddingBagCollection(tables, backend="torch"), DENSE_IN, [16, DIM], [16, 1])


def _apply(model: nn.Module, optimizer: type, kwargs: dict[str, Any], tables: list[str] | None = None) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    ebc = model.get_submodule(SHARDED_PATH)
    params = [p for name, p in ebc.named_parameters() if tables is None or name.split(".")[1] in tables]
    _apply_optimizer_in_backward(optimizer, params, kwargs)


def _fused_reference(model: nn.Module, optimizer: type, kwargs: dict[str, Any]) -> nn.Module:
    """``model`` with its EBC swapped for a FusedEmbeddingBagCollection holding the same tables and rule."""
    from tritonrec.modules import FusedEmbeddingBagCollection

    ebc = model.get_submodule(SHARDED_PATH)
    fused = FusedEmbeddingBagCollection(ebc.embedding_bag_configs(), optimizer, kwargs, backend="torch")
    fused.load_state_dict(ebc.state_dict())
    reference = copy.deepcopy(model)
    reference.sparse_arch.embedding_bag_collection = fused
    return reference


def run_case(name: str, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    kind, optimizer, kwargs = CASES[name]
    model = _plain_dlrm()
    if optimizer is torch.optim.Adam:
        reference = _fused_reference(model, optimizer, kwargs)
    else:
        reference = copy.deepcopy(model)
        _apply(reference, optimizer, kwargs)
    _apply(model, optimizer, kwargs)
    dmp = _wrap(model, kind, world)
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    total, lo = BATCH_PER_RANK * world, BATCH_PER_RANK * rank
    out: dict[str, Any] = {"loss": 0.0, "tables": 0.0, "state": 0.0}
    for step in range(STEPS):
        batch = global_batch(step, total)
        for opt in (dmp_dense, ref_dense):
            opt.zero_grad()
        loss = loss_of(dmp, *batch_slice(batch, lo, lo + BATCH_PER_RANK))
        loss.backward()
        dmp_dense.step()
        ref_loss = loss_of(reference, *batch_slice(batch, 0, total))
        ref_loss.backward()
        ref_dense.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        out["loss"] = max(out["loss"], abs(float(global_loss) / world - float(ref_loss.detach())))
    ref_params = dict(reference.named_parameters())
    for table, param, (r0, nr, c0, nc) in local_shards(dmp, rank):
        ref_weight = ref_params[f"{SHARDED_PATH}.embedding_bags.{table}.weight"]
        out["tables"] = max(out["tables"], max_diff(param, ref_weight[r0 : r0 + nr, c0 : c0 + nc]))
        if optimizer is torch.optim.Adagrad:  # torch's accumulator ("sum") against the fused momentum
            torch_state = ref_weight._in_backward_optimizers[0].state[ref_weight]
            mine = dmp.fused_optimizer.state[param]["momentum1"]
            out["state"] = max(out["state"], max_diff(mine, torch_state["sum"][r0 : r0 + nr, c0 : c0 + nc]))
    kernels = {p.compute_kernel for p in dmp.plan.get_plan_for_module(SHARDED_PATH).values()}
    out["kernels"] = sorted(kernels)
    out["fused_groups"] = [
        {k: v for k, v in group.items() if k in ("lr", "eps", "betas")} for group in dmp.fused_optimizer.param_groups
    ]
    out["dense_names"] = sorted(n for n, _ in dmp_dense.params.items() if "embedding_bags" in n)
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # the test checks type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def error_cases(rank: int, world: int) -> dict[str, str]:
    mixed = _plain_dlrm()
    _apply(mixed, torch.optim.Adagrad, {"lr": 0.1}, ["t0", "t1"])
    _apply(mixed, torch.optim.SGD, {"lr": 0.1}, ["t2", "t3"])
    two = _plain_dlrm()
    _apply(two, torch.optim.SGD, {"lr": 0.1})
    _apply(two, torch.optim.SGD, {"lr": 0.2})
    momentum = _plain_dlrm()
    _apply(momentum, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    dense = _plain_dlrm()
    _apply(dense, torch.optim.SGD, {"lr": 0.1})
    return {
        "dense_kernel": _raises(lambda: _wrap(dense, "tw-dense", world)),
        "mixed": _raises(lambda: wrap(mixed, "tw", world)),
        "two_optimizers": _raises(lambda: wrap(two, "tw", world)),
        "momentum": _raises(lambda: wrap(momentum, "tw", world)),
    }


def run_suite(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: run_case(name, rank, world) for name in CASES}
    out["errors"] = error_cases(rank, world)
    return out
