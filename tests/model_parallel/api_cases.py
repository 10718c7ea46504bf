"""Rank-side cases for DistributedModelParallel's API (2 ranks): names, wrappers, the fused optimizer, state dicts,
copies, sparse-gradient names, building on ``meta``, bad input; and the peak-memory suite (run first in its spawn).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from tests.model_parallel.default_plan_cases import default_plan_kernels
from tests.model_parallel.dlrm_cases import (
    BATCH_PER_RANK,
    SHARDED_PATH,
    batch_slice,
    build_dlrm,
    dense_optimizer,
    explicit_plan,
    global_batch,
    local_shards,
    loss_of,
    wrap,
)


def _train_step(dmp: Any, optimizer: Any, step: int, rank: int, world: int) -> float:
    lo = BATCH_PER_RANK * rank
    optimizer.zero_grad()
    loss = loss_of(dmp, *batch_slice(global_batch(step, BATCH_PER_RANK * world), lo, lo + BATCH_PER_RANK))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # the test checks type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def _gathered(value: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return out


def names_and_wrappers(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from tritonrec.dist.model_parallel import get_module, get_unwrapped_module

    model = build_dlrm()
    reference_names = dict(model.named_parameters())
    reference_keys = sorted(model.state_dict())
    dmp = wrap(model, "tw", world)
    out: dict[str, Any] = {
        "param_names": sorted(n for n, _ in dmp.named_parameters()),
        "buffer_names": sorted(n for n, _ in dmp.named_buffers()),
        "state_dict_keys": sorted(dmp.state_dict()),
        "reference_names": sorted(reference_names),
        "reference_keys": reference_keys,
        "get_module_is_ddp": isinstance(get_module(dmp), DistributedDataParallel)
        and dmp.get_module() is get_module(dmp),
        "unwrapped_is_model": get_unwrapped_module(dmp) is model and dmp.module is model,
        "set_module_after_ddp": _raises(lambda: setattr(dmp, "module", model)),
        "fused_keys": sorted(dmp.fused_optimizer.params),
        "local_tables": sorted(t for t, _, _ in local_shards(dmp, rank)),
        "plan": str(dmp.plan),
    }
    lazy = wrap(build_dlrm(), "rw", world, init_data_parallel=False)
    out["lazy_not_ddp"] = not isinstance(lazy.get_module(), DistributedDataParallel)
    lazy.init_data_parallel()
    lazy.init_data_parallel()  # a second call is a no-op
    out["lazy_then_ddp"] = isinstance(lazy.get_module(), DistributedDataParallel)
    return out


def fused_lr_reaches_tables(rank: int, world: int) -> dict[str, Any]:
    """An lr of 0 written into the DMP's fused optimizer's param_groups freezes every local shard."""
    dmp = wrap(build_dlrm(), "rw", world)
    optimizer = dense_optimizer(dmp.named_parameters())
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for _, p, _ in local_shards(dmp, rank)]
    _train_step(dmp, optimizer, 0, rank, world)
    frozen = all(torch.equal(b, p) for b, (_, p, _) in zip(before, local_shards(dmp, rank), strict=True))
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.1
    _train_step(dmp, optimizer, 1, rank, world)
    moved = any(not torch.equal(b, p) for b, (_, p, _) in zip(before, local_shards(dmp, rank), strict=True))
    return {"frozen_at_lr0": frozen, "moves_at_lr01": moved, "groups": len(dmp.fused_optimizer.param_groups)}


def state_dict_round_trip(rank: int, world: int) -> dict[str, Any]:
    """Save the unsharded state dict (gathered on rank 0, sent to every rank), train, load it back: each rank keeps
    its slice of the full tensors."""
    import torch.distributed as dist

    from tritonrec.dist.sharded_state import gather_unsharded_state_dict

    dmp = wrap(build_dlrm(), "cw", world)
    optimizer = dense_optimizer(dmp.named_parameters())
    box = [gather_unsharded_state_dict(dmp)]
    dist.broadcast_object_list(box, src=0)
    saved = box[0]
    _train_step(dmp, optimizer, 0, rank, world)
    trained = gather_unsharded_state_dict(dmp)
    result = dmp.load_state_dict(saved)
    restored = gather_unsharded_state_dict(dmp)
    bad_key = dict(saved, **{"over_arch.extra": torch.zeros(1)})
    out = {
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "unexpected_strict": _raises(lambda: dmp.load_state_dict(bad_key)),
        "not_a_mapping": _raises(lambda: dmp.load_state_dict([1, 2])),
    }
    if rank == 0:
        out["changed_by_training"] = any(not torch.equal(saved[k], v) for k, v in trained.items())
        out["restored"] = sorted(restored) == sorted(saved) and all(
            torch.equal(saved[k], v) for k, v in restored.items()
        )
    return out


def copies(rank: int, world: int) -> dict[str, Any]:
    dmp = wrap(build_dlrm(), "tw", world)
    twin = dmp.copy(torch.device("cpu"))
    lo = BATCH_PER_RANK * rank
    batch = batch_slice(global_batch(0, BATCH_PER_RANK * world), lo, lo + BATCH_PER_RANK)
    with torch.no_grad():
        same_output = torch.equal(dmp(batch[0], batch[1]), twin(batch[0], batch[1]))
    own = {id(p) for p in dmp.parameters()}
    shares_nothing = not any(id(p) in own for p in twin.parameters())
    fused_on_twin = {id(p) for p in twin.fused_optimizer.params.values()} <= {id(p) for p in twin.parameters()}
    before = [p.detach().clone() for p in dmp.parameters()]
    _train_step(twin, dense_optimizer(twin.named_parameters()), 0, rank, world)
    original_untouched = all(torch.equal(b, p) for b, p in zip(before, dmp.parameters(), strict=True))
    twin_trained = any(not torch.equal(b, p) for b, p in zip(before, twin.parameters(), strict=True))
    return {
        "same_output": same_output,
        "shares_nothing": shares_nothing,
        "fused_on_twin": fused_on_twin,
        "original_untouched": original_untouched,
        "twin_trained": twin_trained,
        "twin_is_ddp": type(twin.get_module()).__name__,
        "bad_device": _raises(lambda: dmp.copy("meta")),
    }


class _WithSparseBag(nn.Module):
    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.bag = nn.EmbeddingBag(5, 2, sparse=True)
        self.dense_bag = nn.EmbeddingBag(5, 2)


def sparse_names_and_meta(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import ShardingPlan
    from tritonrec.dist.model_parallel import DistributedModelParallel

    model = _WithSparseBag(build_dlrm())
    plan = explicit_plan(model.dlrm, "tw", world)
    plan = ShardingPlan({f"dlrm.{SHARDED_PATH}": plan.plan[SHARDED_PATH]})
    holder = DistributedModelParallel(model, plan=plan, init_data_parallel=False)
    out: dict[str, Any] = {"sparse_names": holder.sparse_grad_parameter_names()}
    # built on meta: dense parameters are materialised (DDP broadcasts rank 0's); replicated tables are broadcast
    meta = wrap(build_dlrm("meta", seed=rank), "dp", world)
    dense = torch.cat([p.detach().reshape(-1) for n, p in meta.named_parameters() if "embedding_bags" not in n])
    tables = torch.cat([p.detach().reshape(-1) for _, p, _ in local_shards(meta, rank)])
    out["meta_dense_equal"] = all(torch.equal(g, dense) for g in _gathered(dense))
    out["meta_tables_equal"] = all(torch.equal(g, tables) for g in _gathered(tables))
    out["meta_on_cpu"] = all(p.device.type == "cpu" for p in meta.parameters())
    out["meta_loss"] = _train_step(meta, dense_optimizer(meta.named_parameters()), 0, rank, world)
    return out


def bad_input(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import ShardingPlan
    from tritonrec.dist.model_parallel import DistributedModelParallel

    model = build_dlrm()
    module_plan = explicit_plan(model, "tw", world).plan[SHARDED_PATH]
    return {
        "missing_path": _raises(
            lambda: DistributedModelParallel(build_dlrm(), plan=ShardingPlan({"sparse_arch.nope": module_plan}))
        ),
        "no_sharder": _raises(
            lambda: DistributedModelParallel(build_dlrm(), plan=ShardingPlan({"dense_arch": module_plan}))
        ),
        "bad_plan": _raises(lambda: DistributedModelParallel(build_dlrm(), plan={"a": 1})),  # type: ignore[arg-type]
        "bad_sharders": _raises(lambda: DistributedModelParallel(build_dlrm(), sharders=[object()])),  # type: ignore[list-item]
        "meta_device": _raises(lambda: DistributedModelParallel(build_dlrm(), device=torch.device("meta"))),
        "bad_env": _raises(lambda: DistributedModelParallel(build_dlrm(), env="world")),  # type: ignore[arg-type]
    }


def comm_precision(rank: int, world: int) -> dict[str, Any]:
    """Dense gradients all-reduced in fp16 / bf16 (DDP comm hooks) are close to, but not, the fp32 ones."""
    from tritonrec.dist import DefaultDataParallelWrapper

    grads: dict[Any, dict[str, torch.Tensor]] = {}
    lo = BATCH_PER_RANK * rank
    batch = batch_slice(global_batch(0, BATCH_PER_RANK * world), lo, lo + BATCH_PER_RANK)
    for precision in (None, "fp16", "bf16"):
        wrapper = DefaultDataParallelWrapper(allreduce_comm_precision=precision)
        dmp = wrap(build_dlrm(), "tw", world, data_parallel_wrapper=wrapper)
        loss_of(dmp, *batch).backward()
        grads[precision] = {n: p.grad.clone() for n, p in dmp.named_parameters() if p.grad is not None}
    out = {}
    for precision in ("fp16", "bf16"):
        diffs = [float(((g - grads[None][n]).abs() / (1e-3 + grads[None][n].abs())).max())
                 for n, g in grads[precision].items()]  # fmt: skip
        out[precision] = {"names": sorted(grads[precision]) == sorted(grads[None]), "max_rel": max(diffs)}
    return out


def released_after_training(rank: int, world: int) -> dict[str, Any]:
    """A trained DMP, once dropped, frees its tables: no autograd graph of a step stays alive (a comm op whose
    autograd node held its own output kept every step's graph, and the tables it read, in an uncollectable cycle)."""
    import weakref

    out = {}
    for kind in ("tw", "rw", "dp"):
        dmp = wrap(build_dlrm(), kind, world)
        optimizer = dense_optimizer(dmp.named_parameters())
        for step in range(2):
            _train_step(dmp, optimizer, step, rank, world)
        sharded = dmp.module.get_submodule(SHARDED_PATH)
        buffers = [weakref.ref(g.table_group.weights) for s in sharded.shardings for g in s.lookup.groups]
        del dmp, optimizer, sharded
        gc.collect()
        out[kind] = {"buffers": len(buffers), "alive": sum(ref() is not None for ref in buffers)}
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    cases = {
        "released": released_after_training,
        "comm_precision": comm_precision,
        "names": names_and_wrappers,
        "fused_lr": fused_lr_reaches_tables,
        "state_dict": state_dict_round_trip,
        "copy": copies,
        "sparse_meta": sparse_names_and_meta,
        "bad_input": bad_input,
        "default_plan": default_plan_kernels,
    }
    return {name: case(rank, world) for name, case in cases.items()}


# ------------------------------------------------------------------------------------------------------- memory
MEMORY_ROWS, MEMORY_DIM, MEMORY_TABLES = 250_000, 32, 4  # 32 MB per table, 128 MB in all


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_growth_bytes(build: Any) -> tuple[int, Any]:
    """Peak RSS growth while ``build()`` runs (the peak is reset first through /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    result = build()
    return (_status_kib("VmHWM") - before) * 1024, result


def _memory_model(device: str) -> nn.Module:
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM

    tables = [EmbeddingBagConfig(num_embeddings=MEMORY_ROWS, embedding_dim=MEMORY_DIM, name=f"t{i}",
                                 feature_names=[f"f{i}"]) for i in range(MEMORY_TABLES)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, device=device, backend="torch")
    return DLRM(ebc, 4, [16, MEMORY_DIM], [16, 1], dense_device=device)


def run_memory_suite(rank: int, world: int) -> dict[str, Any]:
    """Peak RSS growth of a rank building a row-wise DMP from a ``meta`` model, then of an unsharded build. A small
    DMP is built first: torch and DDP initialise lazily (tens of MB, once per process), which is not the model's."""
    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingPlan, construct_module_sharding_plan, row_wise
    from tritonrec.dist.model_parallel import DistributedModelParallel

    def build_dmp() -> Any:
        model = _memory_model("meta")
        ebc = model.get_submodule(SHARDED_PATH)
        gens = {f"t{i}": row_wise() for i in range(MEMORY_TABLES)}
        module_plan = construct_module_sharding_plan(ebc, gens, EmbeddingBagCollectionSharder(), world, world, "cpu")
        return DistributedModelParallel(model, plan=ShardingPlan({SHARDED_PATH: module_plan}))

    wrap(build_dlrm("meta"), "rw", world)  # the warm-up (discarded)
    dmp_growth, dmp = _peak_growth_bytes(build_dmp)
    local_bytes = sum(p.numel() * p.element_size() for p in dmp.parameters())
    del dmp
    unsharded_growth, model = _peak_growth_bytes(lambda: _memory_model("cpu"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {
        "dmp_peak_growth": dmp_growth,
        "unsharded_peak_growth": unsharded_growth,
        "local_param_bytes": local_bytes,
        "model_param_bytes": model_bytes,
    }
