"""QuantEmbeddingBagCollection's state dict is torchrec 1.8's quantized EBC's, byte for byte: codes ``[rows,
row_bytes]`` uint8, fp16 scale / bias ``[rows, 1]``. The expected bytes below are FBGEMM's
``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` output for these rows (recorded once; rows 0-1 of each table are
rounding ties where dividing by the scale instead of multiplying by its reciprocal gives another code), split into
torchrec's entries. Loading takes torchrec's fused TBE rows and our earlier ``[rows]`` scale / bias; bad entries
raise naming the key. Also ``output_dtype`` (and torchrec's ``qconfig`` route) and ``copy``."""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import PlaceholderObserver, QConfig

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, QuantEmbeddingBagCollection

ROWS8 = [[4.46875, -6.95703125, 3.705078125, 18.9375], [-4.203125, 0.060272216796875, -11.6640625, 12.9453125]]
ROWS8 += [[0.25] * 4]  # constant row: scale 1, bias 0.25, codes 0
ROWS4 = [[-11.34375, 4.421875, 10.921875, 7.2109375], [8.984375, 0.57275390625, -14.2734375, -2.642578125]]
# per table: codes, scale bytes, bias bytes (fp16 little-endian); INT4: even column in the low nibble
EXPECTED = {
    DataType.INT8: ([[113, 0, 105, 255], [77, 121, 0, 255], [0, 0, 0, 0]], [[128, 46], [45, 46], [0, 60]],
                    [[245, 198], [213, 201], [0, 52]]),
    DataType.INT4: ([[176, 223], [175, 112]], [[240, 61], [52, 62]], [[172, 201], [35, 203]]),
}  # fmt: skip


def _quant(data_type: DataType, **kwargs) -> QuantEmbeddingBagCollection:
    rows = ROWS8 if data_type == DataType.INT8 else ROWS4
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=len(rows), embedding_dim=4, name="t", feature_names=["f"])], backend="torch"
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(torch.tensor(rows))
    return QuantEmbeddingBagCollection.from_float(ebc, data_type, **kwargs)


def _expected(data_type: DataType) -> dict[str, torch.Tensor]:
    codes, scale, bias = EXPECTED[data_type]

    def half(b: list[list[int]]) -> torch.Tensor:
        return torch.tensor(b, dtype=torch.uint8).view(torch.float16)

    return {
        "embedding_bags.t.weight": torch.tensor(codes, dtype=torch.uint8),
        "embedding_bags.t.weight_qscale": half(scale),
        "embedding_bags.t.weight_qbias": half(bias),
    }


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f"], torch.tensor([0, 1, 1, 0, 1]), lengths=torch.tensor([2, 0, 3]))


def _assert_state(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and state[key].shape == value.shape, key
        assert torch.equal(state[key].contiguous().view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4])
def test_state_dict_is_torchrecs_bytes(data_type: DataType) -> None:
    expected = _expected(data_type)
    assert expected["embedding_bags.t.weight_qscale"].shape == (len(EXPECTED[data_type][0]), 1)
    _assert_state(_quant(data_type).state_dict(), expected)


def test_odd_int4_dim_pads_the_last_byte() -> None:
    """dim 3 (ours only: torchrec needs dim % 4 == 0 for INT4): 2 bytes, the last high nibble zero."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=1, embedding_dim=3, name="t", feature_names=["f"])])
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(torch.tensor([[0.0, 1.0, 0.5]]))
    state = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT4).state_dict()
    # scale fp16(1/15) = 0x2C44, bias 0; codes 0, round(1 * 15.0037) = 15, round(0.5 * 15.0037) = 8
    assert state["embedding_bags.t.weight"].tolist() == [[0 | 15 << 4, 8]]
    assert state["embedding_bags.t.weight_qscale"].view(torch.uint8).tolist() == [[0x44, 0x2C]]


def _fused(data_type: DataType) -> torch.Tensor:
    """torchrec's default state dict: one FBGEMM TBE row per table row, [scale, bias, codes], padded to 16 bytes."""
    codes, scale, bias = EXPECTED[data_type]
    rows = [s + b + c for c, s, b in zip(codes, scale, bias, strict=True)]
    return torch.tensor([r + [0] * (16 - len(r)) for r in rows], dtype=torch.uint8)


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4])
@pytest.mark.parametrize("layout", ["torchrec_split", "torchrec_fused", "rows_scale"])
def test_loads_torchrec_layouts_and_our_previous_one(data_type: DataType, layout: str) -> None:
    expected = _expected(data_type)
    source = _quant(data_type)
    target = _quant(data_type)
    with torch.no_grad():
        for name in ("weight", "weight_qscale", "weight_qbias"):
            getattr(target.embedding_bags["t"], name).zero_()
    if layout == "torchrec_split":
        state = {k: v.clone() for k, v in expected.items()}
    elif layout == "torchrec_fused":
        state = {"embedding_bags.t.weight": _fused(data_type)}
    else:
        state = {k: v.reshape(-1) if k.endswith(("qscale", "qbias")) else v for k, v in expected.items()}
    target.load_state_dict(state)
    _assert_state(target.state_dict(), expected)
    assert torch.equal(target(_kjt()).values(), source(_kjt()).values())
    assigned = _quant(data_type)
    assigned.load_state_dict(state, assign=True)
    _assert_state(assigned.state_dict(), expected)
    assert torch.equal(assigned(_kjt()).values(), source(_kjt()).values())


U8, F16 = torch.uint8, torch.float16


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("weight", torch.zeros(3, 4), r"t.weight: expected torch.uint8 of shape \[3, 4\], got torch.float32"),
        ("weight", torch.zeros(3, 5, dtype=U8), r"t.weight: .* got torch.uint8 of shape \[3, 5\]"),
        ("weight", torch.zeros(2, 4, dtype=U8), r"t.weight: .* of shape \[2, 4\]"),
        ("weight_qscale", torch.zeros(3, 1), r"t.weight_qscale: expected torch.float16 of shape \[3, 1\]"),
        ("weight_qbias", torch.zeros(3, 2, dtype=F16), r"t.weight_qbias: .* shape \[3, 2\]"),
        ("weight_qbias", [0.0] * 3, "t.weight_qbias: expected a torch.Tensor, got list"),
    ],
)
def test_bad_loaded_entries_name_the_key(key: str, value: object, message: str) -> None:
    quant = _quant(DataType.INT8)
    state = quant.state_dict()
    state[f"embedding_bags.t.{key}"] = value
    with pytest.raises(ValueError, match="embedding_bags." + message):
        quant.load_state_dict(state)
    _assert_state(quant.state_dict(), _expected(DataType.INT8))  # nothing was copied


def test_output_dtype_qconfig_and_copy() -> None:
    quant = _quant(DataType.INT8)
    assert quant.output_dtype() == torch.float32 and quant(_kjt()).values().dtype == torch.float32
    half = _quant(DataType.INT8, output_dtype=torch.float16)
    assert half.output_dtype() == torch.float16
    assert torch.equal(half(_kjt()).values(), quant(_kjt()).values().half())
    # torchrec's route: the float module's qconfig picks the weight and output dtypes
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=2, embedding_dim=4, name="t", feature_names=["f"])])
    ebc.qconfig = QConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.bfloat16),
        weight=PlaceholderObserver.with_args(dtype=torch.quint4x2),
    )
    from_qconfig = QuantEmbeddingBagCollection.from_float(ebc, use_precomputed_fake_quant=False)
    assert from_qconfig.embedding_bag_configs()[0].data_type == DataType.INT4
    assert from_qconfig.output_dtype() == torch.bfloat16
    assert from_qconfig.state_dict()["embedding_bags.t.weight"].shape == (2, 2)
    assert quant.copy(torch.device("cpu")) is quant
    with pytest.raises(ValueError, match=r"output_dtype must be one of .* got output_dtype=torch.int32"):
        _quant(DataType.INT8, output_dtype=torch.int32)
    ebc.qconfig = QConfig(activation=PlaceholderObserver, weight=PlaceholderObserver.with_args(dtype=torch.qint32))
    with pytest.raises(ValueError, match="module.qconfig: weight dtype must be torch.quint8 or torch.quint4x2"):
        QuantEmbeddingBagCollection.from_float(ebc)
