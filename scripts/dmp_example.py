"""The README's DistributedModelParallel example on 2 CPU processes (gloo): a DLRM built on ``meta`` is planned,
sharded and data-parallelised by DMP, trains a few steps, is checkpointed, and the checkpoint is loaded into the same
model re-sharded row-wise.

    python scripts/dmp_example.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan, row_wise
from tritonrec.dist.checkpoint import CheckpointManager
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from tritonrec.modules.dlrm import DLRM
from tritonrec.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter

TABLES = {"user": 100_000, "item": 20_000, "category": 100}


def build_model() -> DLRM:
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=16, name=name, feature_names=[name])
              for name, rows in TABLES.items()]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.05}, device="meta")
    return DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[32, 16], over_arch_layer_sizes=[32, 1],
                dense_device="meta")  # fmt: skip


def batch(step: int, rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(1, 4, (len(TABLES) * 64,), generator=g)
    counts = lengths.view(len(TABLES), -1).sum(1).tolist()
    values = torch.cat([torch.randint(0, r, (n,), generator=g) for r, n in zip(TABLES.values(), counts, strict=True)])
    kjt = KeyedJaggedTensor(list(TABLES), values, lengths=lengths)
    return torch.randn(64, 4, generator=g), kjt, torch.randint(0, 2, (64,), generator=g).float()


def run(rank: int, world: int, directory: str) -> None:
    # a file rendezvous: no port to pick (a free port probed and released can be taken before the ranks bind it)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    root = os.path.join(directory, "checkpoints")
    torch.set_num_threads(1)
    model = DistributedModelParallel(build_model(), device=torch.device("cpu"))  # planned: rank 0 prints its stats
    if rank == 0:
        print(model.plan, "\n")
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=1e-3))  # fmt: skip
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])  # one param_groups list for an LR schedule
    for step in range(5):
        dense_features, sparse_features, labels = batch(step, rank)
        logits = model(dense_features, sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()  # the tables update here (fused optimizer), DDP averages the dense gradients
        optimizer.step()
        optimizer.zero_grad()
    checkpoints = CheckpointManager(root)
    checkpoints.save(5, model, {"dense": dense}, {"data_position": 5 * 64 * world})

    # the same checkpoint in a model sharded another way (every table row-wise)
    resharded = build_model()
    ebc = resharded.sparse_arch.embedding_bag_collection
    path = "sparse_arch.embedding_bag_collection"
    plan = construct_module_sharding_plan(ebc, {name: row_wise() for name in TABLES}, world_size=world)
    resharded = DistributedModelParallel(resharded, plan=ShardingPlan({path: plan}))
    dense2 = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(resharded.named_parameters())),
                                   lambda params: torch.optim.Adam(params, lr=1e-3))  # fmt: skip
    loaded = checkpoints.load(resharded, {"dense": dense2}, {"data_position": 0})
    if rank == 0:
        print(f"\nsaved {sorted(os.listdir(root))} with {loaded.manifest['world_size']} ranks; loaded row-wise: "
              f"step {loaded.step}, {loaded.extra_state}, last loss {loss.item():.4f}")  # fmt: skip
    dist.barrier()  # no rank tears gloo down while the other still has traffic in flight (a rare SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="tritonrec-dmp-example-") as directory:
        torch.multiprocessing.spawn(run, args=(2, directory), nprocs=2)
