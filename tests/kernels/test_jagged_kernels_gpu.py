"""Compiled Triton kernels on CUDA vs the torch twins on CPU, at production-like sizes (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import KeyedJaggedTensor, kjt_is_equal
from tritonrec.kernels import (
    block_bucketize_sparse_features,
    dense_to_jagged,
    jagged_to_padded_dense,
    lengths_to_offsets,
    permute_2d_sparse_data,
)

pytestmark = pytest.mark.gpu


def _to_cpu(outputs: tuple) -> tuple:
    return tuple(None if t is None else t.cpu() for t in outputs)


def test_lengths_to_offsets_cuda() -> None:
    for n in (1, 4096, 1 << 20):
        lengths = torch.randint(0, 64, (n,), dtype=torch.int32)
        assert torch.equal(lengths_to_offsets(lengths.cuda()).cpu(), lengths_to_offsets(lengths))


def test_permute_and_bucketize_cuda() -> None:
    lengths = torch.randint(0, 40, (32, 512), dtype=torch.int32)
    values = torch.randint(0, 10**6, (int(lengths.sum()),))
    weights = torch.rand(values.numel())
    permute = torch.randperm(32).to(torch.int32)
    expected = permute_2d_sparse_data(permute, lengths, values, weights)
    got = permute_2d_sparse_data(permute.cuda(), lengths.cuda(), values.cuda(), weights.cuda(), backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(_to_cpu(got), expected, strict=True))

    flat = lengths.reshape(-1)
    block_sizes = torch.full((32,), 125_000)
    expected = block_bucketize_sparse_features(flat, values, block_sizes, 8, weights, True, True)
    got = block_bucketize_sparse_features(
        flat.cuda(), values.cuda(), block_sizes.cuda(), 8, weights.cuda(), True, True, backend="triton"
    )
    assert all(torch.equal(a, b) for a, b in zip(_to_cpu(got), expected, strict=True))


def test_jagged_dense_cuda() -> None:
    lengths = torch.randint(0, 50, (1024,))
    offsets = lengths_to_offsets(lengths)
    values = torch.randn(int(lengths.sum()), 129)
    dense = jagged_to_padded_dense(values, offsets, 40, -1.0)
    assert torch.equal(jagged_to_padded_dense(values.cuda(), offsets.cuda(), 40, -1.0, backend="triton").cpu(), dense)
    assert torch.equal(
        dense_to_jagged(dense.cuda(), offsets.cuda(), backend="triton").cpu(), dense_to_jagged(dense, offsets)
    )


def test_kjt_movement_cuda() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(8), torch.rand(8), lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    pinned = kjt.pin_memory()
    assert pinned.values().is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True)
    on_gpu.record_stream(torch.cuda.current_stream())
    assert kjt_is_equal(on_gpu.permute([1, 0]).to("cpu"), kjt.permute([1, 0]))
