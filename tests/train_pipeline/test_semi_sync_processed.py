"""TrainPipelineSemiSync over a sharded FeatureProcessedEmbeddingBagCollection (position-weighted features, as
torchrec's DLRM v2), 2 gloo ranks: once the lookups run one step ahead, the position weights that batch ``i + 1``'s
lookup read are changed in place by batch ``i``'s optimizer step before its output is waited for. That crashed
(autograd refused the all-reduced view of the weights used after the in-place step); now it trains: bit for bit as
TrainPipelineSparseDist before ``start_batch``, and the replicated position weights stay equal on every rank after.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.spawned import spawn_ranks

pytestmark = pytest.mark.dist

WORLD, STEPS, START = 2, 8, 2
KINDS = [("tw", True), ("rw", False)]  # fused tables table-wise, dense tables row-wise


def _rank(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tests.train_pipeline.collection_cases import build_processed_model
    from tests.train_pipeline.pipeline_cases import batches, run_to_end
    from tritonrec.dist.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
    from tritonrec.dist.train_pipeline import TrainPipelineSemiSync, TrainPipelineSparseDist

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    for kind, fused in KINDS:
        model, optimizer, _ = build_processed_model(kind, world, fused)
        (processed,) = [m for m in model.modules() if isinstance(m, ShardedFeatureProcessedEmbeddingBagCollection)]
        weights = processed._weights()
        before = {name: w.detach().clone() for name, w in weights.items()}
        semi = run_to_end(TrainPipelineSemiSync(model, optimizer, cpu, start_batch=START), batches(rank, STEPS))
        gathered = {}
        for name, w in weights.items():
            parts = [torch.empty_like(w) for _ in range(world)]
            dist.all_gather(parts, w.detach().contiguous())
            gathered[name] = [p.tolist() for p in parts]
        model, optimizer, _ = build_processed_model(kind, world, fused)
        sparse_dist = run_to_end(TrainPipelineSparseDist(model, optimizer, cpu), batches(rank, STEPS))
        out[f"{kind}-{fused}"] = {
            "semi": semi,
            "sparse_dist": sparse_dist,
            "replicas": gathered,
            "moved": sorted(name for name, w in weights.items() if not torch.equal(w.detach(), before[name])),
            "names": sorted(weights),
        }
    return out


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn_ranks(_rank, WORLD, timeout=240.0)


@pytest.mark.parametrize(("kind", "fused"), KINDS)
def test_semi_sync_trains_position_weighted_features(kind: str, fused: bool) -> None:
    for rank, results in enumerate(_results()):
        got = results[f"{kind}-{fused}"]
        assert len(got["semi"]) == STEPS, f"rank {rank}: {len(got['semi'])} steps"
        # batches 0..START read up-to-date weights (START's lookup is the last synchronous one)
        assert got["semi"][: START + 1] == got["sparse_dist"][: START + 1], f"rank {rank}"
        assert got["semi"] != got["sparse_dist"], f"rank {rank}: never went semi-synchronous"
        assert got["moved"] == got["names"] != [], f"rank {rank}: position weights did not train: {got['moved']}"
        for name, replicas in got["replicas"].items():
            assert all(r == replicas[0] for r in replicas), f"rank {rank}: {name} differs across ranks"
