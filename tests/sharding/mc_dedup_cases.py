"""Rank-side cases for the sharded managed-collision EC's index dedup (``use_index_dedup=True`` on its sharder, as
torchrec 1.8's EC sharder), run inside mc_vbe_cases.py's spawn:

- the training stream of mc_ec_cases.py (inserts, LFU / LRU evictions, one eval step, fused SGD) against torchrec's
  decomposition fed what dedup sends: per source rank and table its unique ids (after ``input_hash_func``,
  ascending) in the table's first feature, so each rank's MCH modules see each id once per source rank; the
  reference's rows of the unique ids are expanded back to every occurrence before its unsharded EC's lookup;
- with tables that hold every id, filled first by a batch holding each id once (so later remaps are lookups: how
  often a new id comes orders the rows MCH hands out, and dedup changes that), the deduplicated module's outputs
  and table shards (fused SGD and rowwise Adagrad, repeated ids in every batch) against the module without dedup;
- dedup with return_remapped_features refused by name."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from tests.sharding.mc_cases import (
    BATCH,
    FEATURES,
    HASH,
    STEPS,
    TABLES,
    Reference,
    _batch,
    _slice,
    diff,
    reset_init,
    shard_setup,
)
from tests.sharding.mc_ec_cases import DIM, _SequenceStream, make_ec_module
from tritonrec.data import KeyedJaggedTensor


def _unhash(ids: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of mc_cases._hash on ``[0, size)`` (``7 * 23 = 1 mod 40``): the raw ids hashing to ``ids``."""
    assert size == 40
    return (23 * (ids - 3)) % size


class DedupReference(Reference):
    """mc_cases.Reference fed the deduplicated global batch; rows come back per occurrence."""

    def remap(self, lengths: torch.Tensor, values: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        from tests.sharding.mc_cases import _hash

        dedup_lengths = torch.zeros_like(lengths)
        dedup_values: list[list[torch.Tensor]] = [[] for _ in FEATURES]
        inverses = []  # (src, table, holder index, per feature of the table its inverse)
        for src in range(self.world):
            lo, hi = src * BATCH, (src + 1) * BATCH
            for table, features in TABLES.items():
                idx = [FEATURES.index(f) for f in features]
                parts = []
                for i in idx:
                    start, n = int(lengths[i, :lo].sum()), int(lengths[i, lo:hi].sum())
                    ids = values[i][start : start + n]
                    parts.append(_hash(ids, HASH[table]) if table == "t1" else ids)
                unique, inverse = torch.unique(torch.cat(parts), return_inverse=True)
                dedup_lengths[idx[0], lo] = unique.numel()
                dedup_values[idx[0]].append(_unhash(unique, HASH[table]) if table == "t1" else unique)
                inverses.append((src, idx, inverse.split([p.numel() for p in parts])))
        flat = [torch.cat(v) if v else values[0][:0] for v in dedup_values]
        unique_rows, per_rank = super().remap(dedup_lengths, flat)
        per_src = dedup_lengths.view(len(FEATURES), self.world, BATCH).sum(2).tolist()
        held = [list(r.split(per_src[i])) for i, r in enumerate(unique_rows)]
        rows: list[list[torch.Tensor]] = [[] for _ in FEATURES]
        for src, idx, parts in inverses:  # src-major, as the global batch's samples
            for i, inverse in zip(idx, parts, strict=True):
                rows[i].append(held[idx[0]][src][inverse])
        return [torch.cat(r) for r in rows], per_rank


class _DedupStream(_SequenceStream):
    def __init__(self, rank: int, world: int, build: Any, module: Any) -> None:
        super().__init__(rank, world, build, module, remapped=False)
        shards = self.sharded._embedding_module._tables
        self.ref = DedupReference(module, world, {t: [s.rows for s in shards[i].shards] for i, t in enumerate(TABLES)})


def make_roomy_ec(seed: int) -> Any:
    """An MC-EC whose MCH tables hold every id of their input range (t0: 64 rows, t1: 40), so no id is evicted."""
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules import mc_modules as mc
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingConfig(num_embeddings=HASH["t0"], embedding_dim=DIM, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=HASH["t1"], embedding_dim=DIM, name="t1", feature_names=["f2"]),
    ]
    for config in configs:
        config.init_fn = reset_init
    mcms = {
        t: mc.MCHManagedCollisionModule(HASH[t], "cpu", mc.LRU_EvictionPolicy(), 1, input_hash_size=HASH[t])
        for t in TABLES
    }
    ec = EmbeddingCollection(configs, backend="torch")
    return ManagedCollisionEmbeddingCollection(ec, mc.ManagedCollisionCollection(mcms, configs))


def dedup_equals_plain(rank: int, world: int, optim: str) -> dict[str, float]:
    """The largest output / gradient-driven weight difference between the module with and without dedup (roomy
    tables, fused ``optim``), and how much smaller the deduplicated input dist's ids are (``sent`` vs ``plain``)."""
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    module = make_roomy_ec(5)
    _, _, build_plain = shard_setup(ManagedCollisionEmbeddingCollectionSharder, world, optim)
    dedup_sharder = functools.partial(ManagedCollisionEmbeddingCollectionSharder, use_index_dedup=True)
    _, _, build_dedup = shard_setup(dedup_sharder, world, optim)  # type: ignore[arg-type]
    plain, dedup = build_plain(copy.deepcopy(module)), build_dedup(copy.deepcopy(module))
    every_id = [torch.arange(HASH["t0"]), torch.arange(0), torch.arange(HASH["t1"])]
    lengths = torch.zeros(len(FEATURES), BATCH, dtype=torch.int64)
    lengths[:, 0] = torch.tensor([v.numel() for v in every_id])
    for sharded in (plain, dedup):  # no backward: the table rows stay as built
        sharded(KeyedJaggedTensor(keys=FEATURES, values=torch.cat(every_id), lengths=lengths.flatten()))
    out = {"forward": 0.0, "weights": 0.0, "sent": 0, "plain": 0}
    for step in range(STEPS):
        lengths, values = _batch(step, world)
        features = _slice(lengths, values, rank * BATCH, (rank + 1) * BATCH)
        got = []
        for name, sharded in (("plain", plain), ("sent", dedup)):
            ctx = sharded.create_context()
            dist_input = sharded.input_dist(ctx, features).wait().wait()
            out[name] += sum(kjt.values().numel() for kjt in dist_input)
            embeddings, _ = sharded.compute_and_output_dist(ctx, dist_input)
            got.append(embeddings.wait())
        seed = torch.Generator().manual_seed(step)
        grads = {f: torch.randn(got[0][f].values().shape, generator=seed) for f in FEATURES}
        for embeddings in got:
            sum((embeddings[f].values() * grads[f]).sum() for f in FEATURES).backward()  # type: ignore[union-attr]
        for f in FEATURES:
            a, b = got[0][f], got[1][f]
            assert torch.equal(a.lengths(), b.lengths())
            out["forward"] = max(out["forward"], diff(a.values(), b.values()))
        for table, sharded_table in plain._embedding_module.embeddings.items():
            other = dedup._embedding_module.embeddings[table]
            for (_, w), (_, v) in zip(sharded_table.local, other.local, strict=True):
                out["weights"] = max(out["weights"], diff(w.weight, v.weight))
    return out


def dedup_refusal(world: int) -> str:
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    sharder = functools.partial(ManagedCollisionEmbeddingCollectionSharder, use_index_dedup=True)
    _, _, build = shard_setup(sharder, world)  # type: ignore[arg-type]
    try:
        build(make_ec_module(1, remapped=True))
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def dedup_per_feature_refusal(world: int) -> str:
    """Dedup over a PER_FEATURE_TTL_EVICTION hash ZCH table: the unique ids lose the feature that sent them."""
    from tests.sharding.hash_zch_cases import hash_zch
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from tritonrec.modules.mc_modules import ManagedCollisionCollection

    sharder = functools.partial(ManagedCollisionEmbeddingCollectionSharder, use_index_dedup=True)
    _, _, build = shard_setup(sharder, world)  # type: ignore[arg-type]
    configs = [EmbeddingConfig(num_embeddings=16, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
               EmbeddingConfig(num_embeddings=12, embedding_dim=4, name="t1", feature_names=["f2"])]  # fmt: skip
    modules = {"t0": hash_zch(16, 4, 0, "per_feature"), "t1": hash_zch(12, 2, 50, True)}
    mcc = ManagedCollisionCollection(modules, configs)
    try:
        build(ManagedCollisionEmbeddingCollection(EmbeddingCollection(configs, backend="torch"), mcc))
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def run_dedup_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    sharder = functools.partial(ManagedCollisionEmbeddingCollectionSharder, use_index_dedup=True)
    _, _, build = shard_setup(sharder, world)  # type: ignore[arg-type]
    return {
        "training": _DedupStream(rank, world, build, make_ec_module(1)).run(),
        "equal_SGD": dedup_equals_plain(rank, world, "EXACT_SGD"),
        "equal_ADAGRAD": dedup_equals_plain(rank, world, "EXACT_ROWWISE_ADAGRAD"),
        "refusal": dedup_refusal(world),
        "per_feature_refusal": dedup_per_feature_refusal(world),
    }
