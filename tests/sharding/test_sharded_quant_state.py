"""ShardedQuantEmbeddingBagCollection's state dict, torchrec's sharded quant layout: a table-wise table's entries are
the unsharded module's tensors; row-wise entries are ShardedTensors of row slices; a column-wise ``weight`` is a
ShardedTensor of byte-column blocks (INT4: column ``c`` at byte ``c / 2``, INT2 ``c / 4``, FP16 ``2 * c``) and its
scale / bias a list with one ``[rows, 1]`` copy per block (FP16 / FP32 tables: no scale / bias entries). Every
shard is a live view: loading an unsharded state dict (ours, torchrec's fused rows, our earlier ``[rows]`` scale) or
a same-plan sharded one changes the lookups; bad entries raise naming the key.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensorBase

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import ShardingEnv, column_wise, construct_module_sharding_plan, row_wise, table_wise
from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder, ShardedQuantEmbeddingBagCollection
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

TABLES = [("t0", 7, 8, "SUM"), ("t1", 5, 4, "MEAN"), ("t2", 6, 8, "SUM")]  # t0 row-wise, t1 table-wise, t2 columns
PLAN = {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[1, 0])}
BITS = {DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2, DataType.FP16: 16, DataType.FP32: 32}
ALL_TYPES = list(BITS)


def _quant(data_type: DataType, seed: int, output_dtype: torch.dtype = torch.float32) -> QuantEmbeddingBagCollection:
    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=[f"f{t}"], pooling=PoolingType[p])
        for t, n, d, p in TABLES
    ]
    ebc = EmbeddingBagCollection(configs, backend="torch")
    return QuantEmbeddingBagCollection.from_float(ebc, data_type, backend="torch", output_dtype=output_dtype)


def _shard(quant: QuantEmbeddingBagCollection) -> ShardedQuantEmbeddingBagCollection:
    sharder = QuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(quant, PLAN, sharder, 2, 2, "cpu")
    return sharder.shard(quant, plan, ShardingEnv.from_local(2, 0), torch.device("cpu"))


def _kjt() -> KeyedJaggedTensor:
    lengths = torch.tensor([2, 1, 0, 3, 1, 2, 2, 0, 3])
    values = torch.tensor([0, 6, 3, 4, 0, 1, 2, 4, 3, 5, 0, 5, 1, 2])
    return KeyedJaggedTensor(["ft0", "ft1", "ft2"], values, lengths=lengths)


def _shards(value: ShardedTensorBase) -> list[tuple[list[int], list[int], torch.Tensor]]:
    return [(s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor) for s in value.local_shards()]


@pytest.mark.parametrize("data_type", ALL_TYPES)
def test_state_dict_layout(data_type: DataType) -> None:
    quant = _quant(data_type, 0)
    full = quant.state_dict()
    state = _shard(quant).state_dict()
    assert sorted(state) == sorted(full)
    names = ("weight", "weight_qscale", "weight_qbias") if BITS[data_type] <= 8 else ("weight",)
    assert len(full) == 3 * len(names)
    for name in names:  # table-wise: the tensors themselves
        assert torch.equal(state[f"embedding_bags.t1.{name}"], full[f"embedding_bags.t1.{name}"])
    for name in names:  # row-wise over 2 devices: rows 0-3 and 4-6
        value, whole = state[f"embedding_bags.t0.{name}"], full[f"embedding_bags.t0.{name}"]
        assert isinstance(value, ShardedTensorBase) and list(value.metadata().size) == list(whole.shape)
        assert [(o, s) for o, s, _ in _shards(value)] == [([0, 0], [4, whole.shape[1]]), ([4, 0], [3, whole.shape[1]])]
        assert all(torch.equal(t, whole[o[0] : o[0] + s[0]]) for o, s, t in _shards(value))
    width = BITS[data_type]  # t2's 8 columns in bytes; blocks of 4 columns
    weight = state["embedding_bags.t2.weight"]
    assert [(o, s) for o, s, _ in _shards(weight)] == [([0, 0], [6, width // 2]), ([0, width // 2], [6, width // 2])]
    assert torch.equal(torch.cat([t for _, _, t in _shards(weight)], 1), full["embedding_bags.t2.weight"])
    for name in names[1:]:
        blocks = state[f"embedding_bags.t2.{name}"]
        assert len(blocks) == 2 and all(torch.equal(b, full[f"embedding_bags.t2.{name}"]) for b in blocks)


def _old_format(state: dict) -> dict:
    return {k: v.reshape(-1) if k.endswith(("qscale", "qbias")) else v for k, v in state.items()}


def _fused_format(state: dict) -> dict:
    """torchrec's default quant state dict: per table one uint8 ``[scale, bias, codes, pad to 16 bytes]`` row."""
    out = {}
    for table, *_ in TABLES:
        names = ("weight_qscale", "weight_qbias", "weight")  # FP16 / FP32 rows: only the float bytes
        rows = torch.cat(
            [state[key].view(torch.uint8) for n in names if (key := f"embedding_bags.{table}.{n}") in state], 1
        )
        out[f"embedding_bags.{table}.weight"] = torch.nn.functional.pad(rows, (0, 16 - rows.shape[1] % 16))
    return out


@pytest.mark.parametrize("data_type", ALL_TYPES)
@pytest.mark.parametrize("source", ["unsharded", "old_format", "fused_format", "sharded"])
def test_load_changes_the_lookups(data_type: DataType, source: str) -> None:
    other = _quant(data_type, 1)
    sharded = _shard(_quant(data_type, 0))
    before = sharded(_kjt()).wait().values()
    if source == "sharded":
        state = _shard(other).state_dict()
    else:
        state = {"unsharded": dict, "old_format": _old_format, "fused_format": _fused_format}[source](
            other.state_dict()
        )
    result = sharded.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    got, expected = sharded(_kjt()).wait().values(), other(_kjt()).values()
    assert not torch.equal(got, before)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # row-wise t0 sums its partial sums
    for key, value in other.state_dict().items():  # the table-wise table's live tensors equal the loaded ones
        if key.startswith("embedding_bags.t1."):
            assert torch.equal(sharded.state_dict()[key], value)


def test_bad_entries_name_the_key_and_output_dtype() -> None:
    sharded = _shard(_quant(DataType.INT8, 0))
    state = _quant(DataType.INT8, 1).state_dict()
    bad = dict(state, **{"embedding_bags.t0.weight": torch.zeros(7, 8)})
    with pytest.raises(ValueError, match=r"embedding_bags.t0.weight: expected torch.uint8 of shape \[7, 8\]"):
        sharded.load_state_dict(bad)
    bad = dict(state, **{"embedding_bags.t2.weight_qscale": [state["embedding_bags.t2.weight_qscale"]]})
    with pytest.raises(ValueError, match="embedding_bags.t2.weight_qscale: a list of 1 tensors"):
        sharded.load_state_dict(bad)
    other_plan = _shard(_quant(DataType.INT8, 1)).state_dict()
    bad = dict(state, **{"embedding_bags.t2.weight": other_plan["embedding_bags.t0.weight"]})
    with pytest.raises(ValueError, match=r"embedding_bags.t2.weight: the ShardedTensor has no local shard at"):
        sharded.load_state_dict(bad)
    assert torch.equal(sharded.state_dict()["embedding_bags.t1.weight"], _quant(DataType.INT8, 0).state_dict()[
        "embedding_bags.t1.weight"])  # fmt: skip
    missing = sharded.load_state_dict({"embedding_bags.t1.weight": state["embedding_bags.t1.weight"]}, strict=False)
    assert "embedding_bags.t0.weight" in missing.missing_keys and "embedding_bags.t1.weight" not in missing.missing_keys
    half = _shard(_quant(DataType.INT8, 0, output_dtype=torch.float16))
    assert half.output_dtype() == torch.float16 and half(_kjt()).wait().values().dtype == torch.float16
    assert half.copy(torch.device("cpu")) is half
