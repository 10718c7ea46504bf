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
    build_dlrm,
    dense_optimizer,
    global_batch,
    local_shards,
    loss_of,
    max_diff,
    train_against_reference,
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
# an optimizer applied in backward: (class, kwargs, the tables it goes on; None: all)
Applied = tuple[type, dict[str, Any], list[str] | None]
_ADAGRAD_01 = (torch.optim.Adagrad, {"lr": 0.1}, ["t0", "t1"])
_MIXED = [_ADAGRAD_01, (torch.optim.SGD, {"lr": 0.2}, ["t2", "t3"])]
_TWO_LR = [_ADAGRAD_01, (torch.optim.Adagrad, {"lr": 0.05}, ["t2", "t3"])]
# case -> (plan kind, the optimizers applied in backward)
CASES: dict[str, tuple[str, list[Applied]]] = {
    "adagrad-tw": ("tw", [(torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}, None)]),
    "adagrad-rw": ("rw", [(torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}, None)]),
    "adagrad-planner": ("planner", [(torch.optim.Adagrad, {"lr": 0.1}, None)]),
    "sgd-cw": ("cw", [(torch.optim.SGD, {"lr": 0.2}, None)]),
    "adam-tw": ("tw", [(torch.optim.Adam, {"lr": 0.02, "betas": (0.8, 0.99)}, None)]),
    # data_parallel() without a kernel: fused for such tables (dense would hand them to the dense optimizer)
    "adagrad-dp": ("dp-default", [(torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5}, None)]),
    # tables of one module with different optimizers (torchrec's per-table fused_params): one fused group each
    **{f"mixed-{kind}": (kind, _MIXED) for kind in ("tw", "rw", "cw", "dp-default", "planner")},
    **{f"two-lr-{kind}": (kind, _TWO_LR) for kind in ("tw", "cw", "dp-default")},
}


def expected_group_lrs(case: str) -> list[float]:
    """The lr of each fused param group of ``case``, in order (one group per distinct optimizer)."""
    return [kwargs["lr"] for _, kwargs, _ in CASES[case][1]]


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

    kind, applied = CASES[name]
    model = _plain_dlrm()
    if applied[0][0] is torch.optim.Adam:
        reference = _fused_reference(model, applied[0][0], applied[0][1])
    else:
        reference = copy.deepcopy(model)
        for optimizer, kwargs, tables in applied:
            _apply(reference, optimizer, kwargs, tables)
    for optimizer, kwargs, tables in applied:
        _apply(model, optimizer, kwargs, tables)
    dmp = _wrap(model, kind, world)
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    out: dict[str, Any] = {"tables": 0.0, "state": 0.0}
    out["loss"] = train_against_reference(dmp, reference, dmp_dense, ref_dense, rank, world, STEPS)
    ref_params = dict(reference.named_parameters())
    for table, param, (r0, nr, c0, nc) in local_shards(dmp, rank):
        ref_weight = ref_params[f"{SHARDED_PATH}.embedding_bags.{table}.weight"]
        out["tables"] = max(out["tables"], max_diff(param, ref_weight[r0 : r0 + nr, c0 : c0 + nc]))
        ref_optimizer = getattr(ref_weight, "_in_backward_optimizers", [None])[0]
        if isinstance(ref_optimizer, torch.optim.Adagrad):  # torch's accumulator ("sum") against the fused momentum
            torch_state = ref_optimizer.state[ref_weight]
            mine = dmp.fused_optimizer.state[param]["momentum1"]
            out["state"] = max(out["state"], max_diff(mine, torch_state["sum"][r0 : r0 + nr, c0 : c0 + nc]))
    kernels = {p.compute_kernel for p in dmp.plan.get_plan_for_module(SHARDED_PATH).values()}
    out["kernels"] = sorted(kernels)
    out["fused_groups"] = [
        {k: v for k, v in group.items() if k in ("lr", "eps", "betas")} for group in dmp.fused_optimizer.param_groups
    ]
    # each param group holds exactly this rank's shards of its tables
    names = {id(p): n for n, p in dmp.fused_optimizer.params.items()}
    out["group_tables"] = [
        sorted({names[id(p)].split(".")[-2] for p in g["params"]}) for g in dmp.fused_optimizer.param_groups
    ]
    out["local_tables"] = sorted({table for table, _, _ in local_shards(dmp, rank)})
    out["dense_names"] = sorted(n for n, _ in dmp_dense.params.items() if "embedding_bags" in n)
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # the test checks type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def error_cases(rank: int, world: int) -> dict[str, str]:
    two = _plain_dlrm()
    _apply(two, torch.optim.SGD, {"lr": 0.1})
    _apply(two, torch.optim.SGD, {"lr": 0.2})
    momentum = _plain_dlrm()
    _apply(momentum, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    dense = _plain_dlrm()
    _apply(dense, torch.optim.SGD, {"lr": 0.1})
    fused = build_dlrm()  # a fused collection's tables carry its optimizer the same way
    return {
        "dense_kernel": _raises(lambda: _wrap(dense, "tw-dense", world)),
        "fused_dense_kernel": _raises(lambda: _wrap(fused, "tw-dense", world)),
        "two_optimizers": _raises(lambda: wrap(two, "tw", world)),
        "momentum": _raises(lambda: wrap(momentum, "tw", world)),
    }


# ------------------------------------------------------------------------------------ per-table optimizers: extras
def _mixed_dmp(kind: str, world: int, seed: int = 5, applied: list[Applied] = _MIXED, **kwargs: Any) -> Any:
    model = _plain_dlrm(seed)
    for optimizer, opt_kwargs, tables in applied:
        _apply(model, optimizer, opt_kwargs, tables)
    return wrap(model, kind, world, **kwargs) if kwargs else _wrap(model, kind, world)


def _train(dmp: Any, dense: Any, steps: range, rank: int, world: int) -> list[float]:
    """Train ``dmp`` on this rank's part of the global batches of ``steps``; this rank's losses."""
    total, lo = BATCH_PER_RANK * world, BATCH_PER_RANK * rank
    losses = []
    for step in steps:
        dense.zero_grad()
        loss = loss_of(dmp, *batch_slice(global_batch(step, total), lo, lo + BATCH_PER_RANK))
        loss.backward()
        dense.step()
        losses.append(float(loss.detach()))
    return losses


def lr_edit_case(rank: int, world: int) -> dict[str, Any]:
    """Mixed optimizers, table-wise: the SGD group's lr set to 0 stops exactly t2 and t3."""
    dmp = _mixed_dmp("tw", world)
    dense = dense_optimizer(dmp.named_parameters())
    dmp.fused_optimizer.param_groups[1]["lr"] = 0.0
    before = {table: param.detach().clone() for table, param, _ in local_shards(dmp, rank)}
    _train(dmp, dense, range(STEPS), rank, world)
    moved = {
        table: bool((param.detach() - before[table]).abs().max() > 0) for table, param, _ in local_shards(dmp, rank)
    }
    return {"moved": moved, "lrs": [group["lr"] for group in dmp.fused_optimizer.param_groups]}


def _fused_state(dmp: Any, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for table, param, _ in local_shards(dmp, rank):
        out[table] = param.detach().clone()
        for key, value in dmp.fused_optimizer.state[param].items():
            out[f"{table}.{key}"] = value.detach().clone()
    return out


def checkpoint_case(rank: int, world: int) -> dict[str, Any]:
    """Mixed optimizers: a DCP checkpoint (with an edited lr) restores identical training, table-wise into a model
    built from other weights (this rank's tables and fused state bit-identical), and row-wise (re-sharded: the whole
    tables, gathered, within float tolerance)."""
    from tests.model_parallel.checkpoint_cases import root
    from tritonrec.dist.checkpoint import CheckpointManager
    from tritonrec.dist.sharded_state import gather_unsharded_state_dict

    dmp = _mixed_dmp("tw", world)
    dense = dense_optimizer(dmp.named_parameters())
    _train(dmp, dense, range(2), rank, world)
    dmp.fused_optimizer.param_groups[1]["lr"] = 0.3  # what a scheduler would have set: the checkpoint carries it
    manager = CheckpointManager(root() / "in_backward_mixed")
    manager.save(2, dmp, {"dense": dense})
    losses = _train(dmp, dense, range(2, 2 + STEPS), rank, world)
    expected, expected_whole = _fused_state(dmp, rank), gather_unsharded_state_dict(dmp)
    out: dict[str, Any] = {}
    for kind in ("tw", "rw"):
        fresh = _mixed_dmp(kind, world, seed=9)
        fresh_dense = dense_optimizer(fresh.named_parameters())
        manager.load(fresh, {"dense": fresh_dense})
        lrs = [group["lr"] for group in fresh.fused_optimizer.param_groups]
        resumed = _train(fresh, fresh_dense, range(2, 2 + STEPS), rank, world)
        got, whole = _fused_state(fresh, rank), gather_unsharded_state_dict(fresh)
        out[kind] = {
            "lrs": lrs,
            "loss": max(abs(a - b) for a, b in zip(losses, resumed, strict=True)),
            "whole": 0.0 if whole is None else max(max_diff(whole[k], v) for k, v in expected_whole.items()),
        }
        if kind == "tw":
            out[kind]["keys"] = sorted(got) == sorted(expected)
            out[kind]["state"] = max(max_diff(got[k], expected[k]) if k in expected else float("inf") for k in got)
    return out


def rowwise_column_case(rank: int, world: int) -> dict[str, Any]:
    """Rowwise Adagrad from the sharder's fused_params on t0, t1 beside SGD applied in backward on t2, t3: column-wise
    (whose rowwise tables exchange row sums of squares, the SGD ones not) trains as table-wise (exact tables)."""
    from tritonrec.dist import EmbeddingBagCollectionSharder
    from tritonrec.dist.sharded_state import gather_unsharded_state_dict
    from tritonrec.kernels.embedding import OptimType

    fused_params = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    applied: list[Applied] = [(torch.optim.SGD, {"lr": 0.2}, ["t2", "t3"])]
    runs = {}
    for kind in ("tw", "cw"):
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
        dmp = _mixed_dmp(kind, world, applied=applied, sharders=[sharder])
        dense = dense_optimizer(dmp.named_parameters())
        losses = _train(dmp, dense, range(STEPS), rank, world)
        optims = [g.state.optim.name for s in dmp.module.get_submodule(SHARDED_PATH).shardings for g in s.lookup.groups]
        runs[kind] = (losses, gather_unsharded_state_dict(dmp), sorted(set(optims)))
    (tw_losses, tw_tables, _), (cw_losses, cw_tables, cw_optims) = runs["tw"], runs["cw"]
    tables = 0.0 if tw_tables is None else max(max_diff(cw_tables[k], v) for k, v in tw_tables.items())
    return {
        "loss": max(abs(a - b) for a, b in zip(tw_losses, cw_losses, strict=True)),
        "tables": tables,
        "optims": cw_optims,
    }


def run_suite(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: run_case(name, rank, world) for name in CASES}
    out["errors"] = error_cases(rank, world)
    out["lr_edit"] = lr_edit_case(rank, world)
    out["checkpoint"] = checkpoint_case(rank, world)
    out["rowwise_column"] = rowwise_column_case(rank, world)
    return out
