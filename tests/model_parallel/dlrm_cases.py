"""Rank-side cases: a DLRM under DistributedModelParallel against the same DLRM trained in one process on the global
batch.

Every rank builds the same model (same seed), keeps a deep copy as the single-process reference and wraps the other
in DMP with a plan (explicit TW / RW / CW / TWRW / DP, or the planner's). Each of 10 steps draws one global batch;
rank ``r`` trains on its equal slice, the reference on all of it. The embedding tables update inside the backward
(fused rowwise Adagrad), the dense layers with SGD + momentum (DDP-averaged on the DMP side). Equal slices make the
mean of the ranks' losses the global loss and DDP's average the global gradient.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor

# name, rows: a table with fewer rows than ranks, and one a rank's row block leaves empty at 4 ranks
TABLES = [("t0", 40), ("t1", 7), ("t2", 1), ("t3", 25)]
# the "shared-" kinds: f_t1 (ids < 7) is also read by t0 and t3, so the DLRM interacts 6 embeddings of 4 features
SHARED_FEATURES = {"t0": ["f_t0", "f_t1"], "t1": ["f_t1"], "t2": ["f_t2"], "t3": ["f_t3", "f_t1"]}
DIM, DENSE_IN, BATCH_PER_RANK, STEPS = 8, 5, 4, 10
SPARSE_LR, DENSE_LR = 0.1, 0.05
SHARDED_PATH = "sparse_arch.embedding_bag_collection"


def build_dlrm(device: str | torch.device = "cpu", seed: int = 3, shared: bool = False) -> nn.Module:
    """The test DLRM (fused rowwise Adagrad tables; ``device="meta"`` builds nothing; ``shared``: tables read
    :data:`SHARED_FEATURES`)."""
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM

    torch.manual_seed(seed)
    features = {n: SHARED_FEATURES[n] if shared else [f"f_{n}"] for n, _ in TABLES}
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=DIM, name=n, feature_names=features[n])
              for n, rows in TABLES]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(
        tables, "EXACT_ROWWISE_ADAGRAD", {"lr": SPARSE_LR}, device=device, backend="torch", stochastic_rounding=False
    )
    return DLRM(ebc, DENSE_IN, [16, DIM], [16, 1], dense_device=device)


def global_batch(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dense [total, DENSE_IN]``, ``lengths [F, total]`` (0..3: empty bags too), ``values``, ``labels [total]``."""
    g = torch.Generator().manual_seed(500 + step)
    dense = torch.randn(total, DENSE_IN, generator=g)
    lengths = torch.randint(0, 4, (len(TABLES), total), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(lengths[i].sum()),), generator=g)
                        for i, (_, rows) in enumerate(TABLES)])  # fmt: skip
    labels = torch.randint(0, 2, (total,), generator=g).float()
    return dense, lengths, values, labels


def batch_slice(batch: tuple, lo: int, hi: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Samples ``[lo, hi)``: ``(dense, kjt, labels)``."""
    dense, lengths, values, labels = batch
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
    total = lengths.shape[1]
    parts = [values[starts[i * total + lo] : starts[i * total + hi]] for i in range(len(TABLES))]
    kjt = KeyedJaggedTensor([f"f_{n}" for n, _ in TABLES], torch.cat(parts), lengths=lengths[:, lo:hi].reshape(-1))
    return dense[lo:hi], kjt, labels[lo:hi]


def loss_of(model: nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(dense, kjt).squeeze(-1)
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def dense_optimizer(named: Any) -> Any:
    from tritonrec.optim import KeyedOptimizerWrapper, in_backward_optimizer_filter

    params = dict(in_backward_optimizer_filter(named))
    return KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=DENSE_LR, momentum=0.9))


# --------------------------------------------------------------------------------------------------------- plans
def _hosts(world: int) -> int:
    return world // int(os.environ.get("LOCAL_WORLD_SIZE", world))


def table_generators(kind: str, world: int) -> dict[str, Any]:
    """Table -> plan generator for one sharding type."""
    from tritonrec.dist import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    gens: dict[str, Callable[[int], Any]] = {
        "tw": lambda i: table_wise(rank=i % world),
        "rw": lambda i: row_wise(),
        "cw": lambda i: column_wise(ranks=list(range(world))),
        "twrw": lambda i: table_row_wise(host_index=i % _hosts(world)),
        "dp": lambda i: data_parallel(compute_kernel="fused"),
    }
    if kind == "mixed":  # one table per sharding type
        mixed = [row_wise(), table_wise(rank=world - 1), gens["dp"](2), column_wise(ranks=list(range(world)))]
        return {name: mixed[i] for i, (name, _) in enumerate(TABLES)}
    return {name: gens[kind](i) for i, (name, _) in enumerate(TABLES)}


def explicit_plan(model: nn.Module, kind: str, world: int) -> Any:
    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingPlan, construct_module_sharding_plan

    ebc = model.get_submodule(SHARDED_PATH)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    module_plan = construct_module_sharding_plan(
        ebc, table_generators(kind, world), EmbeddingBagCollectionSharder(), local, world, "cpu"
    )
    return ShardingPlan({SHARDED_PATH: module_plan})


def wrap(model: nn.Module, kind: str, world: int, **kwargs: Any) -> Any:
    """``DistributedModelParallel`` of ``model`` with plan ``kind`` (``"planner"``: no plan given)."""
    from tritonrec.dist.model_parallel import DistributedModelParallel

    plan = None if kind == "planner" else explicit_plan(model, kind, world)
    dmp = DistributedModelParallel(model, plan=plan, **kwargs)
    for sharding in dmp.module.get_submodule(SHARDED_PATH).shardings:
        sharding.lookup.backend = "torch"
    return dmp


# ------------------------------------------------------------------------------------------------------ compare
def local_shards(dmp: Any, rank: int) -> list[tuple[str, nn.Parameter, tuple[int, int, int, int]]]:
    """``(table, local parameter, (row offset, rows, col offset, cols))`` of every shard this rank holds, read off the
    plan (a rank's k-th shard of a table is its parameter ``weight`` / ``weight_k``)."""
    ebc = dmp.module.get_submodule(SHARDED_PATH)
    out = []
    for table, sharding in dmp.plan.get_plan_for_module(SHARDED_PATH).items():
        if sharding.sharding_type == "data_parallel":
            rows = dict(TABLES)[table]
            out.append((table, ebc.embedding_bags[table].weight, (0, rows, 0, DIM)))
            continue
        mine = [s for s in sharding.shards if s.placement.rank() == rank]
        for k, shard in enumerate(mine):
            param = getattr(ebc.embedding_bags[table], "weight" if k == 0 else f"weight_{k}")
            (r0, c0), (nr, nc) = shard.shard_offsets, shard.shard_sizes
            out.append((table, param, (r0, nr, c0, nc)))
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b| / (1 + |b|)`` (absolute near zero, relative for large values)."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (1 + b.abs())).max())


def compare_with_reference(dmp: Any, reference: nn.Module, dmp_dense: Any, ref_dense: Any, rank: int) -> dict:
    """Max differences of dense weights, table shards, fused state and dense optimizer state."""
    ref_params = dict(reference.named_parameters())
    ref_fused = reference.get_submodule(SHARDED_PATH).fused_optimizer
    out = {"dense": 0.0, "tables": 0.0, "fused_state": 0.0, "dense_state": 0.0}
    sharded_names = {id(p) for _, p, _ in local_shards(dmp, rank)}
    for name, param in dmp.named_parameters():
        if id(param) not in sharded_names:
            out["dense"] = max(out["dense"], max_diff(param, ref_params[name]))
    for table, param, (r0, nr, c0, nc) in local_shards(dmp, rank):
        ref_weight = ref_params[f"{SHARDED_PATH}.embedding_bags.{table}.weight"]
        out["tables"] = max(out["tables"], max_diff(param, ref_weight[r0 : r0 + nr, c0 : c0 + nc]))
        mine, theirs = dmp.fused_optimizer.state[param], ref_fused.state[ref_weight]
        out["fused_state"] = max(out["fused_state"], max_diff(mine["momentum1"], theirs["momentum1"][r0 : r0 + nr]))
        if int(mine["step"]) != int(theirs["step"]):
            out["fused_state"] = float("inf")
    ref_dense_state = ref_dense.state_dict()["state"]
    for name, state in dmp_dense.state_dict()["state"].items():
        out["dense_state"] = max(
            out["dense_state"], max_diff(state["momentum_buffer"], ref_dense_state[name]["momentum_buffer"])
        )
    return out


def train_against_reference(
    dmp: Any,
    reference: nn.Module,
    dmp_dense: Any,
    ref_dense: Any,
    rank: int,
    world: int,
    steps: int = STEPS,
    loss_fn: Callable[..., torch.Tensor] = loss_of,
) -> float:
    """``steps`` steps: rank ``rank`` trains ``dmp`` on its equal slice of each global batch, ``reference`` (one
    process) on all of it, each stepping its dense optimizer; the largest difference between the ranks' mean loss
    and the reference's."""
    import torch.distributed as dist

    total, lo = BATCH_PER_RANK * world, BATCH_PER_RANK * rank
    loss_diff = 0.0
    for step in range(steps):
        batch = global_batch(step, total)
        for optimizer in (dmp_dense, ref_dense):
            optimizer.zero_grad()
        loss = loss_fn(dmp, *batch_slice(batch, lo, lo + BATCH_PER_RANK))
        loss.backward()
        dmp_dense.step()
        ref_loss = loss_fn(reference, *batch_slice(batch, 0, total))
        ref_loss.backward()
        ref_dense.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        loss_diff = max(loss_diff, abs(float(global_loss) / world - float(ref_loss.detach())))
    return loss_diff


def run_training_case(kind: str, rank: int, world: int) -> dict[str, Any]:
    """10 steps of DMP (plan ``kind``; ``shared-<plan>``: with shared features) vs the single-process model on the
    global batch."""

    model = build_dlrm(shared=kind.startswith("shared-"))
    reference = copy.deepcopy(model)
    dmp = wrap(model, kind.removeprefix("shared-"), world)
    dmp_dense, ref_dense = dense_optimizer(dmp.named_parameters()), dense_optimizer(reference.named_parameters())
    loss_diff = train_against_reference(dmp, reference, dmp_dense, ref_dense, rank, world)
    result = compare_with_reference(dmp, reference, dmp_dense, ref_dense, rank)
    result["loss"] = loss_diff
    result["plan"] = str(dmp.plan)
    result["types"] = sorted({p.sharding_type for p in dmp.plan.get_plan_for_module(SHARDED_PATH).values()})
    result["sparse_names"] = dmp.module.sparse_arch.sparse_feature_names
    if kind.startswith("shared-"):  # the checkpoint view: per-table keys, the trained tables gathered whole
        from tritonrec.dist.sharded_state import gather_unsharded_state_dict

        gathered = gather_unsharded_state_dict(dmp)
        if gathered is not None:
            expected = reference.state_dict()
            result["state_dict_keys"] = sorted(gathered) == sorted(expected)
            result["state_dict"] = max(max_diff(gathered[k], v) for k, v in expected.items() if k in gathered)
    return result


KINDS_BY_WORLD = {
    2: ("tw", "rw", "cw", "twrw", "dp", "planner", "shared-mixed", "shared-planner"),
    4: ("rw", "cw", "twrw", "planner"),
}


def run_suite(rank: int, world: int) -> dict[str, Any]:
    return {kind: run_training_case(kind, rank, world) for kind in KINDS_BY_WORLD[world]}
