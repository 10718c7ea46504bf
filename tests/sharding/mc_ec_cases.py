"""Rank-side cases for the sharded managed-collision EC (row-wise), run inside mc_cases.py's spawned suite, against
torchrec's decomposition written out (:class:`tests.sharding.mc_cases.Reference`: per table one rebuilt MCH module
per rank over its raw-id range) feeding one unsharded EC (fused SGD written out as ``w -= lr * grad``). The training
stream, state-dict, refusal and DMP cases are mc_cases.py's, with the sequence output's hooks."""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.mc_cases import (
    FEATURES,
    TrainingStream,
    diff,
    dmp_case,
    managed_collision,
    refusals,
    reset_init,
    shard_setup,
    state_case,
)
from tritonrec.data import KeyedJaggedTensor

DIM = 4  # one width for every table: the sequence all-to-all's rows


def make_ec_module(seed: int, remapped: bool = False) -> Any:
    """An MC-EC over tables t0 (f0, f1; LFU) and t1 (f2; LRU behind an input hash), as mc_cases.make_module."""
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingConfig(num_embeddings=10, embedding_dim=DIM, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=8, embedding_dim=DIM, name="t1", feature_names=["f2"]),
    ]
    ec = EmbeddingCollection(configs, backend="torch")
    for config in configs:
        config.init_fn = reset_init
    return ManagedCollisionEmbeddingCollection(ec, managed_collision(configs), return_remapped_features=remapped)


def run_ec_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    sharder, env, build = shard_setup(ManagedCollisionEmbeddingCollectionSharder, world)
    return {
        "training": _SequenceStream(rank, world, build, make_ec_module(1), remapped=False).run(),
        "training_remapped": _SequenceStream(rank, world, build, make_ec_module(1, True), remapped=True).run(),
        "state": state_case(rank, world, build, make_ec_module, _per_feature),
        "refusals": refusals(world, sharder, env, make_ec_module(1)),
        "dmp": dmp_case(rank, world, build, sharder, make_ec_module(3), DIM, _per_feature),
    }


def _per_feature(embeddings: Any) -> list[torch.Tensor]:
    """The MC-EC's output (a dict or its lazy awaitable, as user code reads it): each feature's rows, in order."""
    return [embeddings[f].values() for f in FEATURES]


def _mine(full: dict[str, Any], lengths: torch.Tensor, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """This rank's samples' rows of the unsharded EC's output, per feature."""
    out = {}
    for i, f in enumerate(FEATURES):
        start, stop = int(lengths[i, :lo].sum()), int(lengths[i, :hi].sum())
        out[f] = full[f].values()[start:stop]
    return out


class _SequenceStream(TrainingStream):
    """The MC-EC's stream, through ``input_dist`` / ``compute_and_output_dist`` (to read the context): ``forward``
    is the largest sequence-embedding difference, ``lengths`` counts sequence-length mismatches, ``evicted`` the
    training batches whose MCH modules handed a row to a new id."""

    tables = "embeddings"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.result.update(lengths=0, evicted=0)

    def forward(self, features: KeyedJaggedTensor, training: bool) -> tuple[Any, KeyedJaggedTensor | None]:
        ctx = self.sharded.create_context()
        dist_input = self.sharded.input_dist(ctx, features).wait().wait()
        embeddings, returned = self.sharded.compute_and_output_dist(ctx, dist_input)
        returned = returned.wait()
        embeddings = embeddings.wait()
        if training:
            evicted = any(v is not None and v.numel() > 0 for v in ctx.evictions_per_table.values())
            self.result["evicted"] += int(evicted)
        return embeddings, returned

    def compare(self, embeddings: Any, full: Any, lengths: torch.Tensor, step: int) -> tuple[Any, Any]:
        lo, hi, result = self.lo, self.hi, self.result
        result["outputs"].append([embeddings[f].values().detach().clone() for f in FEATURES])
        want = _mine(full, lengths, lo, hi)
        loss, loss_full = 0.0, 0.0
        for i, f in enumerate(FEATURES):
            got = embeddings[f]
            result["lengths"] += int(not torch.equal(got.lengths(), lengths[i, lo:hi]))
            result["forward"] = max(result["forward"], diff(got.values(), want[f]))
            grad = torch.randn(full[f].values().shape, generator=torch.Generator().manual_seed(77 + 10 * step + i))
            start, stop = int(lengths[i, :lo].sum()), int(lengths[i, :hi].sum())
            loss = loss + (got.values() * grad[start:stop]).sum()
            loss_full = loss_full + (full[f].values() * grad).sum()
        return loss, loss_full
