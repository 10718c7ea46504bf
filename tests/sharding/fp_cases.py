"""Rank-side cases for the sharded feature-processed EBC: position weights (random, so they matter) on a mixed plan
(row-wise, table-wise, data-parallel and column-wise tables), against the unsharded module on the global batch:
forward, table gradients and position-weight gradients (summed over ranks), for both processor forms."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.sharding.ebc_cases import BATCH_PER_RANK, FEATURES, global_batch, kjt_slice, make_tables, max_diff
from tests.sharding.ebc_cases import plans_by_type as _plans

MAX_LENGTH = 4  # global_batch draws bags of 0..4 values


def _modules(collection: bool, pooling: str):  # type: ignore[no-untyped-def]
    from tritonrec.modules import (
        EmbeddingBagCollection,
        FeatureProcessedEmbeddingBagCollection,
        PositionWeightedModule,
        PositionWeightedModuleCollection,
    )

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(make_tables(pooling), is_weighted=True, backend="torch")
    if collection:  # f2 has no processor: weight 1
        processors: Any = PositionWeightedModuleCollection({f: MAX_LENGTH for f in FEATURES if f != "f2"})
        weights = list(processors.position_weights.values())
    else:
        processors = {f: PositionWeightedModule(MAX_LENGTH) for f in FEATURES}
        weights = [m.position_weight for m in processors.values()]
    with torch.no_grad():
        for w in weights:
            w.copy_(torch.rand(w.shape) + 0.5)
    return FeatureProcessedEmbeddingBagCollection(ebc, processors)


def _position_grads(module: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if "position" in n and p.grad is not None}


def shard_fp_dense(reference: Any, generators: dict[str, Any], world: int) -> Any:
    """A copy of the FP-EBC ``reference`` sharded over the world by ``generators`` (dense kernel, torch lookups)."""
    import torch.distributed as dist

    from tritonrec.dist import (
        FeatureProcessedEmbeddingBagCollectionSharder,
        ShardingEnv,
        construct_module_sharding_plan,
    )

    source = copy.deepcopy(reference)
    plan = construct_module_sharding_plan(source, generators, None, world, world, "cpu")
    for sharding in plan.values():
        sharding.compute_kernel = "dense"
    sharded = FeatureProcessedEmbeddingBagCollectionSharder().shard(
        source, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu")
    )
    for sharding in sharded._embedding_bag_collection.shardings:
        sharding.lookup.backend = "torch"
    return sharded


def fp_case(rank: int, world: int, collection: bool, pooling: str) -> dict[str, float]:
    reference = _modules(collection, pooling)
    sharded = shard_fp_dense(reference, {t: gen(world) for t, gen in _plans()["mixed"].items()}, world)
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    lengths, values, _ = global_batch(0, total, False)
    out = sharded(kjt_slice(lengths, values, [], lo, lo + batch[rank])).wait().values()
    full = reference(kjt_slice(lengths, values, [], 0, total)).values()
    grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(9))
    (out * grad[lo : lo + batch[rank]]).sum().backward()
    (full * grad).sum().backward()
    result = {"forward": max_diff(out, full[lo : lo + batch[rank]]), "table_grad": 0.0, "position_grad": 0.0}
    for table, module in sharded._embedding_bag_collection.embedding_bags.items():
        for k, (shard, _) in enumerate(module.local):
            spec = shard.spec
            param = getattr(module, "weight" if k == 0 else f"weight_{k}")
            ref = reference._embedding_bag_collection.embedding_bags[table].weight.grad
            block = ref[spec.row_offset : spec.row_offset + spec.rows, spec.col_offset : spec.col_offset + spec.cols]
            result["table_grad"] = max(result["table_grad"], max_diff(param.grad, block))
    mine, theirs = _position_grads(sharded), _position_grads(reference)
    if set(mine) != set(theirs) or not mine:
        result["position_grad"] = float("inf")
    for name, expected in theirs.items():
        result["position_grad"] = max(result["position_grad"], max_diff(mine.get(name, expected * 0), expected))
    return result


FP_CASES = [("collection", True, "SUM"), ("per_feature", False, "MEAN")]


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist import set_gradient_division

    set_gradient_division(False)
    try:
        return {name: fp_case(rank, world, collection, pooling) for name, collection, pooling in FP_CASES}
    finally:
        set_gradient_division(True)
