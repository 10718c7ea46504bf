"""Rank-side cases for the sharded managed-collision EC (row-wise), run inside mc_cases.py's spawned suite, against
torchrec's decomposition written out (:class:`tests.sharding.mc_cases.Reference`: per table one rebuilt MCH module
per rank over its raw-id range) feeding one unsharded EC (fused SGD written out as ``w -= lr * grad``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.sharding.mc_cases import (
    BATCH,
    FEATURES,
    HASH,
    LR,
    STEPS,
    Reference,
    _batch,
    _hash,
    _same_kjt,
    _slice,
    _state_mismatches,
)
from tritonrec.data import KeyedJaggedTensor

TABLES = {"t0": ["f0", "f1"], "t1": ["f2"]}
DIM = 4  # one width for every table: the sequence all-to-all's rows


def make_ec_module(seed: int, remapped: bool = False) -> Any:
    """An MC-EC over tables t0 (f0, f1; LFU) and t1 (f2; LRU behind an input hash), as mc_cases.make_module."""
    from tritonrec.modules import EmbeddingCollection, EmbeddingConfig
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from tritonrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    torch.manual_seed(seed)
    configs = [
        EmbeddingConfig(num_embeddings=10, embedding_dim=DIM, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=8, embedding_dim=DIM, name="t1", feature_names=["f2"]),
    ]
    ec = EmbeddingCollection(configs, backend="torch")
    mcms = {
        "t0": MCHManagedCollisionModule(10, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=HASH["t0"]),
        "t1": MCHManagedCollisionModule(
            8, "cpu", LRU_EvictionPolicy(), 2, input_hash_size=HASH["t1"], input_hash_func=_hash
        ),
    }
    return ManagedCollisionEmbeddingCollection(
        ec, ManagedCollisionCollection(mcms, configs), return_remapped_features=remapped
    )


def run_ec_suite(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan, row_wise
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from tritonrec.kernels.embedding import OptimType

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder = ManagedCollisionEmbeddingCollectionSharder(
        fused_params={"optimizer": OptimType.EXACT_SGD, "learning_rate": LR, "backend": "torch"}
    )

    def build(module: Any) -> Any:
        plan = construct_module_sharding_plan(
            module, {"t0": row_wise(), "t1": row_wise()}, sharder, world, world, "cpu"
        )
        sharded = sharder.shard(copy.deepcopy(module), plan, env, torch.device("cpu"))
        for sharding in sharded._embedding_module.shardings:
            sharding.lookup.backend = "torch"
        return sharded

    return {
        "training": _training_case(rank, world, build),
        "training_remapped": _training_case(rank, world, build, remapped=True),
        "state": _state_case(rank, world, build),
        "refusals": _refusals(world, sharder, env),
        "dmp": _dmp_case(rank, world, build, sharder),
    }


def _mine(full: dict[str, Any], lengths: torch.Tensor, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """This rank's samples' rows of the unsharded EC's output, per feature."""
    out = {}
    for i, f in enumerate(FEATURES):
        start, stop = int(lengths[i, :lo].sum()), int(lengths[i, :hi].sum())
        out[f] = full[f].values()[start:stop]
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (0 for empty tensors; shapes must agree)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).detach().abs().amax()) if a.numel() else 0.0


def _training_case(rank: int, world: int, build: Any, remapped: bool = False) -> dict[str, Any]:
    """With ``remapped`` (return_remapped_features=True): the returned KJT = the reference's rows of this rank's
    samples (``result["returned"]`` counts mismatches); ``result["outputs"]``: the sequence embeddings per step."""
    from tritonrec.dist import get_gradient_division

    module = make_ec_module(1, remapped)
    sharded = build(module)
    blocks = {t: [s.rows for s in sharded._embedding_module._tables[i].shards] for i, t in enumerate(TABLES)}
    ref = Reference(module, world, blocks)
    recorded: list[KeyedJaggedTensor] = []
    inner = sharded._embedding_module.input_transform

    def record(ctx: Any, sharding: Any, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        remapped = inner(ctx, sharding, kjt)
        recorded.append(remapped)
        return remapped

    sharded._embedding_module.input_transform = record
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    # the sequence all-to-all's backward divides by the world size (torchrec's gradient division, on by default)
    divide = world if get_gradient_division() else 1
    result: dict[str, Any] = {"rows": 0, "forward": 0.0, "lengths": 0, "weights": 0.0, "state": 0, "evicted": 0}
    result.update(returned=0, outputs=[])
    for step in range(STEPS):
        training = step != STEPS - 2  # one eval-mode step: remap only, state unchanged
        sharded.train(training)
        ref.set_mode(training)
        lengths, values = _batch(step, world)
        recorded.clear()
        ctx = sharded.create_context()
        dist_input = sharded.input_dist(ctx, _slice(lengths, values, lo, hi)).wait().wait()
        embeddings, returned = sharded.compute_and_output_dist(ctx, dist_input)
        returned = returned.wait()
        embeddings = embeddings.wait()
        rows, per_rank = ref.remap(lengths, values)
        if remapped:
            result["returned"] += int(not _same_kjt(returned, _slice(lengths, rows, lo, hi)))
        else:
            assert returned is None
        result["outputs"].append([embeddings[f].values().detach().clone() for f in FEATURES])
        remapped_kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.cat(rows), lengths=lengths.flatten())
        full = ref.module._embedding_module(remapped_kjt)
        want = _mine(full, lengths, lo, hi)
        loss, loss_full = 0.0, 0.0
        for i, f in enumerate(FEATURES):
            got = embeddings[f]
            result["lengths"] += int(not torch.equal(got.lengths(), lengths[i, lo:hi]))
            result["forward"] = max(result["forward"], _diff(got.values(), want[f]))
            grad = torch.randn(full[f].values().shape, generator=torch.Generator().manual_seed(77 + 10 * step + i))
            start, stop = int(lengths[i, :lo].sum()), int(lengths[i, :hi].sum())
            loss = loss + (got.values() * grad[start:stop]).sum()
            loss_full = loss_full + (full[f].values() * grad).sum()
        # the remapped rows this rank looked up (made global again) = its reference modules' outputs
        (got_kjt,) = recorded
        segments = dict(zip(got_kjt.keys(), got_kjt.values().split(got_kjt.length_per_key()), strict=True))
        offsets = sharded._managed_collision_collection._table_to_offset
        for table, features in TABLES.items():
            mine = torch.cat([segments[f] for f in features]) + offsets[table]
            result["rows"] += int(not torch.equal(mine, per_rank[(table, rank)]))
        if training:
            result["evicted"] += int(any(v is not None and v.numel() > 0 for v in ctx.evictions_per_table.values()))
            loss.backward()
            loss_full.backward()
            with torch.no_grad():
                for table in ref.module._embedding_module.embeddings.values():
                    table.weight -= LR * table.weight.grad / divide
                    table.weight.grad = None
        for table, emb in sharded._embedding_module.embeddings.items():
            whole = ref.module._embedding_module.embeddings[table].weight
            for shard, weight in emb.local:
                s = shard.spec
                diff = (weight.weight - whole[s.row_offset : s.row_offset + s.rows]).abs().max()
                result["weights"] = max(result["weights"], float(diff.detach()))
        result["state"] += _state_mismatches(sharded, ref, rank)
    result["open_slots"] = {t: int(v) for t, v in sharded._managed_collision_collection.open_slots().items()}
    return result


def _state_case(rank: int, world: int, build: Any) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from tests.sharding.mc_cases import _local

    first = build(make_ec_module(1))
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(3):
        lengths, values = _batch(step, world)
        out, _ = first(_slice(lengths, values, lo, hi))
        sum(jt.values().sum() for jt in out.wait().values()).backward()
    state = first.state_dict()
    second = build(make_ec_module(2))
    second.load_state_dict(state)
    again = second.state_dict()
    same = all(_local(state[k]).equal(_local(again[k])) for k in state)
    lengths, values = _batch(9, world)
    first.eval()  # eval: the non-persistent history (pending window) is not in the state dict, as in torchrec
    second.eval()
    a = first(_slice(lengths, values, lo, hi))[0].wait()
    b = second(_slice(lengths, values, lo, hi))[0].wait()
    after = max(_diff(a[f].values(), b[f].values()) for f in FEATURES)
    sharded_keys = sorted(k for k, v in state.items() if isinstance(v, ShardedTensor))
    sizes = {k: list(v.size()) for k, v in state.items() if isinstance(v, ShardedTensor)}
    return {"keys": sorted(state), "sharded_keys": sharded_keys, "sizes": sizes, "round_trip": same,
            "after_load": after}  # fmt: skip


def _refusals(world: int, sharder: Any, env: Any) -> dict[str, str]:
    from tritonrec.dist import construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.mc_embedding import ShardedManagedCollisionEmbeddingCollection

    module = make_ec_module(1)
    messages = {}
    try:
        construct_module_sharding_plan(
            module, {"t0": row_wise(), "t1": table_wise(rank=0)}, sharder, world, world, "cpu"
        )
    except ValueError as error:
        messages["plan"] = str(error)
    ec_plan = construct_module_sharding_plan(
        module._embedding_module, {"t0": row_wise(), "t1": table_wise(rank=0)}, None, world, world, "cpu"
    )
    try:
        ShardedManagedCollisionEmbeddingCollection(module, ec_plan, env, device="cpu")
    except ValueError as error:
        messages["shard"] = str(error)
    return messages


class _Model(torch.nn.Module):
    """A model holding an MC-EC as user code calls it: ``embeddings, _ = mc_ec(kjt)``, then a dense layer per row."""

    def __init__(self, mc: Any) -> None:
        super().__init__()
        self.mc = mc
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embeddings, _ = self.mc(kjt)
        return sum(self.dense(embeddings[f].values()).sum() for f in FEATURES)  # type: ignore[return-value]


def _dmp_case(rank: int, world: int, build: Any, sharder: Any) -> dict[str, Any]:
    """DistributedModelParallel over a model holding the MC-EC (the planner's plan, the sharder given) trains as the
    module sharded by hand (same row-wise plan, same fused SGD) under the same dense layer."""
    from tritonrec.dist import DistributedModelParallel

    module = make_ec_module(3)
    torch.manual_seed(4)
    model = _Model(copy.deepcopy(module))
    reference = build(module)
    dense = copy.deepcopy(model.dense)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder])
    for sharding in dmp.module.mc._embedding_module.shardings:
        sharding.lookup.backend = "torch"
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    worst = 0.0
    for step in range(3):
        lengths, values = _batch(step, world)
        got = dmp(_slice(lengths, values, lo, hi))
        embeddings, _ = reference(_slice(lengths, values, lo, hi))
        embeddings = embeddings.wait()
        want = sum(dense(embeddings[f].values()).sum() for f in FEATURES)
        worst = max(worst, abs(float(got.detach()) - float(want.detach())))
        got.backward()
        want.backward()
    kinds = sorted({p.sharding_type for p in dmp.plan.plan["mc"].values()})
    return {"loss": worst, "kinds": kinds}
