"""Rank-side cases (2 ranks): ``dmp.fused_optimizer.state_dict()`` saved and loaded with plain
``torch.distributed.checkpoint`` (torchrec's pattern, no tritonrec checkpoint module), under one plan and another.

Each case trains a DLRM under DMP (plan ``saved``) for 2 steps, saves ``{"model": dmp.state_dict(), "optim":
dmp.fused_optimizer.state_dict()}`` with ``dcp.save``, builds another DMP (other initial values, plan ``loaded``, a
different learning rate), ``dcp.load``\\ s into its state dicts and calls ``load_state_dict`` on both. The tables of
dlrm_cases have row counts that split evenly (40 rows: rank 1's momentum has the shape of rank 0's, which a plain
tensor state silently loaded into rank 0) and unevenly (7 and 25 rows: a size error), and a 1-row table (a rank with
no rows). Results are the unsharded fused state before and after (gathered on every rank) and the learning rate.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

from tests.model_parallel.dlrm_cases import (
    BATCH_PER_RANK,
    DENSE_IN,
    DIM,
    SHARDED_PATH,
    TABLES,
    batch_slice,
    dense_optimizer,
    global_batch,
    loss_of,
    wrap,
)

# (optimizer, plan saved, plan loaded)
CASES = [
    ("EXACT_ROWWISE_ADAGRAD", "rw", "rw"),
    ("EXACT_ROWWISE_ADAGRAD", "tw", "rw"),
    ("EXACT_ROWWISE_ADAGRAD", "tw", "cw"),
    ("EXACT_ROWWISE_ADAGRAD", "cw", "tw"),
    ("ADAM", "rw", "rw"),
    ("ADAM", "tw", "cw"),
    ("ADAM", "cw", "rw"),
    ("EXACT_ADAGRAD", "tw", "cw"),
    ("EXACT_ADAGRAD", "cw", "rw"),
]


def case_name(optim: str, saved: str, loaded: str) -> str:
    return f"{optim}:{saved}->{loaded}"


def _build(optim: str, seed: int, lr: float) -> torch.nn.Module:
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=DIM, name=n, feature_names=[f"f_{n}"])
              for n, rows in TABLES]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, optim, {"lr": lr}, backend="torch", stochastic_rounding=False)
    return DLRM(ebc, DENSE_IN, [16, DIM], [16, 1])


def _full(value: Any) -> torch.Tensor:
    """A ShardedTensor (or a replicated tensor) as the whole tensor, on every rank (collective)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    pieces = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    full = torch.full(tuple(value.size()), float("nan"))
    for rank_pieces in gathered:
        for offsets, tensor in rank_pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))] = tensor
    return full


def unsharded_fused_state(dmp: Any) -> dict[str, dict[str, Any]]:
    """``{table: {state: full tensor, "step": every holder's step}}`` of a DMP's fused optimizer (collective)."""
    import torch.distributed as dist

    from tritonrec.dist.sharded_state import fused_optimizer_state_dict

    out: dict[str, dict[str, Any]] = {}
    for table, entry in fused_optimizer_state_dict(dmp.module.get_submodule(SHARDED_PATH)).items():
        out[table] = {k: _full(v) for k, v in entry.items() if k != "step"}
        steps: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, int(entry["step"]) if "step" in entry else None)
        out[table]["step"] = sorted({s for s in steps if s is not None})
    return out


def _same(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[str]:
    """The ``table.state`` entries of two :func:`unsharded_fused_state` results that differ (tensors bit for bit)."""
    return [
        f"{table}.{key}"
        for table, entry in a.items()
        for key, value in entry.items()
        if not (torch.equal(value, b[table][key]) if isinstance(value, torch.Tensor) else value == b[table][key])
    ]


def _train(dmp: Any, rank: int, world: int, steps: range) -> None:
    dense = dense_optimizer(dmp.named_parameters())
    lo = BATCH_PER_RANK * rank
    for step in steps:
        dense.zero_grad()
        loss_of(dmp, *batch_slice(global_batch(step, BATCH_PER_RANK * world), lo, lo + BATCH_PER_RANK)).backward()
        dense.step()


def dcp_round_trip(rank: int, world: int, root: str, optim: str, saved: str, loaded: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    first = wrap(_build(optim, 3, 0.1), saved, world)
    _train(first, rank, world, range(2))
    path = os.path.join(root, case_name(optim, saved, loaded).replace(":", "_").replace(">", ""))
    sharded_types = sorted({type(v).__name__ for e in first.fused_optimizer.state_dict()["state"].values()
                            for k, v in e.items() if k != "step"})  # fmt: skip
    dcp.save({"model": first.state_dict(), "optim": first.fused_optimizer.state_dict()}, checkpoint_id=path)
    second = wrap(_build(optim, 11, 0.5), loaded, world)
    state = {"model": second.state_dict(), "optim": second.fused_optimizer.state_dict()}
    error = None
    try:
        dcp.load(state, checkpoint_id=path)
        second.load_state_dict(state["model"])
        second.fused_optimizer.load_state_dict(state["optim"])
    except BaseException as err:  # DCP's CheckpointException is a BaseException; the test reports it
        error = f"{type(err).__name__}: {str(err)[-600:]}"
    mismatches = _same(unsharded_fused_state(first), unsharded_fused_state(second))
    return {"error": error, "mismatches": mismatches, "lr": second.fused_optimizer.param_groups[0]["lr"],
            "types": sharded_types}  # fmt: skip


def direct_loads(rank: int, world: int) -> dict[str, Any]:
    """``load_state_dict`` without DCP: another DMP of the same plan's state dict, an unsharded model's (full
    tensors: each rank keeps its slice) and the way back (a column-wise state gathered into an unsharded model, then
    into row-wise shards), its own earlier ``state_dict()`` (a copy: restores), and bad ones (clear
    errors, nothing written; another plan's state: every rank raises, none waits for another)."""
    first = wrap(_build("ADAM", 3, 0.1), "cw", world)
    _train(first, rank, world, range(2))
    second = wrap(_build("ADAM", 11, 0.1), "cw", world)
    second.fused_optimizer.load_state_dict(first.fused_optimizer.state_dict())
    out: dict[str, Any] = {"same_plan": _same(unsharded_fused_state(first), unsharded_fused_state(second))}
    # an unsharded model's state (every table, full tensors) into table-wise shards, through the combined optimizer:
    # each rank keeps the tables it holds
    from tritonrec.optim import CombinedOptimizer

    unsharded = _build("ADAM", 5, 0.1)
    _train(unsharded, 0, 1, range(1))
    full = CombinedOptimizer([(SHARDED_PATH, unsharded.get_submodule(SHARDED_PATH).fused_optimizer)]).state_dict()
    table_wise = wrap(_build("ADAM", 13, 0.7), "tw", world)
    table_wise.fused_optimizer.load_state_dict(full)
    expected = {
        name.split(".")[-2]: {k: [int(v)] if k == "step" else v for k, v in entry.items()}
        for name, entry in full["state"].items()
    }
    out["from_unsharded"] = _same(expected, unsharded_fused_state(table_wise))
    out["from_unsharded_lr"] = table_wise.fused_optimizer.param_groups[0]["lr"]
    # and back: per-element Adagrad's column-wise state, gathered, into an unsharded model, then into row-wise shards
    column_blocks = wrap(_build("EXACT_ADAGRAD", 3, 0.1), "cw", world)
    _train(column_blocks, rank, world, range(2))
    gathered = unsharded_fused_state(column_blocks)
    plain = _build("EXACT_ADAGRAD", 7, 0.1).get_submodule(SHARDED_PATH)
    full_state = {
        f"embedding_bags.{table}.weight": {k: torch.tensor(v[0]) if k == "step" else v for k, v in entry.items()}
        for table, entry in gathered.items()
    }
    plain.fused_optimizer.load_state_dict(
        {"state": full_state, "param_groups": plain.fused_optimizer.state_dict()["param_groups"]}
    )
    plain_state = {name.split(".")[-2]: {k: [int(v)] if k == "step" else v for k, v in entry.items()}
                   for name, entry in plain.fused_optimizer.state_dict()["state"].items()}  # fmt: skip
    out["to_unsharded"] = _same(gathered, plain_state)
    row_wise_adagrad = wrap(_build("EXACT_ADAGRAD", 13, 0.1), "rw", world)
    row_wise_adagrad.fused_optimizer.load_state_dict(
        CombinedOptimizer([(SHARDED_PATH, plain.fused_optimizer)]).state_dict()
    )
    out["back_to_sharded"] = _same(gathered, unsharded_fused_state(row_wise_adagrad))
    module = second.module.get_submodule(SHARDED_PATH)
    snapshot, before = module.fused_optimizer.state_dict(), unsharded_fused_state(second)  # copies, not views
    _train(second, rank, world, range(2, 3))
    out["snapshot_moved"] = _same(unsharded_fused_state(second), before) != []
    module.fused_optimizer.load_state_dict(snapshot)
    out["snapshot_restored"] = _same(unsharded_fused_state(second), before)
    bad = module.fused_optimizer.state_dict()
    name = f"embedding_bags.{TABLES[0][0]}.weight"
    bad["state"][name]["momentum1"] = torch.zeros(3, DIM)
    before = unsharded_fused_state(second)
    try:
        module.fused_optimizer.load_state_dict(bad)
        out["bad_shape"] = "no error"
    except ValueError as err:
        out["bad_shape"] = str(err)
    out["bad_wrote"] = _same(unsharded_fused_state(second), before)
    # another plan's state without DCP: rank 0 (first column blocks) misses rows, rank 1 (the other blocks) loads no
    # per-row state and would wait for rank 0's after the copy: both raise
    row_wise = wrap(_build("EXACT_ROWWISE_ADAGRAD", 3, 0.1), "rw", world)
    column_wise = wrap(_build("EXACT_ROWWISE_ADAGRAD", 11, 0.1), "cw", world)
    try:
        column_wise.fused_optimizer.load_state_dict(row_wise.fused_optimizer.state_dict())
        out["other_plan"] = "no error"
    except ValueError as err:
        out["other_plan"] = str(err)
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="tritonrec-fused-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    out: dict[str, Any] = {case_name(*c): dcp_round_trip(rank, world, box[0], *c) for c in CASES}  # type: ignore
    out["direct"] = direct_loads(rank, world)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    return out
