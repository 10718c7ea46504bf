"""QuantEmbeddingBagCollection's state dict is torchrec 1.8's quantized EBC's, byte for byte: codes ``[rows,
row_bytes]`` uint8, fp16 scale / bias ``[rows, 1]`` (FP16 / FP32 tables: only the float bytes). The INT8 / INT4
expected bytes below are FBGEMM's ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` output for these rows (recorded
once; rows 0-1 of each table are rounding ties where dividing by the scale instead of multiplying by its reciprocal
gives another code), split into torchrec's entries; the INT2 / FP16 / FP32 ones are worked out by hand next to their
rows (and equal FBGEMM's / torchrec's). Loading takes torchrec's fused TBE rows and our earlier ``[rows]`` scale /
bias; bad entries raise naming the key. Also ``output_dtype`` (and torchrec's ``qconfig`` route) and ``copy``."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch.ao.quantization import PlaceholderObserver, QConfig

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, QuantEmbeddingBagCollection

ROWS8 = [[4.46875, -6.95703125, 3.705078125, 18.9375], [-4.203125, 0.060272216796875, -11.6640625, 12.9453125]]
ROWS8 += [[0.25] * 4]  # constant row: scale 1, bias 0.25, codes 0
ROWS4 = [[-11.34375, 4.421875, 10.921875, 7.2109375], [8.984375, 0.57275390625, -14.2734375, -2.642578125]]
S = 685 / 4096  # an fp16 scale whose fp32 reciprocal r has 1.5 * S * r < 1.5
# INT2, dim 8 (torchrec needs dim % 8 == 0): four codes a byte, column c at bit 2 * (c % 4)
ROWS2 = [
    [0.0, 3 * S, 1.5 * S, 0.5 * S, 2.5 * S, S, 2 * S, 0.0],  # scale S, bias 0; codes 0 3 1 0 | 2 1 2 0 (1.5 -> 1)
    [0.0, 1.0, 2.0, 3.0, 0.5, 1.5, 2.5, 3.0],  # scale 1, bias 0; codes 0 1 2 3 | 0 2 2 3 (ties to even)
    [-1.5] * 8,  # constant: scale 1, bias -1.5, codes 0
]
ROWS16 = [[0.1, 1.0 + 2.0**-11, -2.0], [65504.0, -0.0, 2.0**-24]]  # FP16 (any dim), rounded to nearest even
ROWS32 = [[1.0, -0.5], [-3.0, 0.25]]
ROWS = {DataType.INT8: ROWS8, DataType.INT4: ROWS4, DataType.INT2: ROWS2, DataType.FP16: ROWS16, DataType.FP32: ROWS32}
# per table: codes, scale bytes, bias bytes (fp16 little-endian); INT4: even column in the low nibble; FP16 / FP32:
# the float bytes only
EXPECTED = {
    DataType.INT8: ([[113, 0, 105, 255], [77, 121, 0, 255], [0, 0, 0, 0]], [[128, 46], [45, 46], [0, 60]],
                    [[245, 198], [213, 201], [0, 52]]),
    DataType.INT4: ([[176, 223], [175, 112]], [[240, 61], [52, 62]], [[172, 201], [35, 203]]),
    DataType.INT2: ([[0 | 3 << 2 | 1 << 4 | 0 << 6, 2 | 1 << 2 | 2 << 4 | 0 << 6],
                     [0 | 1 << 2 | 2 << 4 | 3 << 6, 0 | 2 << 2 | 2 << 4 | 3 << 6], [0, 0]],
                    [[0x5A, 0x31], [0x00, 0x3C], [0x00, 0x3C]],  # fp16 685 / 4096 = 0x315A, 1.0 = 0x3C00
                    [[0x00, 0x00], [0x00, 0x00], [0x00, 0xBE]]),  # 0, 0, -1.5 = 0xBE00
    # 0.1 = 0x2E66, 1 + 2**-11 ties to 0x3C00, -2 = 0xC000 | 65504 = 0x7BFF, -0 = 0x8000, 2**-24 = 0x0001
    DataType.FP16: ([[0x66, 0x2E, 0x00, 0x3C, 0x00, 0xC0], [0xFF, 0x7B, 0x00, 0x80, 0x01, 0x00]],),
    # 1.0 = 0x3F800000, -0.5 = 0xBF000000 | -3.0 = 0xC0400000, 0.25 = 0x3E800000
    DataType.FP32: ([[0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xBF],
                     [0x00, 0x00, 0x40, 0xC0, 0x00, 0x00, 0x80, 0x3E]],),
}  # fmt: skip
ALL_TYPES = list(EXPECTED)


def _quant(data_type: DataType, **kwargs) -> QuantEmbeddingBagCollection:
    rows = ROWS[data_type]
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=len(rows), embedding_dim=len(rows[0]), name="t", feature_names=["f"])],
        backend="torch",
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(torch.tensor(rows))
    return QuantEmbeddingBagCollection.from_float(ebc, data_type, **kwargs)


def _expected(data_type: DataType) -> dict[str, torch.Tensor]:
    codes, *scale_bias = EXPECTED[data_type]

    def half(b: list[list[int]]) -> torch.Tensor:
        return torch.tensor(b, dtype=torch.uint8).view(torch.float16)

    names = ("embedding_bags.t.weight_qscale", "embedding_bags.t.weight_qbias")
    return {
        "embedding_bags.t.weight": torch.tensor(codes, dtype=torch.uint8),
        **{name: half(b) for name, b in zip(names[: len(scale_bias)], scale_bias, strict=True)},
    }


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f"], torch.tensor([0, 1, 1, 0, 1]), lengths=torch.tensor([2, 0, 3]))


def _assert_state(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and state[key].shape == value.shape, key
        assert torch.equal(state[key].contiguous().view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("data_type", ALL_TYPES)
def test_state_dict_is_torchrecs_bytes(data_type: DataType) -> None:
    expected = _expected(data_type)
    if len(expected) == 3:
        assert expected["embedding_bags.t.weight_qscale"].shape == (len(EXPECTED[data_type][0]), 1)
    quant = _quant(data_type)
    _assert_state(quant.state_dict(), expected)
    # the lookup reads what the state dict holds: the rows dequantized by hand from the expected bytes
    codes, *scale_bias = EXPECTED[data_type]
    dim = len(ROWS[data_type][0])
    if scale_bias:
        scale, bias = (torch.tensor(b, dtype=torch.uint8).view(torch.float16).reshape(-1).tolist() for b in scale_bias)
        bits = 8 * len(codes[0]) // dim
        per_byte = 8 // bits
        table = [
            [
                ((row[c // per_byte] >> (c % per_byte * bits)) & ((1 << bits) - 1)) * scale[r] + bias[r]
                for c in range(dim)
            ]
            for r, row in enumerate(codes)
        ]
    else:
        fmt = f"<{dim}{'e' if data_type == DataType.FP16 else 'f'}"
        table = [struct.unpack(fmt, bytes(row)) for row in codes]
    assert torch.equal(quant.dequantized_weights()["t"], torch.tensor(table, dtype=torch.float32))


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
    """torchrec's default state dict: one FBGEMM TBE row per table row, [scale, bias, codes] (FP16 / FP32: the float
    bytes), padded to 16 bytes."""
    codes, *scale_bias = EXPECTED[data_type]
    rows = [[x for part in (*parts[1:], parts[0]) for x in part] for parts in zip(codes, *scale_bias, strict=True)]
    return torch.tensor([r + [0] * (16 - len(r)) for r in rows], dtype=torch.uint8)


@pytest.mark.parametrize("data_type", ALL_TYPES)
@pytest.mark.parametrize("layout", ["torchrec_split", "torchrec_fused", "rows_scale"])
def test_loads_torchrec_layouts_and_our_previous_one(data_type: DataType, layout: str) -> None:
    expected = _expected(data_type)
    source = _quant(data_type)
    target = _quant(data_type)
    with torch.no_grad():
        for buffer in target.embedding_bags["t"].buffers():
            buffer.zero_()
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


INT8, INT2, FP16 = DataType.INT8, DataType.INT2, DataType.FP16


@pytest.mark.parametrize(
    ("data_type", "key", "value", "message"),
    [
        (INT8, "weight", torch.zeros(3, 4), r"t.weight: expected torch.uint8 of shape \[3, 4\], got torch.float32"),
        (INT8, "weight", torch.zeros(3, 5, dtype=U8), r"t.weight: .* got torch.uint8 of shape \[3, 5\]"),
        (INT8, "weight", torch.zeros(2, 4, dtype=U8), r"t.weight: .* of shape \[2, 4\]"),
        (INT8, "weight_qscale", torch.zeros(3, 1), r"t.weight_qscale: expected torch.float16 of shape \[3, 1\]"),
        (INT8, "weight_qbias", torch.zeros(3, 2, dtype=F16), r"t.weight_qbias: .* shape \[3, 2\]"),
        (INT8, "weight_qbias", [0.0] * 3, "t.weight_qbias: expected a torch.Tensor, got list"),
        (INT2, "weight", torch.zeros(3, 8, dtype=U8), r"t.weight: expected torch.uint8 of shape \[3, 2\], got .*8\]"),
        (FP16, "weight", torch.zeros(2, 3, dtype=F16), r"t.weight: expected torch.uint8 of shape \[2, 6\], got .*16"),
        (FP16, "weight", torch.zeros(2, 5, dtype=U8), r"t.weight: expected torch.uint8 of shape \[2, 6\], got .*5\]"),
    ],
)  # fmt: skip
def test_bad_loaded_entries_name_the_key(data_type: DataType, key: str, value: object, message: str) -> None:
    quant = _quant(data_type)
    state = quant.state_dict()
    state[f"embedding_bags.t.{key}"] = value
    with pytest.raises(ValueError, match="embedding_bags." + message):
        quant.load_state_dict(state)
    _assert_state(quant.state_dict(), _expected(data_type))  # nothing was copied


def test_float_tables_have_no_scale_or_bias_entries() -> None:
    quant = _quant(DataType.FP16)
    state = dict(quant.state_dict(), **{"embedding_bags.t.weight_qscale": torch.ones(2, 1, dtype=F16)})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"embedding_bags.t.weight_qscale\""):
        quant.load_state_dict(state)
    assert quant.load_state_dict(state, strict=False).unexpected_keys == ["embedding_bags.t.weight_qscale"]


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
    with pytest.raises(
        ValueError, match=r"module.qconfig: weight dtype must be one of \[torch.float32, .*torch.qint32"
    ):
        QuantEmbeddingBagCollection.from_float(ebc)


class _QuantConfig(NamedTuple):
    """torchrec's ``QuantConfig``: a qconfig with per-table weight dtypes."""

    activation: Callable
    weight: Callable
    per_table_weight_dtype: dict[str, torch.dtype] | None = None


@pytest.mark.parametrize(
    ("weight_dtype", "data_type", "width"),
    [(torch.quint2x4, DataType.INT2, 2), (torch.float16, DataType.FP16, 16), (torch.float32, DataType.FP32, 32)],
)
def test_qconfig_routes_to_int2_fp16_fp32_and_per_table(weight_dtype: torch.dtype, data_type: DataType, width: int):
    configs = [EmbeddingBagConfig(num_embeddings=2, embedding_dim=8, name=t, feature_names=[t]) for t in ("a", "b")]
    ebc = EmbeddingBagCollection(configs)
    observer = PlaceholderObserver.with_args(dtype=torch.float32)
    ebc.qconfig = QConfig(activation=observer, weight=PlaceholderObserver.with_args(dtype=weight_dtype))
    quant = QuantEmbeddingBagCollection.from_float(ebc)
    assert [c.data_type for c in quant.embedding_bag_configs()] == [data_type] * 2
    assert quant.state_dict()["embedding_bags.a.weight"].shape == (2, width)
    ebc.qconfig = _QuantConfig(observer, PlaceholderObserver.with_args(dtype=torch.quint8), {"b": weight_dtype})
    quant = QuantEmbeddingBagCollection.from_float(ebc)
    assert [c.data_type for c in quant.embedding_bag_configs()] == [DataType.INT8, data_type]
    ebc.qconfig = _QuantConfig(observer, observer, {"a": torch.bfloat16})
    with pytest.raises(ValueError, match=r"module.qconfig.per_table_weight_dtype\['a'\] must be one of .*bfloat16"):
        QuantEmbeddingBagCollection.from_float(ebc)
