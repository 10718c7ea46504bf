"""Row-wise codecs (FP8 E4M3/E5M2, INT8, MX4): the Triton kernels (interpreter on CPU) against their torch twins,
byte for byte, and the input checks every row-wise op shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.kernels.codecs import (
    dequantize_fp8_rowwise,
    dequantize_int8_rowwise,
    dequantize_mx4,
    fp8_row_bytes,
    int8_row_bytes,
    mx4_group_bytes,
    quantize_fp8_rowwise,
    quantize_int8_rowwise,
    quantize_mx4,
)


@dataclass(frozen=True)
class RowFormat:
    quantize: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]
    unit_bytes: Callable[[int], int]
    extra: dict = field(default_factory=dict)
    even_rows: bool = False

    def encode(self, x: torch.Tensor, rows: int, backend: str, **kwargs: object) -> torch.Tensor:
        return self.quantize(x, rows, **self.extra, backend=backend, **kwargs)

    def decode(self, q: torch.Tensor, rows: int, backend: str, **kwargs: object) -> torch.Tensor:
        return self.dequantize(q, rows, **self.extra, backend=backend, **kwargs)


FORMATS = {
    "fp8_e4m3": RowFormat(quantize_fp8_rowwise, dequantize_fp8_rowwise, fp8_row_bytes, {"fmt": "e4m3"}),
    "fp8_e5m2": RowFormat(quantize_fp8_rowwise, dequantize_fp8_rowwise, fp8_row_bytes, {"fmt": "e5m2"}),
    "int8": RowFormat(quantize_int8_rowwise, dequantize_int8_rowwise, int8_row_bytes),
    "mx4": RowFormat(quantize_mx4, dequantize_mx4, mx4_group_bytes, even_rows=True),
}
# (shape, row_dim): 1-D inputs of whole rows, 2-D inputs with padded last groups, odd sizes, empty inputs.
SHAPES = [
    ((96,), 32),
    ((0,), 32),
    ((1, 1), 2),
    ((3, 7), 4),
    ((5, 33), 32),
    ((4, 64), 32),
    ((2, 129), 64),
    ((0, 5), 8),
    ((6, 3), 6),
    ((2, 40), 10),
]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(("shape", "rows"), SHAPES, ids=[f"{s}-r{r}" for s, r in SHAPES])
def test_kernel_encode_matches_twin_bytes(name, stochastic, shape, rows, values, same_bits):
    fmt = FORMATS[name]
    x = values(shape, seed=len(shape) * 100 + rows)
    kernel = fmt.encode(x, rows, "triton", stochastic_rounding=stochastic, seed=7)
    twin = fmt.encode(x, rows, "torch", stochastic_rounding=stochastic, seed=7)
    same_bits(kernel, twin)
    groups = (shape[0] // rows) if len(shape) == 1 else shape[0] * -(-shape[1] // rows)
    assert kernel.numel() == groups * fmt.unit_bytes(rows)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("scale", [1e-39, 1e-30, 1.0, 5e37], ids=["denormal", "tiny", "unit", "huge"])
def test_kernel_matches_twin_across_magnitudes(name, scale, same_bits):
    fmt = FORMATS[name]
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * scale
    x[0] = 0.0  # zero row
    x[1] = -2.5 * scale  # constant row
    for stochastic in (False, True):
        same_bits(
            fmt.encode(x, 32, "triton", stochastic_rounding=stochastic),
            fmt.encode(x, 32, "torch", stochastic_rounding=stochastic),
        )


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_decode_matches_twin(name, output_dtype, values, same_bits):
    fmt = FORMATS[name]
    encoded = fmt.encode(values((5, 48), seed=11), 16, "torch")
    same_bits(
        fmt.decode(encoded, 16, "triton", output_dtype=output_dtype),
        fmt.decode(encoded, 16, "torch", output_dtype=output_dtype),
    )
    # Arbitrary bytes, as a peer might send: every code, NaN/Inf scales, any E8M0 byte. A 1-byte offset view checks
    # that decoding reads scales byte by byte (the wire buffer need not be 4-byte aligned).
    noise = torch.randint(
        0, 256, (1 + 7 * fmt.unit_bytes(16),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    same_bits(
        fmt.decode(noise[1:], 16, "triton", output_dtype=output_dtype),
        fmt.decode(noise[1:], 16, "torch", output_dtype=output_dtype),
    )


@given(
    name=st.sampled_from(sorted(FORMATS)),
    rows=st.integers(0, 5),
    cols=st.integers(1, 70),
    row_dim=st.sampled_from([2, 4, 6, 8, 16, 32, 34]),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_kernel_matches_twin_hypothesis(name, rows, cols, row_dim, stochastic, seed, data, same_bits):
    fmt = FORMATS[name]
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
    x = torch.tensor(data.draw(st.lists(floats, min_size=rows * cols, max_size=rows * cols)), dtype=torch.float32)
    x = x.reshape(rows, cols)
    kernel = fmt.encode(x, row_dim, "triton", stochastic_rounding=stochastic, seed=seed)
    twin = fmt.encode(x, row_dim, "torch", stochastic_rounding=stochastic, seed=seed)
    same_bits(kernel, twin)
    same_bits(fmt.decode(kernel, row_dim, "triton"), fmt.decode(twin, row_dim, "torch"))


@pytest.mark.parametrize("name", list(FORMATS))
def test_padded_rows_decode_to_zero(name):
    """A 2-D input's last group is zero-padded: the real columns come first and the padding decodes to zero (for
    INT8, whose grid need not hold 0, to within half a step of the group's range)."""
    fmt = FORMATS[name]
    x = torch.randn(3, 10)
    decoded = fmt.decode(fmt.encode(x, 8, "torch"), 8, "torch")
    assert decoded.shape == (3, 16)
    last_group = torch.nn.functional.pad(x[:, 8:], (0, 6))
    half_step = (last_group.amax(1) - last_group.amin(1)) / 510 if name == "int8" else torch.zeros(3)
    assert bool((decoded[:, 10:].abs() <= half_step[:, None] * 1.0001).all())
    assert float((decoded[:, :10] - x).abs().max()) < 0.5 * float(x.abs().max())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stochastic_rounding_depends_on_seed_only(name, backend):
    fmt = FORMATS[name]
    x = torch.randn(4, 32)
    first = fmt.encode(x, 32, backend, stochastic_rounding=True, seed=5)
    assert torch.equal(first, fmt.encode(x, 32, backend, stochastic_rounding=True, seed=5))
    assert not torch.equal(first, fmt.encode(x, 32, backend, stochastic_rounding=True, seed=6))


@pytest.mark.parametrize("name", list(FORMATS))
def test_bad_inputs_raise_naming_the_argument(name):
    fmt = FORMATS[name]
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="input"):
        fmt.encode(x.double(), 32, "torch")
    with pytest.raises(TypeError, match="input"):
        fmt.encode([1.0] * 32, 32, "torch")
    with pytest.raises(ValueError, match="input"):
        fmt.encode(torch.randn(2, 2, 32), 32, "torch")
    with pytest.raises(ValueError, match="row_dim|group_size"):
        fmt.encode(x, 0, "torch")
    with pytest.raises(ValueError, match="row_dim|group_size"):
        fmt.encode(x, 1 << 20, "torch")
    with pytest.raises(TypeError, match="row_dim|group_size"):
        fmt.encode(x, 32.0, "torch")
    with pytest.raises(ValueError, match="not a multiple of row_dim=32.*padded_size"):
        fmt.encode(torch.randn(40), 32, "torch")
    with pytest.raises(ValueError, match="seed"):
        fmt.encode(x, 32, "torch", seed=-1)
    with pytest.raises(TypeError, match="seed"):
        fmt.encode(x, 32, "torch", seed=1.5)
    with pytest.raises(ValueError, match="nonfinite"):
        fmt.encode(x, 32, "torch", nonfinite="ignore")
    encoded = fmt.encode(x, 32, "torch")
    with pytest.raises(TypeError, match="output_dtype"):
        fmt.decode(encoded, 32, "torch", output_dtype=torch.float64)
    with pytest.raises(TypeError, match="input"):
        fmt.decode(encoded.to(torch.int8), 32, "torch")
    with pytest.raises(ValueError, match="input must hold whole"):
        fmt.decode(encoded.reshape(-1)[:-1], 32, "torch")
    if fmt.even_rows:
        with pytest.raises(ValueError, match="group_size must be an even int"):
            fmt.encode(x, 7, "torch")


@pytest.mark.parametrize("name", list(FORMATS))
def test_nonfinite_raise_policy_names_the_input(name):
    fmt = FORMATS[name]
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="input"):
        fmt.encode(x, 32, "torch", nonfinite="raise")
    x[1, 3] = 1.0
    assert fmt.encode(x, 32, "torch", nonfinite="raise").shape == fmt.encode(x, 32, "torch").shape


@pytest.mark.parametrize("name", list(FORMATS))
def test_groups_wider_than_a_tile_go_chunk_by_chunk(name, same_bits):
    """Past ELEMS (2048) columns a program walks its group in chunks (scale from all of them, then the codes): bytes
    equal the twin's when a group's largest value, a NaN or an Inf sits in its second chunk, and for the zero-padded
    last group of a row."""
    fmt = FORMATS[name]
    row_dim = 2100  # two chunks of 2048 columns, the second mostly padding
    x = torch.randn(3, row_dim + 4, generator=torch.Generator().manual_seed(1)) * 0.01
    x[0, row_dim - 3] = 40.0
    x[1, row_dim - 10] = float("nan")
    x[2, 2050] = float("-inf")
    for stochastic in (False, True):
        kernel = fmt.encode(x, row_dim, "triton", stochastic_rounding=stochastic, seed=9)
        twin = fmt.encode(x, row_dim, "torch", stochastic_rounding=stochastic, seed=9)
        same_bits(kernel, twin)
    same_bits(fmt.decode(kernel, row_dim, "triton"), fmt.decode(twin, row_dim, "torch"))
