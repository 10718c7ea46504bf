"""Rank-side cases for the sharded managed-collision EC with hash ZCH tables, run inside hash_zch_cases.py's spawned
suite: the training stream of hash_zch_cases.py (TTL eviction, ``input_hash_size`` 0 on t0 and 50 on t1) with the
sequence output (each feature's rows of this rank's samples, put back in input order by the unbucketize permutation)
against the unsharded MC-EC fed the global batches."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.sharding.hash_zch_cases import (
    CLOCK,
    FEATURES,
    STEPS,
    _init,
    _slice_rows,
    batch,
    hash_zch,
    kjt,
    state_mismatches,
)
from tests.sharding.mc_cases import BATCH, _same_kjt, diff, sgd_step, shard_setup, shard_weight_diff

DIM = 4  # one width for every table: the sequence all-to-all's rows


def make_ec_module(seed: int) -> Any:
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from tritonrec.modules.mc_modules import ManagedCollisionCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingConfig(num_embeddings=16, embedding_dim=DIM, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=12, embedding_dim=DIM, name="t1", feature_names=["f2"]),
    ]
    ec = EmbeddingCollection(configs, backend="torch")
    for config in configs:
        config.init_fn = _init
    mcc = ManagedCollisionCollection({"t0": hash_zch(16, 4, 0, True), "t1": hash_zch(12, 2, 50, True)}, configs)
    return ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=True, reset_evicted_rows=True)


def ec_stream(rank: int, world: int) -> dict[str, Any]:
    """As hash_zch_cases.stream, with per-feature sequence embeddings: ``lengths`` counts their length mismatches."""
    from tritonrec.dist import get_gradient_division
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    _, _, build = shard_setup(ManagedCollisionEmbeddingCollectionSharder, world)
    module = make_ec_module(1)
    sharded, ref = build(module), copy.deepcopy(module)
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    out: dict[str, Any] = {"rows": 0, "lengths": 0, "forward": 0.0, "weights": 0.0, "state": 0}
    divide = world if get_gradient_division() else 1
    CLOCK[0] = 1000
    for step in range(STEPS):
        CLOCK[0] += 2
        training = step != STEPS - 2
        sharded.train(training)
        ref.train(training)
        lengths, values = batch(step, world)
        embeddings, returned = sharded(kjt(lengths, values, lo, hi))
        embeddings, returned = embeddings.wait(), returned.wait()
        full, remapped = ref(kjt(lengths, values, 0, world * BATCH))
        out["rows"] += int(not _same_kjt(returned, _slice_rows(remapped, lo, hi)))
        g = torch.Generator().manual_seed(77 + step)
        loss, loss_full = 0.0, 0.0
        for i, f in enumerate(FEATURES):
            start, n = int(lengths[i, :lo].sum()), int(lengths[i, lo:hi].sum())
            whole = full[f].values()
            grad = torch.randn(whole.shape, generator=g)
            mine = embeddings[f]
            out["lengths"] += int(not torch.equal(mine.lengths(), lengths[i, lo:hi]))
            out["forward"] = max(out["forward"], diff(mine.values(), whole[start : start + n]))
            loss = loss + (mine.values() * grad[start : start + n]).sum()
            loss_full = loss_full + (whole * grad).sum()
        if training:
            loss.backward()  # type: ignore[union-attr]
            loss_full.backward()  # type: ignore[union-attr]
            sgd_step(ref._embedding_module.embeddings, divide)
        worst = shard_weight_diff(sharded._embedding_module.embeddings, ref._embedding_module.embeddings)
        out["weights"] = max(out["weights"], worst)
        out["state"] += state_mismatches(sharded, ref)
    return out
