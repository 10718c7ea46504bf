"""Rank-side cases for the quantized EBC sharded over 2 gloo ranks (``ShardedQuantEmbeddingBagCollectionPG``): every
plan (table-wise, row-wise, uneven row-wise, column-wise with even and uneven blocks, a mix) times every data-type
set (all INT8, all INT4, INT8 / FP16 / INT4 and INT2 / FP16 / INT8 mixed), unweighted and weighted, each rank's
pooled output against the unsharded QuantEBC's on that rank's batch (uneven batches 3 and 5, empty bags, a 1-row
table, a feature two tables read, SUM and MEAN tables); an fp16 ``output_dtype``; DMP's default sharders and
planner; the state-dict round trip."""

from __future__ import annotations

from typing import Any

import torch

# name, rows, dim, features, pooling; t1 has fewer rows than ranks, f1 is read by t0 and t3
TABLES = [
    ("t0", 12, 8, ["f0", "f1"], "SUM"),
    ("t1", 1, 4, ["f2"], "MEAN"),
    ("t2", 9, 8, ["f3"], "MEAN"),
    ("t3", 20, 8, ["f1"], "SUM"),
]
FEATURES = ["f0", "f1", "f2", "f3"]
BATCH = [3, 5]  # per rank: uneven


def data_types() -> dict[str, dict[str, Any]]:
    from tritonrec.modules import DataType

    return {
        "int8": {t: DataType.INT8 for t, *_ in TABLES},
        "int4": {t: DataType.INT4 for t, *_ in TABLES},
        # a data type on non-adjacent tables: each rank's lookup must still run one contiguous block per data type
        "mixed": {"t0": DataType.INT8, "t1": DataType.FP16, "t2": DataType.INT4, "t3": DataType.INT8},
        "mixed_int2": {"t0": DataType.INT2, "t1": DataType.FP16, "t2": DataType.INT8, "t3": DataType.INT2},
    }


def plans() -> dict[str, dict[str, Any]]:
    from tritonrec.dist import column_wise, row_wise, table_wise

    return {
        "table_wise": {t: table_wise(rank=(i + 1) % 2) for i, (t, *_) in enumerate(TABLES)},
        "row_wise": {t: row_wise() for t, *_ in TABLES},
        "row_wise_uneven": {  # sizes_placement: 9+3, rank 1 only, 2+7, rank 0 only
            "t0": row_wise(([9, 3], "cpu")),
            "t1": row_wise(([0, 1], "cpu")),
            "t2": row_wise(([2, 7], "cpu")),
            "t3": row_wise(([20, 0], "cpu")),
        },
        "column_wise": {  # even and uneven blocks (INT2: starts on a multiple of 4), on one rank or both
            "t0": column_wise(ranks=[0, 1]),
            "t1": column_wise(ranks=[1, 1]),
            "t2": column_wise(size_per_rank=[2, 6], ranks=[1, 0]),
            "t3": column_wise(size_per_rank=[4, 4], ranks=[0, 1]),
        },
        "mixed": {
            "t0": row_wise(),
            "t1": table_wise(rank=1),
            "t2": column_wise(ranks=[1, 0]),
            "t3": table_wise(rank=0),
        },
    }


EXACT_PLANS = ("table_wise", "column_wise")  # bit-exact; row-wise sums partial bags across ranks


def quant_ebc(types: dict[str, Any], seed: int, weighted: bool = False, output_dtype: torch.dtype = torch.float32):
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f, pooling=PoolingType[p])
        for t, n, d, f, p in TABLES
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted, backend="torch")
    return QuantEmbeddingBagCollection.from_float(ebc, types, output_dtype=output_dtype, backend="torch")


def rank_batch(rank: int, step: int = 0, weighted: bool = False):
    """Rank ``rank``'s KJT of ``BATCH[rank]`` samples (lengths 0..3; ids below every reading table's rows)."""
    from tritonrec.data import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * step + rank)
    rows = {"f0": 12, "f1": 12, "f2": 1, "f3": 9}
    lengths = torch.randint(0, 4, (len(FEATURES), BATCH[rank]), generator=g)
    values = torch.cat(
        [torch.randint(0, rows[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(FEATURES)]
    )
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(FEATURES, values, weights, lengths=lengths.reshape(-1))


def shard(module, plan: dict[str, Any]):
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan
    from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    sharder = QuantEmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(module, plan, sharder, 2, 2, "cpu")
    return sharder.shard(module, module_plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))


def compare(got, expected) -> dict[str, Any]:
    """Keys, dtype, bit-exactness and the largest difference of two pooled KeyedTensors."""
    same_shape = got.values().shape == expected.values().shape
    return {
        "keys": list(got.keys()),
        "expected_keys": list(expected.keys()),
        "dtype": str(got.values().dtype),
        "equal": same_shape and torch.equal(got.values(), expected.values()),
        "max_diff": float((got.values().float() - expected.values().float()).abs().max()) if same_shape else -1.0,
    }


def forward_cases(rank: int) -> dict[str, Any]:
    from tritonrec.dist.quant_embeddingbag_pg import ShardedQuantEmbeddingBagCollectionPG

    out = {}
    for plan_name, plan in plans().items():
        for types_name, types in data_types().items():
            for weighted in (False, True):
                module = quant_ebc(types, seed=1, weighted=weighted)
                sharded = shard(module, plan)
                assert isinstance(sharded, ShardedQuantEmbeddingBagCollectionPG), type(sharded)
                kjt = rank_batch(rank, weighted=weighted)
                suffix = "-weighted" if weighted else ""
                out[f"{plan_name}-{types_name}{suffix}"] = compare(sharded(kjt).wait(), module(kjt))
    module = quant_ebc(data_types()["mixed"], seed=1, output_dtype=torch.float16)
    kjt = rank_batch(rank, step=1)
    out["mixed-fp16"] = compare(shard(module, plans()["mixed"])(kjt).wait(), module(kjt))
    return out


def dmp_case(rank: int) -> dict[str, Any]:
    """DMP with its default sharders and planner over a model holding a QuantEBC."""
    import torch.distributed as dist

    from tritonrec.dist import DistributedModelParallel, ShardingEnv
    from tritonrec.dist.quant_embeddingbag_pg import ShardedQuantEmbeddingBagCollectionPG

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qebc = quant_ebc(data_types()["mixed"], seed=4)

        def forward(self, kjt):
            return self.qebc(kjt)

    reference = quant_ebc(data_types()["mixed"], seed=4)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(Model(), env=env, device=torch.device("cpu"))
    kjt = rank_batch(rank, step=2)
    got = dmp(kjt)
    got = got.wait() if hasattr(got, "wait") else got
    return {
        "sharded": isinstance(dmp.module.qebc, ShardedQuantEmbeddingBagCollectionPG),
        "kernels": sorted({p.compute_kernel for p in dmp.plan.plan["qebc"].values()}),
        **compare(got, reference(kjt)),
    }


def _close(got, expected) -> bool:
    return list(got.keys()) == list(expected.keys()) and torch.allclose(got.values(), expected.values(), atol=1e-5)


def state_cases(rank: int) -> dict[str, Any]:
    """Per plan (mixed data types): keys as the unsharded module's; unsharded -> sharded (outputs as the source's);
    sharded -> gathered full tensors (the source's bytes) -> a fresh unsharded module; sharded -> sharded."""
    from tests.sharding.quant_ec_cases import _full_tensors

    out = {}
    types = data_types()["mixed"]
    for plan_name, plan in plans().items():
        sharded = shard(quant_ebc(types, seed=1), plan)
        second = quant_ebc(types, seed=2)
        kjt = rank_batch(rank, step=3)
        expected_state, expected = second.state_dict(), second(kjt)
        result: dict[str, Any] = {"keys": sorted(sharded.state_dict()) == sorted(expected_state)}
        result["differs_before"] = not _close(sharded(kjt).wait(), expected)
        sharded.load_state_dict(expected_state)
        result["from_unsharded"] = _close(sharded(kjt).wait(), expected)
        full = _full_tensors(sharded.state_dict())
        result["bytes_back"] = all(torch.equal(full[k], v.reshape(full[k].shape)) for k, v in expected_state.items())
        third = quant_ebc(types, seed=3)
        third.load_state_dict(full)
        result["unsharded_back"] = torch.equal(third(kjt).values(), expected.values())
        other = shard(quant_ebc(types, seed=3), plan)
        other.load_state_dict(sharded.state_dict())
        result["same_plan"] = _close(other(kjt).wait(), expected)
        out[plan_name] = result
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    return {"forward": forward_cases(rank), "state": state_cases(rank), "dmp": dmp_case(rank)}
