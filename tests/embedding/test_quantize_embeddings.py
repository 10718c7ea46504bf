"""quantize_embeddings: every EBC / EC of a model swapped for its quantized counterpart (a DLRM, a model holding an
EC, a collection as the root), outputs equal to the float model holding the dequantized tables and close to the
float model, inplace True / False, per_table_weight_dtype, torchrec's extra-type arguments, and input errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    DLRM,
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embeddings,
)

DIM = 8


def _dlrm() -> DLRM:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=DIM, name="t0", feature_names=["f0"]),
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=DIM, name="t1", feature_names=["f1"]),
    ]
    return DLRM(EmbeddingBagCollection(tables), 4, [6, DIM], [5, 1])


class _SequenceModel(nn.Module):
    """An EC feeding a linear layer over each feature's summed rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        tables = [
            EmbeddingConfig(num_embeddings=10, embedding_dim=DIM, name="s0", feature_names=["f0"]),
            EmbeddingConfig(num_embeddings=4, embedding_dim=DIM, name="s1", feature_names=["f1"]),
        ]
        self.towers = nn.ModuleDict({"seq": EmbeddingCollection(tables)})
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out = self.towers["seq"](features)
        pooled = [out[k].values().sum(0) for k in ("f0", "f1")]
        return self.head(torch.cat(pooled))


def _kjt() -> KeyedJaggedTensor:
    lengths = torch.tensor([2, 1, 0, 1, 3, 1])  # B = 3
    return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 9, 3, 2, 0, 1, 3, 2]), lengths=lengths)


def _with_dequantized(model: nn.Module, quantized: nn.Module, path: str) -> nn.Module:
    """A copy of the float ``model`` whose collection at ``path`` holds ``quantized``'s dequantized tables."""
    reference = copy.deepcopy(model)
    collection = reference.get_submodule(path)
    tables = collection.embedding_bags if hasattr(collection, "embedding_bags") else collection.embeddings
    with torch.no_grad():
        for name, weight in quantized.get_submodule(path).dequantized_weights().items():
            tables[name].weight.copy_(weight)
    return reference


@pytest.mark.parametrize("inplace", [False, True])
def test_dlrm_ebc_swapped_outputs_match(inplace: bool) -> None:
    model = _dlrm()
    original = copy.deepcopy(model)
    dense, kjt = torch.randn(3, 4), _kjt()
    float_logits = model(dense, kjt)
    quantized = quantize_embeddings(model, torch.qint8, inplace=inplace)
    path = "sparse_arch.embedding_bag_collection"
    assert type(quantized.get_submodule(path)) is QuantEmbeddingBagCollection
    assert (quantized is model) == inplace
    assert type(model.get_submodule(path)) is (QuantEmbeddingBagCollection if inplace else EmbeddingBagCollection)
    assert not hasattr(original.get_submodule(path), "qconfig") and not hasattr(model.get_submodule(path), "qconfig")
    if not inplace:  # the float model is untouched
        state, before = model.state_dict(), original.state_dict()
        assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in state)
    logits = quantized(dense, kjt)
    assert torch.equal(logits, _with_dequantized(original, quantized, path)(dense, kjt))
    assert torch.allclose(logits, float_logits, atol=0.05)


def test_ec_model_per_table_weight_dtype_and_output_dtype() -> None:
    model = _SequenceModel()
    kjt = _kjt()
    quantized = quantize_embeddings(
        model, torch.quint8, False, output_dtype=torch.float16, per_table_weight_dtype={"s1": torch.quint4x2}
    )
    collection = quantized.towers["seq"]
    assert type(collection) is QuantEmbeddingCollection and type(model.towers["seq"]) is EmbeddingCollection
    assert [c.data_type for c in collection.embedding_configs()] == [DataType.INT8, DataType.INT4]
    assert collection.output_dtype() == torch.float16
    assert collection.state_dict()["embeddings.s1.weight"].shape == (4, DIM // 2)
    out = collection(kjt)
    assert out["f0"].values().dtype == torch.float16
    reference = _with_dequantized(model, quantized, "towers.seq").towers["seq"](kjt)
    for key in ("f0", "f1"):
        assert torch.equal(out[key].values(), reference[key].values().half())
    float_out = model.towers["seq"](kjt)
    steps = {"f0": 2.0**-8, "f1": 2.0**-4}  # N(0, 1)-ish rows of range < 8: half a step, generously
    for key, step in steps.items():
        assert torch.allclose(out[key].values().float(), float_out[key].values(), atol=8 * step)


def test_root_collection_and_extra_types() -> None:
    tables = [EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f0"])]
    ebc = EmbeddingBagCollection(tables)
    quantized = quantize_embeddings(ebc, torch.float16, inplace=True)
    assert type(quantized) is QuantEmbeddingBagCollection and type(ebc) is EmbeddingBagCollection
    assert quantized.embedding_bag_configs()[0].data_type == DataType.FP16

    class MyEBC(EmbeddingBagCollection):
        pass

    holder = nn.Sequential(MyEBC(tables))
    assert type(quantize_embeddings(holder, torch.quint8, False)[0]) is MyEBC  # exact types only, as torchrec
    swapped = quantize_embeddings(
        holder, torch.quint2x4, False, [MyEBC], {MyEBC: QuantEmbeddingBagCollection}, per_table_weight_dtype={}
    )
    assert type(swapped[0]) is QuantEmbeddingBagCollection
    assert swapped[0].embedding_bag_configs()[0].data_type == DataType.INT2


def test_input_errors() -> None:
    model = _dlrm()
    with pytest.raises(ValueError, match=r"dtype must be one of .* got dtype=torch.bfloat16"):
        quantize_embeddings(model, torch.bfloat16, False)
    with pytest.raises(ValueError, match=r"per_table_weight_dtype names tables no swapped module has: \['nope'\]"):
        quantize_embeddings(model, torch.qint8, True, per_table_weight_dtype={"nope": torch.qint8})
    with pytest.raises(ValueError, match=r"per_table_weight_dtype\['t0'\] must be one of .*=torch.int32"):
        quantize_embeddings(model, torch.qint8, False, per_table_weight_dtype={"t0": torch.int32})
    with pytest.raises(ValueError, match="output_dtype must be one of .* got output_dtype=torch.int8"):
        quantize_embeddings(model, torch.qint8, False, output_dtype=torch.int8)
    with pytest.raises(TypeError, match="inplace must be a bool, got inplace=None"):
        quantize_embeddings(model, torch.qint8, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module must be an nn.Module, got dict"):
        quantize_embeddings({}, torch.qint8, False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="additional_qconfig_spec_keys must hold nn.Module types, got 3"):
        quantize_embeddings(model, torch.qint8, False, [3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"additional_mapping\[Linear\] must be a type with from_float"):
        quantize_embeddings(model, torch.qint8, False, None, {nn.Linear: int})
    assert type(model.sparse_arch.embedding_bag_collection) is EmbeddingBagCollection  # nothing swapped on errors
