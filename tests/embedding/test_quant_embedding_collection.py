"""QuantEmbeddingCollection: outputs bit-exact against the stored bytes dequantized by the formula written out here,
within the quantization bound of the float EC, torchrec 1.8's state-dict keys / shapes (verified against torchrec's
QuantEmbeddingCollection in a scratch script: same bytes, outputs equal), loading torchrec's fused rows and its
``table_name_to_quantized_weights``, and input errors naming the argument."""

from __future__ import annotations

import copy

import pytest
import torch
from embedding.tbe_testing import BACKENDS

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import DataType, EmbeddingCollection, EmbeddingConfig, QuantEmbeddingCollection

BITS = {DataType.FP32: 32, DataType.FP16: 16, DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2}
ALL_TYPES = list(BITS)


def _ec(backend: str = "torch", dims: tuple[int, int] = (6, 3), need_indices: bool = False) -> EmbeddingCollection:
    tables = [
        EmbeddingConfig(num_embeddings=7, embedding_dim=dims[0], name="t0", feature_names=["f0", "f2"]),
        EmbeddingConfig(num_embeddings=5, embedding_dim=dims[1], name="t1", feature_names=["f1"]),
    ]
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables, need_indices=need_indices, backend=backend)
    with torch.no_grad():
        ec.embeddings["t1"].weight[2] = 0.5  # a constant row: FBGEMM's scale 1 rule
    return ec


def _kjt() -> KeyedJaggedTensor:
    # B = 3; f1 has an empty sample, f2 is empty for every sample but one
    lengths = torch.tensor([3, 0, 2, 1, 0, 4, 0, 2, 0])
    values = torch.tensor([0, 6, 3, 1, 1, 4, 0, 2, 2, 3, 5, 6])
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)


def _dequantize_by_formula(state: dict[str, torch.Tensor], table: str, dim: int, bits: int) -> torch.Tensor:
    """The stored bytes of ``embeddings.<table>`` -> ``[rows, dim]`` fp32, one column at a time: code ``c`` of an
    INT row sits in byte ``c * bits // 8`` at bit ``(c % (8 // bits)) * bits``; ``value = code * scale + bias``."""
    weight = state[f"embeddings.{table}.weight"]
    if bits == 32:
        return weight.contiguous().view(torch.float32)
    if bits == 16:
        return weight.contiguous().view(torch.float16).float()
    scale = state[f"embeddings.{table}.weight_qscale"].float()
    bias = state[f"embeddings.{table}.weight_qbias"].float()
    columns = []
    for c in range(dim):
        byte = weight[:, c * bits // 8].long()
        code = (byte >> ((c % (8 // bits)) * bits)) & ((1 << bits) - 1)
        columns.append(code.float()[:, None] * scale + bias)
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data_type", ALL_TYPES)
def test_matches_formula_exactly_and_float_ec_within_bound(backend: str, data_type: DataType) -> None:
    ec = _ec(backend)
    quant = QuantEmbeddingCollection.from_float(ec, data_type)
    state = quant.state_dict()
    kjt = _kjt()
    out, float_out = quant(kjt), ec(kjt)
    assert list(out) == list(float_out) == ["f0", "f2", "f1"]
    bits = BITS[data_type]
    for feature, table, dim in (("f0", "t0", 6), ("f2", "t0", 6), ("f1", "t1", 3)):
        ids = kjt[feature].values()
        expected = _dequantize_by_formula(state, table, dim, bits)[ids]
        assert out[feature].values().dtype == torch.float32
        assert torch.equal(out[feature].values(), expected)
        assert torch.equal(out[feature].lengths(), kjt[feature].lengths())
        assert out[feature].weights_or_none() is None
        # the documented bound: INT rows within half a step (scale) of the float row; FP16 within half an ulp
        # (2**-11 relative, normal range); FP32 exact
        weight = ec.embeddings[table].weight.detach()[ids]
        if bits <= 8:
            bound = 0.5 * state[f"embeddings.{table}.weight_qscale"].float()[ids] + 1e-6
        else:
            bound = weight.abs() * (2.0**-11 if bits == 16 else 0.0)
        assert bool(((out[feature].values() - weight).abs() <= bound).all())


def test_state_dict_keys_and_shapes_are_torchrecs() -> None:
    """As torchrec 1.8's QuantEmbeddingCollection (quant_state_dict_split_scale_bias) saves them, for 20 x 16 tables
    (INT4 / INT2: torchrec's UInt4Tensor / UInt2Tensor report [20, 16] codes; these are their uint8 bytes)."""
    types = {
        "a": DataType.INT8,
        "b": DataType.INT4,
        "c": DataType.INT2,
        "d": DataType.FP16,
        "e": DataType.FP32,
        "f": DataType.INT8,
    }
    tables = [EmbeddingConfig(num_embeddings=20, embedding_dim=16, name=n, feature_names=[n]) for n in types]
    quant = QuantEmbeddingCollection.from_float(EmbeddingCollection(tables), types)
    state = quant.state_dict()
    # torchrec registers (and outputs) tables by data-type group: INT8 "a" and "f" first
    expected = {
        "embeddings.a.weight": (torch.uint8, (20, 16)),
        "embeddings.a.weight_qscale": (torch.float16, (20, 1)),
        "embeddings.a.weight_qbias": (torch.float16, (20, 1)),
        "embeddings.f.weight": (torch.uint8, (20, 16)),
        "embeddings.f.weight_qscale": (torch.float16, (20, 1)),
        "embeddings.f.weight_qbias": (torch.float16, (20, 1)),
        "embeddings.b.weight": (torch.uint8, (20, 8)),
        "embeddings.b.weight_qscale": (torch.float16, (20, 1)),
        "embeddings.b.weight_qbias": (torch.float16, (20, 1)),
        "embeddings.c.weight": (torch.uint8, (20, 4)),
        "embeddings.c.weight_qscale": (torch.float16, (20, 1)),
        "embeddings.c.weight_qbias": (torch.float16, (20, 1)),
        "embeddings.d.weight": (torch.uint8, (20, 32)),
        "embeddings.e.weight": (torch.uint8, (20, 64)),
    }
    assert list(state) == list(expected)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == expected
    kjt = KeyedJaggedTensor(keys=list(types), values=torch.arange(6), lengths=torch.ones(6, dtype=torch.int64))
    assert list(quant(kjt)) == ["a", "f", "b", "c", "d", "e"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_types_dims_need_indices_and_output_dtype(backend: str) -> None:
    ec = _ec(backend, dims=(5, 8), need_indices=True)
    quant = QuantEmbeddingCollection.from_float(
        ec, {"t0": DataType.INT4, "t1": DataType.FP16}, output_dtype=torch.bfloat16
    )
    assert [c.data_type for c in quant.embedding_configs()] == [DataType.INT4, DataType.FP16]
    assert quant.output_dtype() == torch.bfloat16 and quant.need_indices()
    kjt = _kjt()
    out = quant(kjt)
    weights = quant.dequantized_weights()
    for feature, table in (("f0", "t0"), ("f2", "t0"), ("f1", "t1")):
        ids = kjt[feature].values()
        assert out[feature].values().dtype == torch.bfloat16
        assert torch.equal(out[feature].values(), weights[table][ids].to(torch.bfloat16))
        assert torch.equal(out[feature].weights(), ids)
    with pytest.raises(ValueError, match=r"tables have different dims \[5, 8\]"):
        quant.embedding_dim()


def test_loads_torchrec_layouts_and_quantized_weights() -> None:
    ec = _ec()
    quant = QuantEmbeddingCollection.from_float(ec, {"t0": DataType.INT4, "t1": DataType.FP32})
    state = quant.state_dict()
    kjt = _kjt()
    before = quant(kjt)
    configs = quant.embedding_configs()
    # torchrec's default layout: one fused row per id, [scale fp16, bias fp16, codes, padding to 16 bytes]
    scale_shift = torch.cat([state["embeddings.t0.weight_qscale"], state["embeddings.t0.weight_qbias"]], 1)
    scale_shift = scale_shift.contiguous().view(torch.uint8)
    fused = torch.cat([scale_shift, state["embeddings.t0.weight"], torch.zeros(7, 9, dtype=torch.uint8)], 1)
    padded_fp32 = torch.cat([state["embeddings.t1.weight"], torch.zeros(5, 4, dtype=torch.uint8)], 1)
    reloaded = QuantEmbeddingCollection(configs)
    reloaded.load_state_dict({"embeddings.t0.weight": fused, "embeddings.t1.weight": padded_fp32})
    from_bytes = QuantEmbeddingCollection(
        configs,
        table_name_to_quantized_weights={
            "t0": (state["embeddings.t0.weight"], scale_shift),
            "t1": (state["embeddings.t1.weight"], None),
        },
    )
    for module in (reloaded, from_bytes):
        out = module(kjt)
        assert all(torch.equal(out[k].values(), before[k].values()) for k in before)


def test_input_errors() -> None:
    ec = _ec()
    with pytest.raises(ValueError, match=r"data_type must be DataType .* got data_type=<DataType.BF16.* table 't0'"):
        QuantEmbeddingCollection.from_float(ec, DataType.BF16)
    with pytest.raises(ValueError, match=r"data_type names tables the module does not have: \['t9'\]"):
        QuantEmbeddingCollection.from_float(ec, {"t9": DataType.INT8})
    with pytest.raises(TypeError, match="module must be an EmbeddingCollection, got Linear"):
        QuantEmbeddingCollection.from_float(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="output_dtype must be one of .* got output_dtype=torch.int32"):
        QuantEmbeddingCollection.from_float(ec, output_dtype=torch.int32)
    configs = QuantEmbeddingCollection.from_float(ec).embedding_configs()
    with pytest.raises(ValueError, match="row_alignment must be a positive int, got row_alignment=0"):
        QuantEmbeddingCollection(configs, row_alignment=0)
    with pytest.raises(ValueError, match=r"table_name_to_quantized_weights names tables .* \['t7'\]"):
        QuantEmbeddingCollection(configs, table_name_to_quantized_weights={"t7": (torch.zeros(1), None)})
    with pytest.raises(ValueError, match=r"table_name_to_quantized_weights\['t1'\]: codes must be uint8 \[5, >= 3\]"):
        QuantEmbeddingCollection(configs, table_name_to_quantized_weights={"t1": (torch.zeros(5, 2), None)})
    with pytest.raises(ValueError, match=r"table_name_to_quantized_weights\['t1'\]: scale_shift must be uint8"):
        QuantEmbeddingCollection(
            configs, table_name_to_quantized_weights={"t1": (torch.zeros(5, 3, dtype=torch.uint8), None)}
        )
    quant = QuantEmbeddingCollection.from_float(ec)
    bad_ids = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.tensor([1, 5, 2]), lengths=torch.tensor([1, 1, 1])
    )
    with pytest.raises(ValueError, match=r"index out of bounds: feature 'f1' .* index 5"):
        quant(bad_ids)
    wrong_key = KeyedJaggedTensor(
        keys=["f0", "f1", "g"], values=torch.tensor([1, 2, 2]), lengths=torch.tensor([1, 1, 1])
    )
    with pytest.raises(ValueError, match=r"features is missing keys \['f2'\]"):
        quant(wrong_key)
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor"):
        quant(torch.zeros(3))


@pytest.mark.parametrize("replace", ["assign", "half", "deepcopy"])
def test_repacks_after_buffers_are_replaced(replace: str) -> None:
    quant = QuantEmbeddingCollection.from_float(_ec(), {"t0": DataType.INT2, "t1": DataType.INT8})
    kjt = _kjt()
    before = quant(kjt)
    if replace == "assign":  # as .to() or load_state_dict(assign=True) would
        quant.embeddings["t1"].weight_qscale = quant.embeddings["t1"].weight_qscale.clone()
    elif replace == "half":
        quant.half()
    else:
        quant = copy.deepcopy(quant)
    after = quant(kjt)
    assert all(torch.equal(after[k].values(), before[k].values()) for k in before)
    assert quant.copy(torch.device("cpu")) is quant and quant.device == torch.device("cpu")
