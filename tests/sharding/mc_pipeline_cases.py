"""Rank-side case for the sharded managed-collision EBC under the train pipelines: TrainPipelineSparseDist over a DMP
model holding it trains as TrainPipelineBase (run from :func:`tests.sharding.mc_cases.run_suite`, in its spawn)."""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.mc_cases import BATCH, Model, _batch, _local, _pooled, _slice, make_module


class _BatchModel(Model):
    """``(loss, output) = model(batch)``, a pipeline's model: the MC-EBC on ``batch.sparse_features``, a dense layer."""

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings, _ = self.mc(batch.sparse_features)
        prediction = self.dense(embeddings.values()).squeeze(-1)
        return ((prediction - batch.labels) ** 2).mean(), prediction.detach()


def pipeline_case(rank: int, world: int, sharder: Any) -> dict[str, Any]:
    """TrainPipelineSparseDist over a DMP model holding the MC-EBC pipelines its input dist and trains as
    TrainPipelineBase, bit for bit (the remap runs in compute, so prefetching the next input dist does not reorder
    the MCH updates)."""
    from tritonrec.data.batch import Batch
    from tritonrec.dist import DistributedModelParallel
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSemiSync, TrainPipelineSparseDist

    def data() -> Any:
        for step in range(8):
            lengths, values = _batch(step, world)
            g = torch.Generator().manual_seed(step * 10 + rank)
            yield Batch(torch.randn(BATCH, 5, generator=g), _slice(lengths, values, rank * BATCH, (rank + 1) * BATCH),
                        torch.rand(BATCH, generator=g), torch.ones(BATCH, dtype=torch.bool))  # fmt: skip

    out: dict[str, Any] = {}
    kinds = {
        "base": TrainPipelineBase,
        "sparse_dist": TrainPipelineSparseDist,
        # synchronous for all 8 batches (bit for bit as base), and stale from batch 3 on (it ran into a tuple)
        "semi_sync": lambda *a: TrainPipelineSemiSync(*a, start_batch=8),
        "semi_sync_stale": lambda *a: TrainPipelineSemiSync(*a, start_batch=2),
    }
    for name, kind in kinds.items():
        torch.manual_seed(4)
        dmp = DistributedModelParallel(
            _BatchModel(make_module(3), 11, _pooled), device=torch.device("cpu"), sharders=[sharder]
        )
        for sharding in dmp.module.mc._embedding_module.shardings:
            sharding.lookup.backend = "torch"
        pipeline = kind(dmp, torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1), torch.device("cpu"))
        batches, losses = data(), []
        while True:
            try:
                losses.append(float(pipeline.progress(batches)[0]))
            except StopIteration:
                break
        state = {k: _local(v).clone() for k, v in dmp.state_dict().items()}
        out[name] = {"losses": losses, "state": state, "pipelined": list(getattr(pipeline, "pipelined_modules", []))}
    base, piped, semi, stale = (out[k] for k in kinds)
    return {
        "losses_equal": base["losses"] == piped["losses"] and len(base["losses"]) == 8,
        "state_differs": [k for k in base["state"] if not torch.equal(base["state"][k], piped["state"][k])],
        "pipelined": piped["pipelined"],
        "semi_sync_equal": semi["losses"] == base["losses"]
        and all(torch.equal(base["state"][k], semi["state"][k]) for k in base["state"]),
        "semi_sync_pipelined": semi["pipelined"],
        "stale_losses": stale["losses"],
        "base_losses": base["losses"],
    }
