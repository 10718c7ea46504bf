"""A small runnable tour of tritonrec's sparse layer (CPU is enough):

    python scripts/sparse_example.py

Builds a KeyedJaggedTensor, permutes its keys, buckets its ids for 2 row-wise shards, and pads one feature to dense,
printing each step. Every op runs its Triton kernel on CUDA (or under TRITON_INTERPRET=1) and its torch twin otherwise.
"""

from __future__ import annotations

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.kernels import block_bucketize_sparse_features, resolve_backend


def main() -> None:
    #              sample 0   sample 1   sample 2
    # "user_id"    [3, 12]    []         [7]
    # "item_id"    [1]        [9]        [4, 15, 2]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "item_id"],
        values=torch.tensor([3, 12, 7, 1, 9, 4, 15, 2]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 3]),
    )
    print(f"backend: {resolve_backend('auto', kjt.values())}")
    print("batch:", kjt)
    print("permuted:", kjt.permute([1, 0]))

    # Row-wise sharding of 16-row tables over 2 ranks: ids 0..7 live on rank 0, 8..15 on rank 1.
    new_lengths, new_ids, _, _, unbucketize = block_bucketize_sparse_features(
        kjt.lengths(), kjt.values(), block_sizes=torch.tensor([8, 8]), num_buckets=2, sequence=True
    )
    per_rank = new_lengths.view(2, -1)
    for rank, (lengths, ids) in enumerate(zip(per_rank, new_ids.split(per_rank.sum(1).tolist()), strict=True)):
        print(f"rank {rank}: lengths {lengths.tolist()} local ids {ids.tolist()}")
    print("unbucketize permutation:", unbucketize.tolist())
    print("item_id padded to 4:\n", kjt["item_id"].to_padded_dense(desired_length=4, padding_value=-1))


if __name__ == "__main__":
    main()
