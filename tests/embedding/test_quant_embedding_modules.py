"""QuantEmbeddingBagCollection.from_float: torchrec's buffer names, exact agreement with an EBC holding the
dequantized weights, closeness to the float EBC, re-packing after moves, and input errors."""

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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4])
@pytest.mark.parametrize("weighted", [False, True])
def test_from_float_matches_dequantized_weights_exactly(backend, data_type, weighted):
    ebc = _ebc(backend, weighted)
    quant = QuantEmbeddingBagCollection.from_float(ebc, data_type)
    keys = list(quant.state_dict())
    assert keys == [
        f"embedding_bags.{t}.{b}" for t in ("t0", "t1") for b in ("weight", "weight_qscale", "weight_qbias")
    ]
    assert quant.embedding_bags["t0"].weight.dtype == torch.uint8
    assert quant.embedding_bags["t0"].weight.shape == (6, 5 if data_type == DataType.INT8 else 3)
    dequantized = _ebc(backend, weighted)
    with torch.no_grad():
        for name, table in quant.dequantized_weights().items():
            dequantized.embedding_bags[name].weight.copy_(table)
    kjt = _kjt(weighted)
    out = quant(kjt)
    assert out.keys() == ["f0", "f2", "f1"]
    assert torch.equal(out.values(), dequantized(kjt).values())
    # within quantization error of the float module: at most half a step per row, summed over each bag
    steps = {n: quant.embedding_bags[n].weight_qscale.float().max().item() for n in ("t0", "t1")}
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


def test_input_errors():
    with pytest.raises(
        ValueError, match="data_type must be DataType.INT8 or DataType.INT4, got data_type=<DataType.FP16"
    ):
        QuantEmbeddingBagCollection.from_float(_ebc("torch"), DataType.FP16)
    with pytest.raises(TypeError, match="module must be an EmbeddingBagCollection, got Linear"):
        QuantEmbeddingBagCollection.from_float(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="table 't': QuantEmbeddingBagCollection needs data_type INT8 or INT4"):
        QuantEmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t")])
    quant = QuantEmbeddingBagCollection.from_float(_ebc("torch", weighted=True))
    with pytest.raises(ValueError, match="is_weighted=True but features has no weights"):
        quant(_kjt())
