"""Rank-side cases around the sharded EBC: bad plans and inputs (each a clear error naming the culprit), sharding a
module built on the meta device, gradient division (the default) scaling every sharding's gradient alike, and the
Adagrad rules' initial_accumulator_value reaching every sharding's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.sharding.ebc_cases import (
    BATCH_PER_RANK,
    FEATURES,
    TABLES,
    Case,
    build_pair,
    global_batch,
    kjt_slice,
    make_tables,
    max_diff,
    plans_by_type,
    run_ebc_case,
    shard_slices,
)


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _sharder_and_plan(generators: dict, fused: dict | None = None):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingEnv, construct_module_sharding_plan
    from tritonrec.modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(make_tables("SUM"), device="meta")
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    world = dist.get_world_size()
    plan = construct_module_sharding_plan(ebc, generators, None, world, world, "cpu")
    return ebc, sharder, plan, ShardingEnv.from_process_group(dist.group.WORLD)


def error_cases(rank: int, world: int) -> dict[str, str]:
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist import ShardingEnv, data_parallel, row_wise, table_row_wise, table_wise
    from tritonrec.dist.embeddingbag import ShardedEmbeddingBagCollection
    from tritonrec.modules import EmbeddingBagCollection

    tw = {t: table_wise(rank=0) for t, *_ in TABLES}
    out: dict[str, str] = {}
    ebc, sharder, plan, env = _sharder_and_plan(tw)
    out["fused_without_optimizer"] = _error(lambda: sharder.shard(ebc, plan, env))
    missing = dict(plan)
    missing.pop("t2")
    sharded_ebc = lambda plan, fused: lambda: ShardedEmbeddingBagCollection(ebc, plan, env, fused)
    out["plan_missing_table"] = _error(sharded_ebc(missing, {"optimizer": "ADAM"}))
    out["unknown_fused_param"] = _error(sharded_ebc(plan, {"optimizer": "ADAM", "lrr": 1}))
    out["bad_hyperparameter"] = _error(sharded_ebc(plan, {"optimizer": "ADAM", "lr": -1}))
    out["no_process_group"] = _error(
        lambda: ShardedEmbeddingBagCollection(ebc, plan, ShardingEnv.from_local(world, rank), {"optimizer": "ADAM"})
    )
    out["not_an_ebc"] = _error(lambda: ShardedEmbeddingBagCollection(torch.nn.Linear(2, 2), plan, env))  # type: ignore[arg-type]
    sharded = ShardedEmbeddingBagCollection(ebc, plan, env, {"optimizer": "EXACT_SGD"})
    values, lengths = torch.tensor([0, 1]), torch.tensor([1, 1, 0, 0, 0])
    out["missing_key"] = _error(lambda: sharded(KeyedJaggedTensor(FEATURES[:-1], values, lengths=lengths[:4])))
    good_lengths = torch.tensor([1, 1, 0, 0, 0])
    out["index_out_of_range"] = _error(
        lambda: sharded(KeyedJaggedTensor(FEATURES, torch.tensor([0, 12]), lengths=good_lengths))
    )
    out["not_a_kjt"] = _error(lambda: sharded(torch.zeros(3)))  # type: ignore[arg-type]
    vbe = KeyedJaggedTensor(
        FEATURES, torch.tensor([0]), lengths=torch.tensor([1, 0, 0, 0, 0, 0]), stride_per_key_per_rank=[[2]] + [[1]] * 4
    )
    out["vbe_without_inverse"] = _error(lambda: sharded(vbe))
    weighted_ebc = EmbeddingBagCollection(make_tables("SUM"), is_weighted=True, device="meta")
    weighted = ShardedEmbeddingBagCollection(weighted_ebc, plan, env, {"optimizer": "EXACT_SGD"})
    unweighted = KeyedJaggedTensor(FEATURES, values, lengths=good_lengths)
    out["weighted_without_weights"] = _error(lambda: weighted(unweighted))
    twrw = {t: table_row_wise(host_index=0) for t, *_ in TABLES}
    _, _, twrw_plan, _ = _sharder_and_plan(twrw)
    twrw_sharded = ShardedEmbeddingBagCollection(ebc, twrw_plan, env, {"optimizer": "EXACT_SGD"})
    inverse = (FEATURES, torch.zeros(len(FEATURES), 2, dtype=torch.int64))
    vbe_inverse = KeyedJaggedTensor(
        FEATURES,
        torch.tensor([0]),
        lengths=torch.tensor([1, 0, 0, 0, 0, 0]),
        stride_per_key_per_rank=[[2]] + [[1]] * 4,
        inverse_indices=inverse,
    )
    out["vbe_on_twrw"] = _error(lambda: twrw_sharded(vbe_inverse))
    rw = {t: row_wise() for t, *_ in TABLES}
    out["default_sharder"] = type(_sharder_and_plan(rw)[1]).__name__
    # every table data-parallel (no input all-to-all): a batch rank 0 rejects must raise on rank 1 too
    dp = {t: data_parallel(compute_kernel="fused") for t, *_ in TABLES}
    _, _, dp_plan, _ = _sharder_and_plan(dp)
    dp_sharded = ShardedEmbeddingBagCollection(ebc, dp_plan, env, {"optimizer": "EXACT_SGD"})
    good = KeyedJaggedTensor(FEATURES, values, lengths=good_lengths)
    bad = KeyedJaggedTensor(FEATURES[:-1], values, lengths=lengths[:4])
    out["data_parallel_rejection"] = _error(lambda: dp_sharded(bad if rank == 0 else good))
    return out


def meta_case(rank: int, world: int) -> dict[str, Any]:
    """An EBC built on meta shards without touching its weights; each local shard is its config's ``init_fn``."""
    from tritonrec.dist import row_wise, table_wise

    ebc, sharder, plan, env = _sharder_and_plan(
        {"t0": row_wise(), "t1": table_wise(rank=world - 1), "t2": row_wise(), "t3": table_wise(rank=0)},
        {"optimizer": "EXACT_SGD"},
    )
    for config in ebc.embedding_bag_configs():
        config.init_fn = lambda t, name=config.name: torch.nn.init.constant_(t, float(name[1:]) + 0.5)
    sharded = sharder.shard(ebc, plan, env, torch.device("cpu"))
    out: dict[str, Any] = {"devices": sorted({p.device.type for p in sharded.parameters()})}
    out["init"] = all(
        bool((param == float(table[1:]) + 0.5).all()) for table, _, _, param in shard_slices(sharded) if param.numel()
    )
    lengths, values, weights = global_batch(0, sum(BATCH_PER_RANK[world]), False)
    lo = sum(BATCH_PER_RANK[world][:rank])
    kjt = kjt_slice(lengths, values, weights, lo, lo + BATCH_PER_RANK[world][rank])
    out["forward_shape"] = list(sharded(kjt).wait().values().shape)
    out["names"] = sorted(name for name, _ in sharded.named_parameters())
    return out


def division_case(rank: int, world: int) -> dict[str, float]:
    """With gradient division on (the default), every sharding's gradient is the unsharded one divided by W."""
    from tritonrec.dist import get_gradient_division

    assert get_gradient_division()
    case = Case("division", plans_by_type()["mixed"], "MEAN", False)
    reference, sharded = build_pair(case, rank, world)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    lengths, values, weights = global_batch(0, total, False)
    out = sharded(kjt_slice(lengths, values, weights, lo, lo + batch[rank])).wait()
    full = reference(kjt_slice(lengths, values, weights, 0, total))
    grad_out = torch.randn(full.values().shape, generator=torch.Generator().manual_seed(3))
    (out.values() * grad_out[lo : lo + batch[rank]]).sum().backward()
    (full.values() * grad_out).sum().backward()
    diff = 0.0
    for table, _, spec, param in shard_slices(sharded):
        ref = reference.embedding_bags[table].weight.grad
        block = ref[spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols]
        diff = max(diff, max_diff(param.grad * world, block))
    return {"grad_times_world": diff}


def options_case(rank: int, world: int) -> dict[str, Any]:
    """fused_params reach the lookups: weights_precision (fp16 shards) and, for a FusedEmbeddingBagCollection sharded
    without fused_params, the module's own optimizer and hyperparameters."""
    import torch.distributed as dist

    from tritonrec.dist import EmbeddingBagCollectionSharder, ShardingEnv, construct_module_sharding_plan
    from tritonrec.modules import DataType, EmbeddingBagCollection, FusedEmbeddingBagCollection

    plans = {t: gen(world) for t, gen in plans_by_type()["mixed"].items()}
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(make_tables("SUM"), backend="torch")
    fused = {"optimizer": "EXACT_SGD", "lr": 0.1, "weights_precision": DataType.FP16}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    plan = construct_module_sharding_plan(ebc, plans, sharder, world, world, "cpu")
    half = sharder.shard(ebc, plan, env, torch.device("cpu"))
    batch = BATCH_PER_RANK[world]
    lengths, values, weights = global_batch(0, sum(batch), False)
    lo = sum(batch[:rank])
    kjt = kjt_slice(lengths, values, weights, lo, lo + batch[rank])
    full = ebc(kjt_slice(lengths, values, weights, 0, sum(batch))).values()[lo : lo + batch[rank]]
    out: dict[str, Any] = {"dtypes": sorted({str(p.dtype) for p in half.parameters()})}
    out["fp16_forward"] = max_diff(half(kjt).wait().values(), full)
    module = FusedEmbeddingBagCollection(make_tables("SUM"), "ADAM", {"lr": 0.003, "betas": (0.8, 0.9)}, device="meta")
    plan = construct_module_sharding_plan(module, plans, EmbeddingBagCollectionSharder(), world, world, "cpu")
    from_module = EmbeddingBagCollectionSharder().shard(module, plan, env, torch.device("cpu"))
    group = from_module.fused_optimizer.param_groups[0]
    out["module_optimizer"] = [type(from_module.fused_optimizer).__name__, group["lr"], list(group["betas"])]
    out["module_state_keys"] = sorted(next(iter(from_module.fused_optimizer.state.values())))
    return out


def initial_accumulator_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Both Adagrad rules started at ``initial_accumulator_value`` (through ``fused_params``) on every sharding type
    (row-wise, table-wise, data-parallel, column-wise), 3 steps against the unsharded module started alike."""
    extra = {"optimizer_kwargs": {"initial_accumulator_value": 0.5}}
    plans = plans_by_type()["mixed"]
    cases = [
        Case(rule, plans, "SUM", False, rule, 3, extra=extra) for rule in ("EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD")
    ]
    return {case.name: run_ebc_case(case, rank, world) for case in cases}


def run_suite(rank: int, world: int) -> dict[str, Any]:
    return {
        "errors": error_cases(rank, world),
        "meta": meta_case(rank, world),
        "division": division_case(rank, world),
        "options": options_case(rank, world),
        "initial_accumulator": initial_accumulator_cases(rank, world),
    }
