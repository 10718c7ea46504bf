"""The codec contract over a real collective: a pooled all-to-all on 2 gloo ranks, written against the protocol alone
(padded_size, encode, calc_quantized_size, all_to_all_single on the wire dtype, decode, slicing), for every format.

Each rank must receive exactly what a single process gets by encoding and decoding each peer's block on its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec

pytestmark = pytest.mark.dist

PRECISIONS = [CommType.FP16, CommType.BF16, CommType.FP8, CommType.INT8, CommType.MX4]
BATCH_PER_RANK = [3, 5]
DIM_PER_RANK = [40, 7]


def _local_input(rank: int) -> torch.Tensor:
    """This rank's pooled embeddings: all samples' rows, its own (table-wise sharded) columns."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(sum(BATCH_PER_RANK), DIM_PER_RANK[rank], generator=generator)


def _pooled_all_to_all(codec: TritonQuantizedCommCodec, rank: int, world: int) -> torch.Tensor:
    local = _local_input(rank)
    ctx = codec.create_context()
    padded_dim, padding = codec.padded_size(local, DIM_PER_RANK, rank, ctx)
    wire = codec.encode(local if padding else local.reshape(-1), ctx).reshape(-1)
    padded_dims = ctx.padded_dim_sum_per_rank or DIM_PER_RANK
    send = [codec.calc_quantized_size(b * padded_dim, ctx) for b in BATCH_PER_RANK]
    recv = [codec.calc_quantized_size(BATCH_PER_RANK[rank] * d, ctx) for d in padded_dims]
    received = wire.new_empty(sum(recv))
    dist.all_to_all_single(received, wire, recv, send)
    values = codec.decode(received, ctx).split([BATCH_PER_RANK[rank] * d for d in padded_dims])
    parts = [
        v.reshape(BATCH_PER_RANK[rank], p)[:, :d] for v, p, d in zip(values, padded_dims, DIM_PER_RANK, strict=True)
    ]
    return torch.cat(parts, dim=1)


def _all_formats(rank: int, world: int) -> dict[str, list[list[float]]]:
    # Plain lists: a tensor would travel back as a shared-memory handle that dies with the rank's process.
    return {
        str(p): _pooled_all_to_all(TritonQuantizedCommCodec(p, backend="torch"), rank, world).tolist()
        for p in PRECISIONS
    }


def test_pooled_all_to_all_over_gloo() -> None:
    results = run_ranks(_all_formats, 2)
    offsets = [0, BATCH_PER_RANK[0]]
    for precision in PRECISIONS:
        codec = TritonQuantizedCommCodec(precision, backend="torch")
        for rank in range(2):
            rows = slice(offsets[rank], offsets[rank] + BATCH_PER_RANK[rank])
            expected = []
            for peer in range(2):
                block = _local_input(peer)[rows]
                ctx = codec.create_context()
                expected.append(codec.unpad(codec.decode(codec.encode(block, ctx), ctx), block.shape, ctx))
            received = torch.tensor(results[rank][str(precision)], dtype=torch.float32)
            assert torch.equal(received, torch.cat(expected, dim=1)), (precision, rank)
