"""QuantEmbeddingBagCollection.from_float: torchrec's buffer names, exact agreement with an EBC holding the
dequantized weights (every data type, and mixed in one collection), closeness to the float EBC, re-packing after
moves, and input errors."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    PoolingType,
    QuantEmbeddingBagCollection,
)


def _ebc(backend: str, weighted: bool = False) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=5, name="t0", feature_names=["f0", "f2"]),
        EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=3, name="t1", feature_names=["f1"], pooling=PoolingType.MEAN
        ),
    ]
    return EmbeddingBagCollection(tables, is_weighted=weighted, backend=backend)


def _kjt(weighted: bool = False) -> KeyedJaggedTensor:
    lengths = torch.tensor([3, 0, 4, 1, 3, 2, 2, 1, 0])
    values = torch.tensor([0, 1, 1, 5, 4, 3, 2, 3, 0, 1, 2, 1, 1, 4, 5, 0])
    weights = torch.rand(16, generator=torch.Generator().manual_seed(0)) if weighted else None
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths, weights=weights)


BITS = {DataType.FP32: 32, DataType.FP16: 16, DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data_type", list(BITS))
@pytest.mark.parametrize("weighted", [False, True])
def test_from_float_matches_dequantized_weights_exactly(backend, data_type, weighted):
    ebc = _ebc(backend, weighted)
    quant = QuantEmbeddingBagCollection.from_float(ebc, data_type)
    keys = list(quant.state_dict())
    buffers = ("weight", "weight_qscale", "weight_qbias") if BITS[data_type] <= 8 else ("weight",)
    assert keys == [f"embedding_bags.{t}.{b}" for t in ("t0", "t1") for b in buffers]
    assert quant.embedding_bags["t0"].weight.dtype == torch.uint8
    assert quant.embedding_bags["t0"].weight.shape == (6, (5 * BITS[data_type] + 7) // 8)
    dequantized = _ebc(backend, weighted)
    with torch.no_grad():
        for name, table in quant.dequantized_weights().items():
            dequantized.embedding_bags[name].weight.copy_(table)
    kjt = _kjt(weighted)
    out = quant(kjt)
    assert out.keys() == ["f0", "f2", "f1"]
    assert torch.equal(out.values(), dequantized(kjt).values())
    # within quantization error of the float module: at most half a step per row, summed over each bag (FP16: the
    # step is one ulp of the largest weight, 2**-10 relative; FP32: exact)
    if BITS[data_type] <= 8:
        steps = {n: quant.embedding_bags[n].weight_qscale.float().max().item() for n in ("t0", "t1")}
    else:
        ulp = 2.0**-10 if data_type == DataType.FP16 else 0.0
        steps = {n: ebc.embedding_bags[n].weight.abs().max().item() * ulp for n in ("t0", "t1")}
    float_out = ebc(kjt)
    for feature, table in (("f0", "t0"), ("f2", "t0"), ("f1", "t1")):
        jt = kjt[feature]
        per_value = jt.weights().abs() if weighted else torch.ones(jt.values().numel())
        bag_weight = torch.zeros(3).index_add_(0, torch.repeat_interleave(torch.arange(3), jt.lengths()), per_value)
        bound = 0.55 * steps[table] * bag_weight + 1e-4
        assert bool(((out[feature] - float_out[feature]).abs() <= bound[:, None]).all())


def test_repacks_after_buffers_are_replaced_and_keeps_options():
    ebc = _ebc("torch")
    quant = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT8)
    kjt = _kjt()
    before = quant(kjt).values()
    module = quant.embedding_bags["t1"]
    module.weight_qscale = module.weight_qscale.clone()  # as .to() or load_state_dict(assign=True) would
    assert torch.equal(quant(kjt).values(), before)
    other = QuantEmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=6, embedding_dim=5, name="t0", feature_names=["f0", "f2"], data_type=DataType.INT8
            ),
            EmbeddingBagConfig(
                num_embeddings=4,
                embedding_dim=3,
                name="t1",
                feature_names=["f1"],
                pooling=PoolingType.MEAN,
                data_type=DataType.INT8,
            ),
        ],
        backend="torch",
    )
    other.load_state_dict(quant.state_dict())
    assert torch.equal(other(kjt).values(), before)
    assert quant.bounds_check == ebc.bounds_check and quant.backend == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_data_types_one_group_per_type(backend):
    """Five data types over six tables (two INT2 tables share a group), odd dims, a shared MEAN table, empty bags:
    the output, column for column, is an EBC's on the dequantized weights; torchrec's state-dict entries per type."""
    types = [DataType.INT2, DataType.FP32, DataType.INT8, DataType.FP16, DataType.INT2, DataType.INT4]
    dims = [3, 1, 4, 5, 8, 6]
    configs = [
        EmbeddingBagConfig(
            num_embeddings=5 + t,
            embedding_dim=dims[t],
            name=f"t{t}",
            feature_names=[f"f{t}"] + (["g"] if t == 3 else []),
            pooling=PoolingType.MEAN if t in (1, 3) else PoolingType.SUM,
        )
        for t in range(6)
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=True, backend=backend)
    quant = QuantEmbeddingBagCollection.from_float(ebc, {c.name: d for c, d in zip(configs, types, strict=True)})
    assert [c.data_type for c in quant.embedding_bag_configs()] == types
    assert sorted(g.tables.bits for g in quant._quant_groups) == [2, 4, 8, 16, 32]
    state = quant.state_dict()
    for config, data_type in zip(configs, types, strict=True):
        prefix = f"embedding_bags.{config.name}."
        assert state[prefix + "weight"].shape == (
            config.num_embeddings,
            (config.embedding_dim * BITS[data_type] + 7) // 8,
        )
        assert (prefix + "weight_qscale" in state) == (BITS[data_type] <= 8)
    dequantized = EmbeddingBagCollection(configs, is_weighted=True, backend=backend)
    with torch.no_grad():
        for name, table in quant.dequantized_weights().items():
            dequantized.embedding_bags[name].weight.copy_(table)
    keys = [f"f{t}" for t in range(6)] + ["g"]
    lengths = torch.tensor([2, 0, 1, 3, 0, 0, 1, 2, 2, 0, 1, 0, 3, 1])  # B = 2; f1 has two empty bags
    values = torch.cat([torch.arange(int(n)) % 5 for n in lengths])
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=torch.rand(values.numel()) + 0.5)
    out, expected = quant(kjt), dequantized(kjt)
    assert out.keys() == expected.keys() == ["f0", "f1", "f2", "f3", "g", "f4", "f5"]
    assert torch.equal(out.values(), expected.values())
    reloaded = QuantEmbeddingBagCollection.from_float(ebc, {c.name: d for c, d in zip(configs, types, strict=True)})
    with torch.no_grad():
        for buffer in reloaded.buffers():
            buffer.zero_()
    reloaded.load_state_dict(state)
    assert torch.equal(reloaded(kjt).values(), out.values())


def test_input_errors():
    with pytest.raises(
        ValueError,
        match="data_type must be DataType FP32, FP16, INT8, INT4 or INT2, got data_type=<DataType.BF16.* table 't0'",
    ):
        QuantEmbeddingBagCollection.from_float(_ebc("torch"), DataType.BF16)
    with pytest.raises(ValueError, match=r"data_type names tables the module does not have: \['t9'\]"):
        QuantEmbeddingBagCollection.from_float(_ebc("torch"), {"t9": DataType.INT2})
    with pytest.raises(ValueError, match="got data_type=<DataType.BF16.* for table 't1'"):
        QuantEmbeddingBagCollection.from_float(_ebc("torch"), {"t1": DataType.BF16})
    with pytest.raises(TypeError, match="module must be an EmbeddingBagCollection, got Linear"):
        QuantEmbeddingBagCollection.from_float(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match="table 't': QuantEmbeddingBagCollection needs data_type FP32, FP16, INT8, INT4 or INT2"
    ):
        QuantEmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t", data_type=DataType.BF16)]
        )
    quant = QuantEmbeddingBagCollection.from_float(_ebc("torch", weighted=True))
    with pytest.raises(ValueError, match="is_weighted=True but features has no weights"):
        quant(_kjt())


@pytest.mark.parametrize("cast", ["float", "double", "half"])
def test_float_casts_keep_the_module_working(cast: str) -> None:
    # model.float() / .double() cast the fp16 scale / bias buffers; torchrec's quant EBC keeps working (it raised)
    quant = QuantEmbeddingBagCollection.from_float(_ebc("torch"), {"t0": DataType.INT4, "t1": DataType.FP16})
    kjt = _kjt()
    before = quant(kjt).values()
    getattr(quant, cast)()
    assert torch.equal(quant(kjt).values(), before)
    assert quant.state_dict()["embedding_bags.t0.weight_qscale"].dtype == torch.float16


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2])
@pytest.mark.parametrize(("value", "what"), [(float("nan"), "NaN or inf"), (float("inf"), "NaN or inf"), (1e5, "fp16")])
def test_from_float_refuses_rows_quantization_cannot_hold(data_type: DataType, value: float, what: str) -> None:
    # FBGEMM's codes for such a row are garbage (NaN ignored, inf -> a NaN row); ours were too (inf -> finite values)
    ebc = _ebc("torch")
    with torch.no_grad():
        ebc.embedding_bags["t1"].weight[2, 1] = value
        ebc.embedding_bags["t1"].weight[2, 0] = -value if value == 1e5 else 0.0
    with pytest.raises(ValueError, match=f"table 't1': row 2 .*{what}"):
        QuantEmbeddingBagCollection.from_float(ebc, data_type)
    for float_type in (DataType.FP16, DataType.FP32):  # cast as torch does, NaN / inf kept (torchrec's result)
        QuantEmbeddingBagCollection.from_float(ebc, float_type)
