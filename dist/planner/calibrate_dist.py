"""What ``calibrate`` measures through the sharded modules' own code on its spawned ranks: the sparse input dist
(``KJTAllToAll`` and the row-wise bucketizing) and the per-group fixed cost of each sharding type (a tiny group's
training step through ``DistributedModelParallel``). See :mod:`~tritonrec.dist.planner.calibrate`."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.planner.calibrate_fit import fit_nonnegative, median_s
from tritonrec.dist.planner.calibration import InputDistCoefficients

__all__ = ["GROUP_TABLE", "measure_group_steps", "measure_input_dist"]


def measure_input_dist(
    pg: dist.ProcessGroup | None, device: torch.device, id_counts: tuple[int, ...], repeats: int = 5
) -> InputDistCoefficients:
    """On every rank of ``pg``: time the sparse ``KJTAllToAll`` (one key per rank, ``n`` ids each, pooling 8) and the
    row-wise bucketizing of ``n`` ids into ``W`` blocks; fit fixed cost + per-id cost of each (see module
    docstring; the all-to-all's per-id cost is what remains after its wire bytes at the all-to-all rate)."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist.dist_data import KJTAllToAll
    from tritonrec.kernels import block_bucketize_sparse_features

    group = pg if pg is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    a2a = KJTAllToAll(group, [1] * world)
    gen = torch.Generator().manual_seed(dist.get_rank(group))
    received, a2a_s, bucketize_s = [], [], []
    rows = 1 << 20
    for n in id_counts:
        bags = max(1, n // 8)
        kjts = [
            KeyedJaggedTensor(
                keys=[f"f{r}" for r in range(world)],
                values=torch.randint(0, rows, (world * n,), generator=gen).to(device),
                lengths=torch.full((world * bags,), n // bags, dtype=torch.int64, device=device),
            )
            for _ in range(repeats + 1)
        ]
        a2a_s.append(median_s(lambda i, kjts=kjts: a2a(kjts[i]).wait().wait(), repeats, device, barrier=True))
        received.append(float(world * (n // bags) * bags))
        sizes = torch.full((world,), (rows + world - 1) // world, dtype=torch.int64, device=device)

        def bucketize(i: int, kjts: list[Any] = kjts, sizes: torch.Tensor = sizes) -> None:
            block_bucketize_sparse_features(kjts[i].lengths(), kjts[i].values(), sizes, world)

        bucketize_s.append(median_s(bucketize, repeats, device))
    latency, per_id = fit_nonnegative([[1.0] * len(received), received], a2a_s, relative=True)
    call, bucketize_id = fit_nonnegative([[1.0] * len(received), received], bucketize_s, relative=True)
    return InputDistCoefficients(latency, per_id, call, bucketize_id)


GROUP_TABLE = (64, 8, 8)  # rows, dim, samples per rank of the tiny group timed per sharding type (pooling 1)


class _OneTable(torch.nn.Module):
    """The model of the group timing: one ``EmbeddingBagCollection`` (``ebc``)."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features: Any) -> Any:
        return self.ebc(features)


def _group_generator(kind: str, world: int) -> Any:
    from tritonrec.dist import sharding_plan as sp

    ranks = list(range(world))
    return {
        "data_parallel": lambda: sp.data_parallel(),
        "table_wise": lambda: sp.table_wise(rank=0),
        "column_wise": lambda: sp.column_wise(ranks=ranks),
        "row_wise": lambda: sp.row_wise(),
        "table_row_wise": lambda: sp.table_row_wise(host_index=0),
        "table_column_wise": lambda: sp.table_column_wise(ranks=ranks),
        "grid_shard": lambda: sp.grid_shard(host_indexes=[0]),
    }[kind]()


def measure_group_steps(
    device: torch.device, repeats: int = 9, kinds: tuple[str, ...] | None = None
) -> dict[str, tuple[float, float]]:
    """On every rank of the default group (one host): per sharding type (``kinds``, default every type the sharder
    offers), the median forward and backward seconds (slowest rank) of a training step of a tiny one-table
    ``EmbeddingBagCollection`` sharded that way through ``DistributedModelParallel`` (fused rowwise Adagrad): the
    group's fixed cost (see calibration.py). A type the sharder cannot build here is left out (the planner then
    sums latencies for it)."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist import DistributedModelParallel, EmbeddingBagCollectionSharder, ShardingPlan
    from tritonrec.dist.sharding_plan import construct_module_sharding_plan
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig

    world = dist.get_world_size()
    rows, dim, batch = GROUP_TABLE
    # column-wise types split the table into one equal block per rank: a width every world size divides (8 at 2 or 4
    # ranks, 24 at 3), or they could not be built at an odd world size and would silently go untimed
    dim = math.lcm(dim, world)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": 0.01})
    gen = torch.Generator().manual_seed(dist.get_rank())
    kjts = [
        KeyedJaggedTensor(["f"], torch.randint(0, rows, (batch,), generator=gen), lengths=torch.ones(batch).long())
        for _ in range(repeats + 3)
    ]
    grad = torch.ones(batch, dim, device=device)
    models = {}
    for kind in kinds or sharder.sharding_types(device.type):
        config = EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name="t", feature_names=["f"])
        holder = _OneTable(EmbeddingBagCollection([config], device="meta"))
        try:
            gens = {"t": _group_generator(kind, world)}
            plan = construct_module_sharding_plan(holder.ebc, gens, sharder, world, world, device.type)
            for sharding in plan.values():
                sharding.compute_kernel = "fused"
            models[kind] = DistributedModelParallel(
                holder, device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
            )
        except (ValueError, NotImplementedError, KeyError):  # same verdict on every rank: skip the type
            continue
    # every type stepped once per round, in rotating order: load drifting during the sweep hits every type alike
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in models}
    kinds = list(models)
    for round_, kjt in enumerate(kjts):
        shift = round_ % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            dist.barrier()
            start = time.perf_counter()
            values = models[kind](kjt.to(device)).values()
            middle = time.perf_counter()
            values.backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            fwd, bwd = _all_max([middle - start, time.perf_counter() - middle])
            if round_ >= 3:  # warm-up rounds: allocation, first touches
                times[kind].append((fwd, bwd))
    return {
        kind: (statistics.median(t for t, _ in ts), statistics.median(t for _, t in ts)) for kind, ts in times.items()
    }


def _all_max(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
