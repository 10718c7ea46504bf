"""ShardedQuantEmbeddingCollectionLocal (``ShardingEnv.from_local``: one process, ``world_size`` shards on the CPU):
table-wise, row-wise (even and uneven ``sizes_placement``), column-wise and mixed plans on 2 and 3 devices, INT8 /
INT4 / FP16 / mixed INT8-FP16-INT4-INT2 tables: each feature's JaggedTensor equals the unsharded QuantEC's bit for bit
(and the dequantized tables indexed by the ids, an independent reference); ``need_indices`` and ``output_dtype``;
tables of one sharding type with different dims; the state dict (keys, unsharded -> sharded -> unsharded, sharded ->
sharded); refused plans and arguments, by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensorBase

from tests.sharding.quant_ec_cases import TABLES, compare, data_types, quant_ec
from tests.sharding.quant_ec_cases import plans as two_device_plans
from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import ShardingEnv, column_wise, construct_module_sharding_plan, row_wise, table_wise
from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder
from tritonrec.dist.quant_embedding_local import ShardedQuantEmbeddingCollectionLocal
from tritonrec.modules import DataType

FEATURES = ["f0", "f1", "f2", "f3"]
ROWS = {"f0": 12, "f1": 12, "f2": 1, "f3": 9}  # ids below every reading table's rows


def _three_device_plans() -> dict[str, dict[str, Any]]:
    return {
        "table_wise": {t: table_wise(rank=(i + 2) % 3) for i, (t, *_) in enumerate(TABLES)},
        "row_wise": {t: row_wise() for t, *_ in TABLES},  # t1 (1 row): two empty blocks
        "row_wise_uneven": {
            "t0": row_wise(([5, 0, 7], "cpu")),
            "t1": row_wise(([0, 0, 1], "cpu")),
            "t2": row_wise(([2, 3, 4], "cpu")),
            "t3": row_wise(([20, 0, 0], "cpu")),
        },
        "column_wise": {
            "t0": column_wise(ranks=[0, 2]),
            "t1": column_wise(ranks=[2, 1]),
            "t2": column_wise(ranks=[1, 1]),
            "t3": column_wise(ranks=[2, 0]),
        },
        "mixed": {"t0": row_wise(), "t1": table_wise(rank=2), "t2": column_wise(ranks=[2, 0]), "t3": table_wise(1)},
    }


def _plans(world: int) -> dict[str, dict[str, Any]]:
    return two_device_plans() if world == 2 else _three_device_plans()


def _data_types() -> dict[str, dict[str, Any]]:
    return {**data_types(), "fp16": {t: DataType.FP16 for t, *_ in TABLES}}


def _batch(batch: int, seed: int, max_len: int = 4) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (len(FEATURES), batch), generator=g)
    values = torch.cat(
        [torch.randint(0, ROWS[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(FEATURES)]
    )
    return KeyedJaggedTensor(FEATURES, values, lengths=lengths.reshape(-1))


def _shard(module, plan: dict[str, Any], world: int):
    sharder = QuantEmbeddingCollectionSharder()
    module_plan = construct_module_sharding_plan(module, plan, sharder, world, world, "cpu")
    return sharder.shard(module, module_plan, ShardingEnv.from_local(world, 0), torch.device("cpu"))


def _assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected), f"keys {list(got)} != {list(expected)}"
    for k, jt in expected.items():
        assert got[k].values().dtype == jt.values().dtype, k
        assert torch.equal(got[k].values(), jt.values()), f"{k}: rows differ (must be bit-exact)"
        assert torch.equal(got[k].lengths(), jt.lengths()), f"{k}: lengths differ"
        w, ew = got[k].weights_or_none(), jt.weights_or_none()
        assert (w is None and ew is None) or (w is not None and ew is not None and torch.equal(w, ew)), k


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("plan", ["table_wise", "row_wise", "row_wise_uneven", "column_wise", "mixed"])
@pytest.mark.parametrize("types", ["int8", "int4", "fp16", "mixed"])
def test_matches_unsharded_bit_for_bit(world: int, plan: str, types: str) -> None:
    module = quant_ec(_data_types()[types], seed=1)
    sharded = _shard(module, _plans(world)[plan], world)
    assert isinstance(sharded, ShardedQuantEmbeddingCollectionLocal)
    for batch, seed in ((5, 0), (1, 1), (3, 2)):
        kjt = _batch(batch, seed)
        got, expected = sharded(kjt).wait(), module(kjt)
        _assert_same(got, expected)
        assert compare(got, expected, module, kjt)["reference_equal"], "rows differ from the dequantized tables"


@pytest.mark.parametrize("world", [2, 3])
def test_empty_batch(world: int) -> None:
    module = quant_ec(_data_types()["mixed"], seed=1)
    sharded = _shard(module, _plans(world)["mixed"], world)
    kjt = _batch(4, 0, max_len=1)  # every bag empty
    _assert_same(sharded(kjt).wait(), module(kjt))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("plan", ["row_wise_uneven", "column_wise", "mixed"])
def test_need_indices_and_output_dtype(world: int, output_dtype: torch.dtype, plan: str) -> None:
    module = quant_ec(_data_types()["mixed"], seed=4, need_indices=True, output_dtype=output_dtype)
    sharded = _shard(module, _plans(world)[plan], world)
    assert sharded.need_indices() and sharded.output_dtype() == output_dtype
    kjt = _batch(6, 7)
    got = sharded(kjt).wait()
    assert all(jt.weights_or_none() is not None for jt in got.values())
    _assert_same(got, module(kjt))


def test_tables_of_one_sharding_type_may_have_different_dims() -> None:
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection

    torch.manual_seed(0)
    specs = [("t0", 12, 8, ["f0", "f1"]), ("t1", 1, 4, ["f2"]), ("t2", 9, 12, ["f3"]), ("t3", 20, 16, ["f1"])]
    configs = [EmbeddingConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f) for t, n, d, f in specs]
    types = {"t0": DataType.INT8, "t1": DataType.FP16, "t2": DataType.INT4, "t3": DataType.INT8}
    module = QuantEmbeddingCollection.from_float(EmbeddingCollection(configs, backend="torch"), types, backend="torch")
    for plan in (
        {"t0": row_wise(), "t1": row_wise(), "t2": row_wise(), "t3": row_wise()},
        {"t0": table_wise(rank=0), "t1": table_wise(rank=1), "t2": table_wise(rank=1), "t3": table_wise(rank=0)},
        {"t0": column_wise(ranks=[0, 1]), "t1": column_wise(ranks=[1, 0]), "t2": column_wise(ranks=[1, 0]),
         "t3": column_wise(ranks=[0, 1, 1, 0])},
    ):  # fmt: skip
        sharded = _shard(module, plan, 2)
        kjt = _batch(5, 3)
        _assert_same(sharded(kjt).wait(), module(kjt))


def _full(state: dict) -> dict[str, torch.Tensor]:
    """A sharded state dict's entries as full tensors (one process holds every shard; a list: its first block)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensorBase):
            meta = value.metadata()
            full = torch.zeros(list(meta.size), dtype=meta.tensor_properties.dtype)
            for shard in value.local_shards():
                (r, c), t = shard.metadata.shard_offsets, shard.tensor
                full[r : r + t.shape[0], c : c + t.shape[1]] = t
            out[key] = full
        elif isinstance(value, list):
            out[key] = value[0].clone()
        else:
            out[key] = value.clone()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("plan", ["table_wise", "row_wise", "row_wise_uneven", "column_wise", "mixed"])
def test_state_dict_keys_and_round_trip(world: int, plan: str) -> None:
    types = _data_types()["mixed"]
    first, second = quant_ec(types, seed=1), quant_ec(types, seed=2)
    sharded = _shard(first, _plans(world)[plan], world)
    expected_state, kjt = second.state_dict(), _batch(5, 9)
    expected = second(kjt)
    assert list(sharded.state_dict()) == list(first.state_dict())
    assert not all(torch.equal(sharded(kjt).wait()[k].values(), expected[k].values()) for k in expected)
    sharded.load_state_dict(expected_state)  # unsharded -> sharded
    _assert_same(sharded(kjt).wait(), expected)
    full = _full(sharded.state_dict())
    for key, value in expected_state.items():
        assert torch.equal(full[key], value.reshape(full[key].shape)), f"{key}: the shards are not the source's bytes"
    third = quant_ec(types, seed=3)
    third.load_state_dict(full)  # sharded -> unsharded
    _assert_same(third(kjt), expected)
    other = _shard(quant_ec(types, seed=3), _plans(world)[plan], world)
    other.load_state_dict(sharded.state_dict())  # sharded -> sharded, same plan
    _assert_same(other(kjt).wait(), expected)


def test_state_dict_entries_are_live_views() -> None:
    module = quant_ec(_data_types()["int8"], seed=1)
    sharded = _shard(module, _plans(2)["table_wise"], 2)
    kjt = _batch(4, 2)
    before = sharded(kjt).wait()
    with torch.no_grad():
        sharded.state_dict()["embeddings.t0.weight"].zero_()
    after = sharded(kjt).wait()
    assert not torch.equal(before["f0"].values(), after["f0"].values())


# ------------------------------------------------------------------------------------------------------ refusals
def test_misaligned_int2_column_block_is_refused() -> None:
    module = quant_ec(data_types()["mixed"], seed=1)  # t3 is INT2
    plan = {t: table_wise(rank=0) for t, *_ in TABLES}
    plan["t3"] = column_wise(ranks=[0, 1, 0, 1])  # blocks of 2 columns
    with pytest.raises(ValueError, match=r"table 't3': an INT2 column block must start on a multiple of 4 columns"):
        _shard(module, plan, 2)


@pytest.mark.parametrize("kind", ["data_parallel", "table_row_wise", "table_column_wise", "grid_shard"])
def test_unsupported_sharding_types_are_refused_by_name(kind: str) -> None:
    from tritonrec.dist import ParameterSharding

    module = quant_ec(data_types()["int8"], seed=1)
    sharder = QuantEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(module, _plans(2)["table_wise"], sharder, 2, 2, "cpu")
    plan["t2"] = ParameterSharding(kind, "quant", ranks=[0])
    with pytest.raises(ValueError, match=rf"table 't2': sharding type {kind} is not supported for quantized sequence"):
        sharder.shard(module, plan, ShardingEnv.from_local(2, 0))


def test_bad_arguments_are_refused() -> None:
    from tritonrec.dist import ParameterSharding

    module = quant_ec(data_types()["int8"], seed=1)
    sharder = QuantEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(module, _plans(2)["table_wise"], sharder, 2, 2, "cpu")
    env = ShardingEnv.from_local(2, 0)
    with pytest.raises(TypeError, match=r"module must be a QuantEmbeddingCollection, got Linear"):
        ShardedQuantEmbeddingCollectionLocal(torch.nn.Linear(1, 1), plan, env)  # type: ignore[arg-type]
    pg_env = ShardingEnv.from_local(2, 0)
    pg_env.process_group = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"pass env=ShardingEnv.from_local\(world_size, 0\)"):
        ShardedQuantEmbeddingCollectionLocal(module, plan, pg_env)
    bad = dict(plan)
    bad["t1"] = ParameterSharding("table_wise", "dense", ranks=[0], sharding_spec=plan["t1"].sharding_spec)
    with pytest.raises(ValueError, match=r"table 't1': compute_kernel must be 'quant' for a quantized table, got"):
        ShardedQuantEmbeddingCollectionLocal(module, bad, env)
    sharded = sharder.shard(module, plan, env)
    with pytest.raises(TypeError, match=r"features must be a KeyedJaggedTensor"):
        sharded(torch.zeros(3))
    with pytest.raises(ValueError, match=r"features is missing keys \['f3'\]"):
        empty = torch.zeros(0, dtype=torch.int64)
        sharded(KeyedJaggedTensor(["f0", "f1", "f2"], empty, lengths=torch.zeros(3, dtype=torch.int64)))
