"""Independent references for the ops' forwards and gradients: plain per-bag Python loops and
``torch.autograd.gradcheck`` in float64 on the torch twins, so that a mistake shared by a kernel and its twin fails.

Each differentiable op is checked on both backends (``triton`` runs the kernels under the interpreter on CPU),
including ``values`` that carry rows past ``offsets[-1]`` (never read, so their gradient is zero).
"""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels import (
    block_bucketize_sparse_features,
    dense_to_jagged,
    dequantize_half,
    jagged_to_padded_dense,
    lengths_to_offsets,
    permute_2d_sparse_data,
    quantize_half,
)

BACKENDS = ["torch", "triton"]
BAG_LENGTHS = [2, 0, 4, 1, 3]  # an empty bag, a bag longer than MAX_LEN, one exactly MAX_LEN long
MAX_LEN = 3
EXTRA_ROWS = 2  # rows of values past offsets[-1]


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out)


def _padded_loop(values: torch.Tensor, lengths: list[int], max_len: int, pad: float) -> torch.Tensor:
    """Bag b's row j is values[start_b + j] for j < min(len_b, max_len), else the padding value."""
    out = torch.full((len(lengths), max_len, *values.shape[1:]), pad, dtype=values.dtype)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(min(n, max_len)):
            out[b, j] = values[start + j]
        start += n
    return out


def _jagged_loop(dense: torch.Tensor, lengths: list[int], num_rows: int) -> torch.Tensor:
    """Value j of bag b is dense[b, j] while j < S, zero past the dense length and past the last bag."""
    out = torch.zeros((num_rows, *dense.shape[2:]), dtype=dense.dtype)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(min(n, dense.shape[1])):
            out[start + j] = dense[b, j]
        start += n
    return out


def test_lengths_to_offsets_is_a_running_total() -> None:
    lengths = torch.tensor([[3, 0, 2, 5], [0, 0, 1, 0]])
    for row, out in zip(lengths.tolist(), lengths_to_offsets(lengths).tolist(), strict=True):
        total, expected = 0, [0]
        for n in row:
            total += n
            expected.append(total)
        assert out == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", [(), (2,)], ids=["1d", "2d"])
def test_jagged_to_padded_dense_forward_and_gradient_against_a_loop(backend: str, feature: tuple[int, ...]) -> None:
    num_rows = sum(BAG_LENGTHS) + EXTRA_ROWS
    values = torch.randn(num_rows, *feature, dtype=torch.float64, requires_grad=True)
    dense = jagged_to_padded_dense(values, _offsets(BAG_LENGTHS), MAX_LEN, padding_value=-2.5, backend=backend)
    assert torch.equal(dense, _padded_loop(values.detach(), BAG_LENGTHS, MAX_LEN, -2.5))
    grad_dense = torch.randn_like(dense)
    dense.backward(grad_dense)
    # the gradient of a values row is the dense cell it was copied to; truncated rows and the extra rows get zero
    assert values.grad.shape == values.shape
    assert torch.equal(values.grad, _jagged_loop(grad_dense, BAG_LENGTHS, num_rows))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_to_jagged_forward_and_gradient_against_a_loop(backend: str) -> None:
    dense = torch.randn(len(BAG_LENGTHS), MAX_LEN, 2, dtype=torch.float64, requires_grad=True)
    offsets = _offsets(BAG_LENGTHS)
    values = dense_to_jagged(dense, offsets, backend=backend)
    assert torch.equal(values, _jagged_loop(dense.detach(), BAG_LENGTHS, sum(BAG_LENGTHS)))
    grad_values = torch.randn_like(values)
    values.backward(grad_values)
    assert torch.equal(dense.grad, _padded_loop(grad_values, BAG_LENGTHS, MAX_LEN, 0.0))


def test_jagged_dense_gradcheck_with_extra_rows() -> None:
    offsets = _offsets(BAG_LENGTHS)
    values = torch.randn(sum(BAG_LENGTHS) + EXTRA_ROWS, 2, dtype=torch.float64, requires_grad=True)
    pad = lambda v: jagged_to_padded_dense(v, offsets, MAX_LEN, backend="torch")
    unpad = lambda d: dense_to_jagged(d, offsets, backend="torch")
    dense = torch.randn(len(BAG_LENGTHS), MAX_LEN, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(pad, (values,)) and torch.autograd.gradcheck(unpad, (dense,))
    # second order (each backward is the other op): a random projection is enough, at a fraction of the cost
    assert torch.autograd.gradgradcheck(pad, (values,), fast_mode=True)
    assert torch.autograd.gradgradcheck(unpad, (dense,), fast_mode=True)


def _permute_loop(permute: list[int], lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Output key k is input key permute[k]: its rows copied in order."""
    starts = [0]
    for t in range(lengths.shape[0]):
        starts.append(starts[-1] + int(lengths[t].sum()))
    return torch.cat([rows[starts[k] : starts[k + 1]] for k in permute])


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_gradient_adds_repeated_keys_and_zeroes_dropped_ones(backend: str) -> None:
    lengths = torch.tensor([[1, 2], [0, 3], [2, 0]])
    permute = [2, 0, 2]  # key 2 twice, key 1 dropped
    num_rows = int(lengths.sum()) + EXTRA_ROWS
    values = torch.randn(num_rows, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(num_rows, dtype=torch.float64, requires_grad=True)
    out_lengths, out_values, out_weights = permute_2d_sparse_data(
        torch.tensor(permute), lengths, values, weights, backend=backend
    )
    assert torch.equal(out_lengths, lengths[permute])
    assert torch.equal(out_values, _permute_loop(permute, lengths, values.detach()))
    grad_values, grad_weights = torch.randn_like(out_values), torch.randn_like(out_weights)
    torch.autograd.backward([out_values, out_weights], [grad_values, grad_weights])
    expected_values, expected_weights = torch.zeros_like(values), torch.zeros_like(weights)
    key_start = [0, 3, 6]  # input rows of keys 0, 1, 2
    row = 0
    for k in permute:
        for j in range(int(lengths[k].sum())):
            expected_values[key_start[k] + j] += grad_values[row]
            expected_weights[key_start[k] + j] += grad_weights[row]
            row += 1
    assert torch.equal(values.grad, expected_values) and torch.equal(weights.grad, expected_weights)
    check = lambda v, w: permute_2d_sparse_data(torch.tensor(permute), lengths, v, w, backend="torch")[1:]
    assert torch.autograd.gradcheck(check, (values.detach().requires_grad_(), weights.detach().requires_grad_()))


def _bucket_loop(lengths: list[int], indices: list[int], block_sizes: list[int], num_buckets: int) -> list[int]:
    """Output position of every input index: FBGEMM's bucket rule, outputs ordered (bucket, feature, sample, order
    in the bag)."""
    batch = len(lengths) // len(block_sizes)
    keyed, position = [], 0
    for bag, n in enumerate(lengths):
        size = block_sizes[bag // batch]
        for _ in range(n):
            idx = indices[position]
            bucket = idx // size if idx < size * num_buckets else idx % num_buckets
            keyed.append((bucket, bag, position))
            position += 1
    order = sorted(keyed)  # bag then position break ties: bags are already (feature, sample) ordered
    out = [0] * len(indices)
    for output_position, (_, _, input_position) in enumerate(order):
        out[input_position] = output_position
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_bucketize_weights_gradient_against_a_loop(backend: str) -> None:
    lengths, block_sizes, num_buckets = [2, 0, 3, 1, 2, 1], [4, 3], 3
    indices = [5, 0, 11, 2, 7, 3, 20, 4, 1]
    weights = torch.randn(len(indices), dtype=torch.float64, requires_grad=True)
    args = (torch.tensor(lengths), torch.tensor(indices), torch.tensor(block_sizes), num_buckets)
    _, _, new_weights, _, _ = block_bucketize_sparse_features(*args, weights=weights, backend=backend)
    position = _bucket_loop(lengths, indices, block_sizes, num_buckets)
    assert torch.equal(new_weights[position], weights.detach())
    grad = torch.randn_like(new_weights)
    new_weights.backward(grad)
    assert torch.equal(weights.grad, grad[position])
    check = lambda w: block_bucketize_sparse_features(*args, weights=w, backend="torch")[2]
    assert torch.autograd.gradcheck(check, (weights.detach().requires_grad_(),))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_half_codec_gradients_are_those_of_torch_casts(backend: str, fmt: str) -> None:
    """Straight-through, as autograd through ``(x * s).to(half)`` and ``codes.float() / s``."""
    x = torch.randn(5, 3, requires_grad=True)
    codes = quantize_half(x, fmt, loss_scale=8.0, backend=backend)
    grad_codes = torch.randn(5, 3).to(codes.dtype)
    codes.backward(grad_codes)
    x_ref = x.detach().requires_grad_()
    (x_ref * 8.0).to(codes.dtype).backward(grad_codes)
    assert torch.equal(x.grad, x_ref.grad)

    codes = codes.detach().requires_grad_()
    decoded = dequantize_half(codes, loss_scale=8.0, backend=backend)
    grad_decoded = torch.randn(5, 3)
    decoded.backward(grad_decoded)
    codes_ref = codes.detach().requires_grad_()
    (codes_ref.float() / 8.0).backward(grad_decoded)
    assert torch.equal(codes.grad, codes_ref.grad)
