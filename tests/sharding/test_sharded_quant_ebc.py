"""ShardedQuantEmbeddingBagCollection over the "devices" of one process (all CPU here, as torchrec's inference
sharding on one host): table-wise and column-wise outputs are bit-identical to the unsharded QuantEBC (shards keep
the unsharded codes, scales and biases), row-wise equal up to the order of partial sums (mean: global lengths), for
INT8 and INT4 (the latter weighted), 2 and 3 devices; unsupported plans raise clear errors."""

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
    if kind == "column_wise":  # t2: 6 columns in three blocks on repeated devices
        return {"t0": column_wise(ranks=[world - 1, 0]), "t1": table_wise(rank=0), "t2": column_wise(ranks=[0, 1, 0])}
    return {"t0": row_wise(), "t1": table_wise(rank=world - 1), "t2": column_wise(ranks=[1, 0, 1])}


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4])
@pytest.mark.parametrize(("kind", "world"), [("table_wise", 2), ("row_wise", 3), ("column_wise", 2), ("mixed", 3)])
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


def test_unsupported_quant_plans_raise() -> None:
    qebc = _quant_ebc(DataType.INT4, False)
    sharder = QuantEmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match=r"table 't0': QuantEmbeddingBagCollectionSharder does not support data_par"):
        construct_module_sharding_plan(qebc, {t: data_parallel() for t, *_ in TABLES}, sharder, 2, 2, "cpu")
    odd = {"t0": column_wise(ranks=[0, 1, 0, 1]), "t1": table_wise(rank=0), "t2": column_wise(ranks=[0, 1])}
    plan = construct_module_sharding_plan(qebc, odd, sharder, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"table 't2': an INT4 column block must start on an even column"):
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
