"""lengths_to_offsets and jagged <-> padded dense: Triton (interpreter) vs twin, bit-exact; autograd both ways."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jagged_strategies import jagged_values

from tritonrec.kernels import (
    dense_to_jagged,
    dense_to_jagged_reference,
    jagged_to_padded_dense,
    jagged_to_padded_dense_reference,
    lengths_to_offsets,
    lengths_to_offsets_reference,
    offsets_to_lengths,
)
from tritonrec.kernels.lengths_to_offsets import _lengths_to_offsets_triton


def _offsets(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return lengths_to_offsets_reference(torch.tensor(lengths, dtype=dtype))


# ------------------------------------------------------------------------------------------------ lengths_to_offsets
def test_lengths_to_offsets_example() -> None:
    lengths = torch.tensor([2, 0, 1, 1, 1, 3], dtype=torch.int32)
    for backend in ("triton", "torch"):
        out = lengths_to_offsets(lengths, backend=backend)
        assert out.dtype == torch.int32
        assert out.tolist() == [0, 2, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("n", [0, 1, 3, 1025, 5000])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_lengths_to_offsets_matches_twin(n: int, dtype: torch.dtype) -> None:
    lengths = torch.randint(0, 50, (n,), dtype=dtype)
    expected = lengths_to_offsets_reference(lengths)
    assert torch.equal(lengths_to_offsets(lengths, backend="triton"), expected)
    # the three-launch path (block totals, scan of totals, block scans) on the same input
    assert torch.equal(_lengths_to_offsets_triton(lengths, multi_block_threshold=8), expected)
    assert torch.equal(offsets_to_lengths(expected), lengths)


@pytest.mark.parametrize("shape", [(3, 5), (1, 1), (0, 4), (2, 0)])
def test_lengths_to_offsets_2d(shape: tuple[int, int]) -> None:
    lengths = torch.randint(0, 9, shape)
    out = lengths_to_offsets(lengths, backend="triton")
    assert out.shape == (shape[0], shape[1] + 1)
    assert torch.equal(out, lengths_to_offsets_reference(lengths))
    if shape[0]:
        assert torch.equal(out[-1], lengths_to_offsets_reference(lengths[-1]))


def test_lengths_to_offsets_bad_input() -> None:
    with pytest.raises(ValueError, match="lengths must have 1 or 2 dimension"):
        lengths_to_offsets(torch.zeros(2, 2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="lengths must be a torch.Tensor"):
        lengths_to_offsets([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offsets must hold at least one entry"):
        offsets_to_lengths(torch.empty(0, dtype=torch.int64))


# ------------------------------------------------------------------------------------------- jagged <-> padded dense
def test_to_padded_dense_torchrec_example() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    offsets = torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)
    expected = [[1.0, 2.0], [10.0, 10.0], [3.0, 10.0], [4.0, 10.0], [5.0, 10.0], [6.0, 7.0]]
    for backend in ("triton", "torch"):
        assert jagged_to_padded_dense(values, offsets, 2, padding_value=10.0, backend=backend).tolist() == expected


@given(jagged_values(), st.integers(0, 7), st.sampled_from([0.0, -1.5, 7.0]))
def test_jagged_to_padded_dense_matches_twin(case: tuple[torch.Tensor, torch.Tensor], max_len: int, pad: float) -> None:
    values, offsets = case
    out = jagged_to_padded_dense(values, offsets, max_len, pad, backend="triton")
    assert torch.equal(out, jagged_to_padded_dense_reference(values, offsets, max_len, pad))
    assert out.shape == (offsets.numel() - 1, max_len, *values.shape[1:])


@given(jagged_values(), st.integers(0, 7))
def test_dense_to_jagged_matches_twin(case: tuple[torch.Tensor, torch.Tensor], dense_len: int) -> None:
    values, offsets = case
    dense = torch.randn(offsets.numel() - 1, dense_len, *values.shape[1:])
    total = int(offsets[-1])
    out = dense_to_jagged(dense, offsets, backend="triton")
    assert torch.equal(out, dense_to_jagged_reference(dense, offsets, total))
    # a round trip restores every value that fits in the dense length and zeroes the rest
    round_trip = dense_to_jagged(jagged_to_padded_dense(values, offsets, dense_len, backend="triton"), offsets)
    position = torch.arange(total) - torch.repeat_interleave(offsets[:-1], offsets[1:] - offsets[:-1])
    fits = (position < dense_len).reshape(-1, *([1] * (values.dim() - 1)))
    assert torch.equal(round_trip, torch.where(fits, values, torch.zeros_like(values)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.float64])
def test_jagged_to_padded_dense_dtypes(dtype: torch.dtype) -> None:
    offsets = _offsets([3, 0, 2])
    values = (torch.randn(5, 3) * 100).to(dtype)
    for pad in (0.1, -7.0):
        expected = jagged_to_padded_dense_reference(values, offsets, 4, pad)
        assert torch.equal(jagged_to_padded_dense(values, offsets, 4, pad, backend="triton"), expected)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_jagged_dense_gradients(backend: str) -> None:
    """Each op's backward is the other op: grads equal autograd through an index-based formulation."""
    offsets = _offsets([2, 0, 4, 1])
    values = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    dense = jagged_to_padded_dense(values, offsets, 3, padding_value=5.0, backend=backend)
    weight = torch.randn_like(dense)
    (dense * weight).sum().backward()
    # value i of bag b at position j < 3 receives weight[b, j]; positions >= 3 were truncated and get 0
    expected = torch.zeros(7, 3, dtype=torch.float64)
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        for j in range(min(end - start, 3)):
            expected[start + j] = weight[b, j]
    assert torch.equal(values.grad, expected)

    dense_in = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d: dense_to_jagged(d, offsets, 7, backend=backend), (dense_in,))
    values_in = torch.randn(7, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: jagged_to_padded_dense(v, offsets, 3, backend=backend), (values_in,))


def test_jagged_dense_bad_input() -> None:
    values, offsets = torch.randn(5), _offsets([2, 3])
    with pytest.raises(ValueError, match="max_len must be a non-negative int, got max_len=-1"):
        jagged_to_padded_dense(values, offsets, -1)
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 5 exceeds the number of values \(4\)"):
        jagged_to_padded_dense(values[:4], offsets, 2)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        jagged_to_padded_dense(values, torch.tensor([0, 3, 2]), 2)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        jagged_to_padded_dense(values, torch.tensor([1, 3, 5]), 2)
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        jagged_to_padded_dense(values, offsets.float(), 2)
    with pytest.raises(ValueError, match="values must have 1 or 2 dimension"):
        jagged_to_padded_dense(torch.randn(5, 2, 2), offsets, 2)
    with pytest.raises(ValueError, match="offsets must have B \\+ 1 = 3 entries"):
        dense_to_jagged(torch.randn(2, 4), _offsets([1, 1, 1]))
    with pytest.raises(ValueError, match="offsets must end at 9"):
        dense_to_jagged(torch.randn(2, 4), offsets, total_len=9)
    with pytest.raises(ValueError, match="total_len must be a non-negative int"):
        dense_to_jagged(torch.randn(2, 4), offsets, total_len=-2)
