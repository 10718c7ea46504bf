"""Rank-side cases for ShardedQuantEmbeddingCollection on 2 gloo ranks: every plan (table-wise, row-wise, uneven
row-wise, column-wise, a mix) times every data-type set (all INT8, all INT4, INT8 / FP16 / INT4 / INT2 mixed), each
rank's output against the unsharded QuantEC's on that rank's batch (uneven batches 3 and 5, empty bags, a 1-row
table, a feature two tables read) and against the dequantized tables indexed by the ids (an independent reference);
``need_indices`` with an fp16 output; DMP with its default sharders; the state-dict round trip; refused plans."""

from __future__ import annotations

from typing import Any

import torch

# name, rows, dim, features; t1 has fewer rows than ranks, f1 is read by t0 and t3 ("f1@t0", "f1@t3")
TABLES = [("t0", 12, 8, ["f0", "f1"]), ("t1", 1, 8, ["f2"]), ("t2", 9, 8, ["f3"]), ("t3", 20, 8, ["f1"])]
FEATURES = ["f0", "f1", "f2", "f3"]
BATCH = [3, 5]  # per rank: uneven


def data_types() -> dict[str, dict[str, Any]]:
    from tritonrec.modules import DataType

    return {
        "int8": {t: DataType.INT8 for t, *_ in TABLES},
        "int4": {t: DataType.INT4 for t, *_ in TABLES},
        "mixed": {"t0": DataType.INT8, "t1": DataType.FP16, "t2": DataType.INT4, "t3": DataType.INT2},
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
        "column_wise": {  # blocks of 4 columns (INT2: a multiple of 4), on one rank or both, in either order
            "t0": column_wise(ranks=[0, 1]),
            "t1": column_wise(ranks=[1, 1]),
            "t2": column_wise(ranks=[1, 0]),
            "t3": column_wise(ranks=[0, 1]),
        },
        "mixed": {
            "t0": row_wise(),
            "t1": table_wise(rank=1),
            "t2": column_wise(ranks=[1, 0]),
            "t3": table_wise(rank=0),
        },
    }


def quant_ec(types: dict[str, Any], seed: int, need_indices: bool = False, output_dtype: torch.dtype = torch.float32):
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection

    torch.manual_seed(seed)
    configs = [EmbeddingConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f) for t, n, d, f in TABLES]
    ec = EmbeddingCollection(configs, need_indices=need_indices, backend="torch")
    return QuantEmbeddingCollection.from_float(ec, types, output_dtype=output_dtype, backend="torch")


def rank_batch(rank: int, step: int = 0):
    """Rank ``rank``'s KJT of ``BATCH[rank]`` samples (lengths 0..3; ids below every reading table's rows)."""
    from tritonrec.data import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * step + rank)
    rows = {"f0": 12, "f1": 12, "f2": 1, "f3": 9}
    lengths = torch.randint(0, 4, (len(FEATURES), BATCH[rank]), generator=g)
    values = torch.cat(
        [torch.randint(0, rows[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(FEATURES)]
    )
    return KeyedJaggedTensor(FEATURES, values, lengths=lengths.reshape(-1))


def shard(module, plan: dict[str, Any], rank: int):
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan
    from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder

    sharder = QuantEmbeddingCollectionSharder()
    module_plan = construct_module_sharding_plan(module, plan, sharder, 2, 2, "cpu")
    return sharder.shard(module, module_plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))


def compare(got: dict, expected: dict, module, kjt) -> dict[str, Any]:
    """Bit-exact comparison with the unsharded output and with the dequantized tables indexed by the ids."""
    tables = module.dequantized_weights()
    per_feature = kjt.to_dict()
    reference_equal = True
    for table, *_ in TABLES:
        for name, feature in zip(*_names_and_features(table), strict=True):
            rows = tables[table][per_feature[feature].values()].to(module.output_dtype())
            reference_equal &= torch.equal(got[name].values(), rows)
    return {
        "keys": list(got),
        "expected_keys": list(expected),
        "values_equal": all(torch.equal(got[k].values(), expected[k].values()) for k in expected),
        "lengths_equal": all(torch.equal(got[k].lengths(), expected[k].lengths()) for k in expected),
        "weights_equal": all(_same_weights(got[k], expected[k]) for k in expected),
        "dtype": str(next(iter(got.values())).values().dtype),
        "reference_equal": bool(reference_equal),
    }


def _names_and_features(table: str) -> tuple[list[str], list[str]]:
    shared = {f for t, *_, fs in TABLES for f in fs if sum(f in other for *_, other in TABLES) > 1}
    features = next(fs for t, *_, fs in TABLES if t == table)
    return [f"{f}@{table}" if f in shared else f for f in features], features


def _same_weights(a, b) -> bool:
    wa, wb = a.weights_or_none(), b.weights_or_none()
    return (wa is None and wb is None) or (wa is not None and wb is not None and torch.equal(wa, wb))


def forward_cases(rank: int) -> dict[str, Any]:
    out = {}
    for plan_name, plan in plans().items():
        for types_name, types in data_types().items():
            module = quant_ec(types, seed=1)
            sharded = shard(module, plan, rank)
            kjt = rank_batch(rank)
            out[f"{plan_name}-{types_name}"] = compare(sharded(kjt).wait(), module(kjt), module, kjt)
    module = quant_ec(data_types()["mixed"], seed=1, need_indices=True, output_dtype=torch.float16)
    sharded = shard(module, plans()["mixed"], rank)
    kjt = rank_batch(rank, step=1)
    out["need_indices-fp16"] = compare(sharded(kjt).wait(), module(kjt), module, kjt)
    return out


def dmp_case(rank: int) -> dict[str, Any]:
    """DMP with its default sharders and planner over a model holding a QuantEC."""
    import torch.distributed as dist

    from tritonrec.dist import DistributedModelParallel, ShardingEnv
    from tritonrec.dist.quant_embedding import ShardedQuantEmbeddingCollection

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qec = quant_ec(data_types()["mixed"], seed=4)

        def forward(self, kjt):
            return self.qec(kjt)

    model = Model()
    reference = quant_ec(data_types()["mixed"], seed=4)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu")
    )
    kjt = rank_batch(rank, step=2)
    got = dmp(kjt)
    got = got.wait() if hasattr(got, "wait") else got
    return {
        "sharded": isinstance(dmp.module.qec, ShardedQuantEmbeddingCollection),
        "kernels": sorted({p.compute_kernel for p in dmp.plan.plan["qec"].values()}),
        **compare(got, reference(kjt), reference, kjt),
    }


def _full_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every rank's local shards of a sharded state dict gathered into full tensors (a list entry: its first
    block, every column block holding the same scale / bias)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensorBase

    local = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensorBase):
            meta = value.metadata()
            local[key] = ("sharded", list(meta.size), meta.tensor_properties.dtype,
                          [(s.metadata.shard_offsets, s.tensor.clone()) for s in value.local_shards()])  # fmt: skip
        else:
            local[key] = ("list", [t.clone() for t in value])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out = {}
    for key in state:
        parts = [g[key] for g in gathered]
        if parts[0][0] == "list":
            out[key] = next(t for p in parts for t in p[1])
            continue
        full = torch.zeros(parts[0][1], dtype=parts[0][2])
        for _, _, _, shards in parts:
            for (r, c), tensor in shards:
                full[r : r + tensor.shape[0], c : c + tensor.shape[1]] = tensor
        out[key] = full
    return out


def _equal_outputs(got: dict, expected: dict) -> bool:
    return list(got) != [] and all(torch.equal(got[k].values(), expected[k].values()) for k in expected)


def _gathered_equal(sharded, expected_state: dict, rank: int) -> bool | str:
    """``gather_unsharded_state_dict`` on rank 0 holds the unsharded module's bytes (column-wise scale / bias: each
    rank's list of its blocks' copies)."""
    from tritonrec.dist.checkpoint import gather_unsharded_state_dict

    try:
        gathered = gather_unsharded_state_dict(sharded)
    except Exception as error:  # reported: the other cases' results still arrive
        return f"{type(error).__name__}: {error}"
    if rank != 0:
        return gathered is None
    return sorted(gathered) == sorted(expected_state) and all(
        torch.equal(gathered[k].reshape(v.shape), v) for k, v in expected_state.items()
    )


def state_cases(rank: int) -> dict[str, Any]:
    """Per plan (mixed data types): keys as the unsharded module's; unsharded -> sharded (outputs as the source's);
    sharded -> gathered full tensors (the source's bytes) -> a fresh unsharded module; sharded -> sharded."""
    out = {}
    types = data_types()["mixed"]
    for plan_name, plan in plans().items():
        first, second = quant_ec(types, seed=1), quant_ec(types, seed=2)
        sharded = shard(first, plan, rank)
        kjt = rank_batch(rank, step=3)
        expected_state, expected = second.state_dict(), second(kjt)
        result: dict[str, Any] = {"keys": sorted(sharded.state_dict()) == sorted(expected_state)}
        result["differs_before"] = not _equal_outputs(sharded(kjt).wait(), expected)
        sharded.load_state_dict(expected_state)
        result["from_unsharded"] = _equal_outputs(sharded(kjt).wait(), expected)
        full = _full_tensors(sharded.state_dict())
        result["bytes_back"] = all(torch.equal(full[k], v.reshape(full[k].shape)) for k, v in expected_state.items())
        third = quant_ec(types, seed=3)
        third.load_state_dict(full)
        result["unsharded_back"] = _equal_outputs(third(kjt), expected)
        other = shard(quant_ec(types, seed=3), plan, rank)
        other.load_state_dict(sharded.state_dict())
        result["same_plan"] = _equal_outputs(other(kjt).wait(), expected)
        result["gathered"] = _gathered_equal(sharded, expected_state, rank)
        out[plan_name] = result
    return out


def refusal_cases(rank: int) -> dict[str, str]:
    """Plans that need the process group to be refused (the others are refused before it: test_quant_ec_plans)."""
    from tritonrec.dist import column_wise, row_wise, table_wise
    from tritonrec.modules import DataType

    out = {}
    int2 = {t: DataType.INT2 for t, *_ in TABLES}
    odd = {"t0": column_wise(ranks=[0, 1, 0, 1]), "t1": table_wise(rank=0), "t2": row_wise(), "t3": row_wise()}
    for name, types, plan in (("int2_odd_block", int2, odd),):
        try:
            shard(quant_ec(types, seed=1), plan, rank)
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    return out


def subgroup_case(rank: int) -> dict[str, Any]:
    """Rank 1 alone shards a QuantEC over the sub-group [1] (group rank 0, global rank 1): its state dict (the
    placements must name the global rank) and a round trip through a second sharded module."""
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder

    group = dist.new_group([1])  # every rank creates it; only rank 1 is a member
    if rank != 1:
        return {}
    types, sharder = data_types()["mixed"], QuantEmbeddingCollectionSharder()
    plan = {"t0": row_wise(), "t1": table_wise(rank=0), "t2": table_wise(rank=0), "t3": row_wise()}
    out: dict[str, Any] = {}
    try:
        modules = []
        for seed in (1, 2):
            module = quant_ec(types, seed=seed)
            module_plan = construct_module_sharding_plan(module, plan, sharder, 1, 1, "cpu")
            modules.append(sharder.shard(module, module_plan, ShardingEnv.from_process_group(group), "cpu"))
        first, second = modules
        kjt = rank_batch(0, step=4)
        second.load_state_dict(first.state_dict())
        out["round_trip"] = _equal_outputs(second(kjt).wait(), quant_ec(types, seed=1)(kjt))
    except Exception as error:  # reported, so the other rank's result still arrives
        out["error"] = f"{type(error).__name__}: {error}"
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    return {
        "subgroup": subgroup_case(rank),
        "forward": forward_cases(rank),
        "state": state_cases(rank),
        "refusals": refusal_cases(rank),
        "dmp": dmp_case(rank),
    }
