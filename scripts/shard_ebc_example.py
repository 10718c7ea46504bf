"""The README's sharding example: an EmbeddingBagCollection sharded table-wise (t0) and row-wise (t1) over 2 CPU
processes (gloo), one training step with a fused rowwise Adagrad.

    python scripts/shard_ebc_example.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import (
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig


def run(rank: int, world: int, rendezvous: str) -> None:
    # a file rendezvous: no port to pick (a free port probed and released can be taken before the ranks bind it)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    tables = [
        EmbeddingBagConfig(num_embeddings=1000, embedding_dim=16, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables, device="meta")  # nothing is materialised before sharding
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": "EXACT_ROWWISE_ADAGRAD", "lr": 0.05})
    plan = construct_module_sharding_plan(
        ebc, {"t0": table_wise(rank=1), "t1": row_wise()}, sharder, world, world, "cpu"
    )
    model = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 7, 999, 3]), lengths=torch.tensor([2, 0, 1, 1]))
    pooled = model(kjt).wait()  # KeyedTensor [2, 32]: this rank's 2 samples, keys f0, f1
    pooled.values().sum().backward()  # the fused optimizer updates this rank's shards in place
    if rank == 0:
        print(plan, "\n\nrank 0 pooled:", tuple(pooled.values().shape))
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="tritonrec-shard-example-") as directory:
        torch.multiprocessing.spawn(run, args=(2, os.path.join(directory, "rendezvous")), nprocs=2)
