"""ShardedQuantEmbeddingBagCollection over the "devices" of one process (all CPU here, as torchrec's inference
sharding on one host): table-wise and column-wise outputs are bit-identical to the unsharded QuantEBC (shards keep
the unsharded codes, scales and biases), row-wise (even and uneven row blocks) equal up to the order of partial sums
(mean: global lengths), for INT8 and INT4 (the latter weighted), 2 and 3 devices, and for INT2 / FP16 / FP32 tables
mixed with INT8 / INT4 ones in one collection on 2 devices; unsupported plans raise clear errors."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import ShardingEnv, column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_wise
from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

TABLES = [("t0", 12, 8, ["f0", "f1"], "SUM"), ("t1", 1, 4, ["f2"], "MEAN"), ("t2", 9, 6, ["f3"], "MEAN")]
FEATURES = ["f0", "f1", "f2", "f3"]


def _quant_ebc(data_type: DataType, weighted: bool) -> QuantEmbeddingBagCollection:
    torch.manual_seed(5)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f, pooling=PoolingType[p])
        for t, n, d, f, p in TABLES
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted, backend="torch")
    return QuantEmbeddingBagCollection.from_float(ebc, data_type, backend="torch")


def _batch(weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(2)
    rows = {"f0": 12, "f1": 12, "f2": 1, "f3": 9}
    lengths = torch.randint(0, 4, (len(FEATURES), 6), generator=g)
    values = torch.cat(
        [torch.randint(0, rows[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(FEATURES)]
    )
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(FEATURES, values, weights, lengths=lengths.reshape(-1))


def _plan(kind: str, world: int) -> dict:
    if kind == "table_wise":
        return {t: table_wise(rank=i % world) for i, (t, *_) in enumerate(TABLES)}
    if kind == "row_wise":
        return {t: row_wise() for t, *_ in TABLES}
    if kind == "row_wise_uneven":  # sizes_placement on 3 devices: devices without rows of t0, t1, t2
        sizes = {"t0": [0, 8, 4], "t1": [0, 0, 1], "t2": [9, 0, 0]}
        return {t: row_wise((sizes[t], "cpu")) for t, *_ in TABLES}
    if kind == "column_wise":  # t2: 6 columns in three blocks on repeated devices
        return {"t0": column_wise(ranks=[world - 1, 0]), "t1": table_wise(rank=0), "t2": column_wise(ranks=[0, 1, 0])}
    return {"t0": row_wise(), "t1": table_wise(rank=world - 1), "t2": column_wise(ranks=[1, 0, 1])}


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4])
@pytest.mark.parametrize(
    ("kind", "world"), [("table_wise", 2), ("row_wise", 3), ("row_wise_uneven", 3), ("column_wise", 2), ("mixed", 3)]
)
def test_sharded_quant_ebc_matches_unsharded(kind: str, world: int, data_type: DataType) -> None:
    weighted = data_type == DataType.INT4
    qebc = _quant_ebc(data_type, weighted)
    sharder = QuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(qebc, _plan(kind, world), sharder, world, world, "cpu")
    assert {p.compute_kernel for p in plan.values()} == {"quant"}
    sharded = sharder.shard(qebc, plan, ShardingEnv.from_local(world, 0), torch.device("cpu"))
    kjt = _batch(weighted)
    expected = qebc(kjt)
    got = sharded(kjt).wait()
    assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()
    if kind in ("table_wise", "column_wise"):
        assert torch.equal(got.values(), expected.values())
    else:
        torch.testing.assert_close(got.values(), expected.values(), rtol=1e-6, atol=1e-6)


def test_shard_without_a_device_uses_the_module_s() -> None:
    """``device=None`` read ``module.device``, which a QuantEmbeddingBagCollection does not have (AttributeError)."""
    qebc = _quant_ebc(DataType.INT8, False)
    sharder = QuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(qebc, _plan("table_wise", 2), sharder, 2, 2, "cpu")
    sharded = sharder.shard(qebc, plan, ShardingEnv.from_local(2, 0))
    kjt = _batch(False)
    assert torch.equal(sharded(kjt).wait().values(), qebc(kjt).values())


def test_unsupported_quant_plans_raise() -> None:
    qebc = _quant_ebc(DataType.INT4, False)
    sharder = QuantEmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match=r"table 't0': QuantEmbeddingBagCollectionSharder does not support data_par"):
        construct_module_sharding_plan(qebc, {t: data_parallel() for t, *_ in TABLES}, sharder, 2, 2, "cpu")
    odd = {"t0": column_wise(ranks=[0, 1, 0, 1]), "t1": table_wise(rank=0), "t2": column_wise(ranks=[0, 1])}
    plan = construct_module_sharding_plan(qebc, odd, sharder, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"table 't2': an INT4 column block must start on a multiple of 2 columns"):
        sharder.shard(qebc, plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))
    good = construct_module_sharding_plan(qebc, _plan("table_wise", 2), sharder, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"pass env=ShardingEnv.from_local"):
        sharder.shard(qebc, good, object(), torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_sharded_quant_ebc_with_a_shared_feature(kind: str) -> None:
    """f1 read by all three tables (INT8): every device gets f1's ids for each of its tables; keys are torchrec's."""
    torch.manual_seed(5)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f, pooling=PoolingType[p])
        for t, n, d, f, p in [
            ("t0", 12, 8, ["f0", "f1"], "SUM"),
            ("t1", 5, 4, ["f1", "f2"], "MEAN"),
            ("t2", 9, 6, ["f3", "f1"], "MEAN"),
        ]
    ]
    qebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(configs, backend="torch"), DataType.INT8)
    sharder = QuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(qebc, _plan(kind, 2), sharder, 2, 2, "cpu")
    sharded = sharder.shard(qebc, plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (len(FEATURES), 5), generator=g)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g)  # below every table's rows
    kjt = KeyedJaggedTensor(FEATURES, values, lengths=lengths.reshape(-1))
    expected = qebc(kjt)
    got = sharded(kjt).wait()
    assert got.keys() == expected.keys() == ["f0", "f1@t0", "f1@t1", "f2", "f3", "f1@t2"]
    assert got.length_per_key() == expected.length_per_key()
    torch.testing.assert_close(got.values(), expected.values(), rtol=1e-6, atol=1e-6)


# name, rows, dim, data type, pooling: every data type, INT2 twice (dims 8 and 3: one group), odd dims, a 1-row table
MIXED = [
    ("m0", 10, 8, DataType.INT2, "SUM"),
    ("m1", 7, 5, DataType.FP16, "MEAN"),
    ("m2", 9, 6, DataType.FP32, "SUM"),
    ("m3", 6, 4, DataType.INT4, "MEAN"),
    ("m4", 1, 3, DataType.INT2, "SUM"),
    ("m5", 5, 2, DataType.INT8, "SUM"),
]
MIXED_PLANS = {  # 2 devices; INT2 column blocks start on a multiple of 4 columns
    "table_wise": {t: table_wise(rank=i % 2) for i, (t, *_) in enumerate(MIXED)},
    "row_wise": {t: row_wise() for t, *_ in MIXED},
    "column_wise": {"m0": column_wise(ranks=[1, 0]), "m1": column_wise(ranks=[0, 1, 0, 1, 1]),
                    "m2": column_wise(ranks=[1, 0, 1]), "m3": column_wise(ranks=[0, 1]), "m4": table_wise(rank=1),
                    "m5": column_wise(ranks=[1, 0])},
    "mixed": {"m0": row_wise(), "m1": table_wise(rank=1), "m2": column_wise(ranks=[1, 0]), "m3": row_wise(),
              "m4": table_wise(rank=0), "m5": column_wise(ranks=[0, 1])},
}  # fmt: skip


def _mixed_quant_ebc() -> QuantEmbeddingBagCollection:
    torch.manual_seed(7)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=[f"f{t}"], pooling=PoolingType[p])
        for t, n, d, _, p in MIXED
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=True, backend="torch")
    return QuantEmbeddingBagCollection.from_float(ebc, {t: dt for t, _, _, dt, _ in MIXED}, backend="torch")


@pytest.mark.parametrize("batch_size", [1, 5])
@pytest.mark.parametrize("kind", list(MIXED_PLANS))
def test_sharded_mixed_data_types_match_unsharded(kind: str, batch_size: int) -> None:
    qebc = _mixed_quant_ebc()
    sharder = QuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(qebc, MIXED_PLANS[kind], sharder, 2, 2, "cpu")
    sharded = sharder.shard(qebc, plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))
    g = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(0, 4, (len(MIXED), batch_size), generator=g)
    lengths[:, 0] = 0  # every feature's first bag is empty
    values = torch.cat(
        [torch.randint(0, n, (int(lengths[i].sum()),), generator=g) for i, (_, n, *_) in enumerate(MIXED)]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5
    kjt = KeyedJaggedTensor([f"f{t}" for t, *_ in MIXED], values, weights, lengths=lengths.reshape(-1))
    expected = qebc(kjt)
    got = sharded(kjt).wait()
    assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()
    if kind in ("table_wise", "column_wise"):
        assert torch.equal(got.values(), expected.values())
    else:
        torch.testing.assert_close(got.values(), expected.values(), rtol=1e-6, atol=1e-6)
    state, full = sharded.state_dict(), qebc.state_dict()
    assert sorted(state) == sorted(full)  # FP16 / FP32 tables: only "weight", as the unsharded module
    other = _mixed_quant_ebc()
    with torch.no_grad():
        for buffer in other.buffers():
            buffer.zero_()
    other_plan = construct_module_sharding_plan(other, MIXED_PLANS[kind], sharder, 2, 2, "cpu")
    resharded = sharder.shard(other, other_plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))
    resharded.load_state_dict(state)
    assert torch.equal(resharded(kjt).wait().values(), got.values())


def test_int2_column_blocks_must_start_on_a_byte() -> None:
    qebc = _mixed_quant_ebc()
    sharder = QuantEmbeddingBagCollectionSharder()
    blocks = dict(MIXED_PLANS["table_wise"], m0=column_wise(ranks=[0, 1, 0, 1]))  # 2-column blocks
    plan = construct_module_sharding_plan(qebc, blocks, sharder, 2, 2, "cpu")
    with pytest.raises(
        ValueError, match=r"table 'm0': an INT2 column block must start on a multiple of 4 columns .* at column 2"
    ):
        sharder.shard(qebc, plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))
