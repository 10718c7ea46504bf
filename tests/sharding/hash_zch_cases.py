"""Rank-side cases for the sharded managed-collision EBC with hash ZCH tables (row-wise, torchrec's MPZCH sharding),
against the unsharded module fed the same global batches (``reset_evicted_rows=True``, the sharded reset; fused SGD
written out as ``w -= lr * grad / world``). Per rank: t0 (16 rows, 4 buckets, ``input_hash_size`` 0, features f0 and
f1) and t1 (12 rows, 2 buckets, ``input_hash_size`` 50, feature f2); with ``ttl``, SINGLE_TTL eviction on both under a
pinned clock (two hours a step: every row expires the next step, so new ids evict). Races stay inside a bucket and a
bucket inside a rank, so the sharded modules make exactly the unsharded module's choices."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch

from tests.sharding.mc_cases import (
    BATCH,
    Model,
    _local,
    _pooled,
    _same_kjt,
    count_evictions,
    diff,
    sgd_step,
    shard_setup,
    shard_weight_diff,
)
from tritonrec.data import KeyedJaggedTensor

FEATURES = ["f0", "f1", "f2"]
STEPS = 6
MC = "_managed_collision_collection._managed_collision_modules"
CLOCK = [1000]  # the TTL clock (hours) of every hash ZCH module in this process


def _pinned_hour(self: Any) -> int:
    return CLOCK[0]


def _init(rows: torch.Tensor) -> torch.Tensor:
    """``init_fn`` of the resets: row-wise (a rank's redraw of its rows equals the unsharded redraw of all)."""
    return rows.mul_(-0.5).add_(0.125)


def hash_zch(rows: int, buckets: int, size: int, ttl: bool | str, **kwargs: Any) -> Any:
    """``ttl``: False (no eviction), True (SINGLE_TTL, 1 hour), or a policy: "lru" (LRU_EVICTION), "per_feature"
    (PER_FEATURE_TTL_EVICTION, 1 and 3 hours for t0's two features) or "opt_in" (SINGLE_TTL with every id opted in
    to a 25 % reserved tail)."""
    from tritonrec.modules import mc_hash_zch as hz

    policy, config = hz.HashZchEvictionPolicyName, hz.HashZchEvictionConfig
    evicting: dict[str, Any] = {}
    if ttl == "per_feature":
        features = ["f0", "f1"] if rows == 16 else ["f2"]
        evicting = {"eviction_policy_name": policy.PER_FEATURE_TTL_EVICTION,
                    "eviction_config": config(features=features, per_feature_ttl=[1, 3][: len(features)])}  # fmt: skip
    elif ttl:
        name = policy.LRU_EVICTION if ttl == "lru" else policy.SINGLE_TTL_EVICTION
        evicting = {"eviction_policy_name": name, "eviction_config": config(features=[], single_ttl=1)}
        if ttl == "opt_in":
            evicting.update(opt_in_prob=100, percent_reserved_slots=25)
    return hz.HashZchManagedCollisionModule(
        rows, "cpu", buckets, max_probe=3, input_hash_size=size, **evicting, **kwargs
    )


def make_module(
    seed: int, ttl: bool | str = False, remapped: bool = True, t0: dict | None = None, mch: tuple[str, ...] = ()
) -> Any:
    """The MC-EBC: t0 and t1 as in the module docstring (``t0``: extra hash ZCH arguments of t0); the tables in
    ``mch`` get an MCH module instead (LRU, same rows and ``input_hash_size``)."""
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from tritonrec.modules import mc_modules as mc
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from tritonrec.modules.mc_modules import ManagedCollisionCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(num_embeddings=16, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=12, embedding_dim=3, name="t1", feature_names=["f2"]),
    ]
    ebc = EmbeddingBagCollection(configs, backend="torch")
    for config in configs:
        config.init_fn = _init
    t0_args = {"buckets": 4, "size": 0, **(t0 or {})}
    mcms = {"t0": hash_zch(16, t0_args.pop("buckets"), t0_args.pop("size"), ttl, **t0_args),
            "t1": hash_zch(12, 2, 50, ttl)}  # fmt: skip
    for table in mch:
        rows, size = {"t0": (16, 2**40), "t1": (12, 50)}[table]
        mcms[table] = mc.MCHManagedCollisionModule(rows, "cpu", mc.LRU_EvictionPolicy(), 1, input_hash_size=size)
    mcc = ManagedCollisionCollection(mcms, configs)
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=remapped, reset_evicted_rows=True)


def batch(step: int, world: int, size0: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Global batch: ``lengths [3, world * BATCH]`` and per-feature raw ids (skewed over 40 large ids for t0, taken
    modulo its ``input_hash_size`` ``size0`` when not 0, over ``[0, 50)`` for t1, so the tables fill, collide and
    evict)."""
    g = torch.Generator().manual_seed(900 + step)
    lengths = torch.randint(0, 5, (len(FEATURES), world * BATCH), generator=g)
    n0, n1, n2 = (int(n) for n in lengths.sum(1))
    big = lambda n: ((torch.rand(n, generator=g) ** 2 * 40).long() * 7919 + 123457) % (size0 or 2**62)
    return lengths, [big(n0), big(n1), (torch.rand(n2, generator=g) ** 2 * 50).long()]


def kjt(lengths: torch.Tensor, values: list[torch.Tensor], lo: int, hi: int) -> KeyedJaggedTensor:
    parts, vals = [], []
    for i in range(len(FEATURES)):
        start, n = int(lengths[i, :lo].sum()), int(lengths[i, lo:hi].sum())
        parts.append(lengths[i, lo:hi])
        vals.append(values[i][start : start + n])
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(vals), lengths=torch.cat(parts))


def _slice_rows(remapped: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """The unsharded module's remapped KJT of the global batch -> that of samples ``[lo, hi)``."""
    per = remapped.to_dict()
    lengths = torch.stack([per[f].lengths() for f in FEATURES])
    return kjt(lengths, [per[f].values() for f in FEATURES], lo, hi)


def stream(rank: int, world: int, build: Any, module: Any, ttl: bool) -> dict[str, Any]:
    """``STEPS`` global batches (one eval step), this rank's samples through the sharded module, the global batch
    through the unsharded one: returned remapped rows, pooled outputs, table shards after fused SGD, identities and
    metadata of this rank's rows; the embeddings per step; the rows the unsharded module evicted."""
    from tritonrec.dist import get_gradient_division

    sharded, ref = build(module), copy.deepcopy(module)
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    out: dict[str, Any] = {"rows": 0, "forward": 0.0, "weights": 0.0, "state": 0, "evicted": 0, "outputs": []}
    count_evictions(ref, out)
    divide = world if get_gradient_division() else 1
    size0 = module._managed_collision_collection._managed_collision_modules["t0"].input_size()
    for step in range(STEPS):
        CLOCK[0] += 2
        training = step != STEPS - 2
        sharded.train(training)
        ref.train(training)
        lengths, values = batch(step, world, size0)
        pooled, returned = sharded(kjt(lengths, values, lo, hi))
        pooled, returned = pooled.wait().values(), returned.wait() if module._return_remapped_features else None
        full, remapped = ref(kjt(lengths, values, 0, world * BATCH))
        if returned is not None:
            out["rows"] += int(not _same_kjt(returned, _slice_rows(remapped, lo, hi)))
        out["outputs"].append(pooled.detach().clone())
        out["forward"] = max(out["forward"], diff(pooled, full.values()[lo:hi]))
        grad = torch.randn(full.values().shape, generator=torch.Generator().manual_seed(77 + step))
        if training:
            (pooled * grad[lo:hi]).sum().backward()
            (full.values() * grad).sum().backward()
            sgd_step(ref._embedding_module.embedding_bags, divide)
        worst = shard_weight_diff(sharded._embedding_module.embedding_bags, ref._embedding_module.embedding_bags)
        out["weights"] = max(out["weights"], worst)
        out["state"] += state_mismatches(sharded, ref)
    return out


def mixed_case(rank: int, world: int, build: Any) -> dict[str, Any]:
    """A hash ZCH t0 beside an MCH t1 in one sharding (ids routed by bucket for t0, by raw-id range for t1) against
    the all-hash-ZCH and the all-MCH modules, in lockstep over ``STEPS`` training batches: t0's pooled columns and
    remapped rows equal the first's, t1's the second's (the tables share no state and the same initial weights)."""
    modules = {
        k: build(make_module(1, True, mch=m)) for k, m in (("mixed", ("t1",)), ("zch", ()), ("mch", ("t0", "t1")))
    }
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    got: dict[str, Any] = {"t0": 0.0, "t1": 0.0, "rows": 0}
    for step in range(STEPS):
        CLOCK[0] += 2
        lengths, values = batch(step, world)
        outs = {}
        for name, module in modules.items():
            pooled, remapped = module(kjt(lengths, values, lo, hi))
            outs[name] = (pooled.wait().values(), remapped.wait().to_dict())
            grad = torch.randn(outs[name][0].shape, generator=torch.Generator().manual_seed(step))
            (outs[name][0] * grad).sum().backward()
        (mixed, rows), (zch, zch_rows), (mch, mch_rows) = outs["mixed"], outs["zch"], outs["mch"]
        got["t0"] = max(got["t0"], diff(mixed[:, :8], zch[:, :8]))
        got["t1"] = max(got["t1"], diff(mixed[:, 8:], mch[:, 8:]))
        for feature, want in (("f0", zch_rows), ("f1", zch_rows), ("f2", mch_rows)):
            got["rows"] += int(not torch.equal(rows[feature].values(), want[feature].values()))
    return got


def state_mismatches(sharded: Any, ref: Any) -> int:
    """Identities / metadata of this rank's modules that differ from the unsharded module's rows of its shard."""
    mcc = sharded._managed_collision_collection
    bad = 0
    for table, module in mcc._managed_collision_modules.items():
        whole = ref._managed_collision_collection._managed_collision_modules[table]
        lo, n = mcc._table_to_offset[table], module.output_size()
        for name in ("_hash_zch_identities", "_hash_zch_metadata"):
            mine, want = getattr(module, name), getattr(whole, name)
            bad += int((mine is None) != (want is None) or (mine is not None and not mine.equal(want[lo : lo + n])))
    return bad


def state_case(rank: int, world: int, build: Any) -> dict[str, Any]:
    """Three TTL training batches, the state dict (keys, ``ShardedTensor`` sizes and offsets); a DCP save and load into
    a module built from another seed, and ``load_state_dict`` of the first's state into a third: same state, same
    eval embeddings, and one more training step gives the same embeddings and weights."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    first = build(make_module(1, ttl=True, remapped=False))
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(3):
        CLOCK[0] += 2
        lengths, values = batch(step, world)
        _pooled(first(kjt(lengths, values, lo, hi))[0])[0].sum().backward()
    state = first.state_dict()
    sharded = {k: v for k, v in state.items() if isinstance(v, ShardedTensor)}
    result: dict[str, Any] = {
        "keys": sorted(state),
        "sharded_keys": sorted(sharded),
        "sizes": {k: list(v.size()) for k, v in sharded.items()},
        "offsets": {k: v.local_shards()[0].metadata.shard_offsets[0] for k, v in sharded.items()},
    }
    path = [tempfile.mkdtemp(prefix="hash_zch_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(state, checkpoint_id=path[0])
    second = build(make_module(2, ttl=True, remapped=False))
    loaded = second.state_dict()
    dcp.load(loaded, checkpoint_id=path[0])
    second.load_state_dict(loaded)
    third = build(make_module(3, ttl=True, remapped=False))
    third.load_state_dict(state)
    dist.barrier()
    if rank == 0:
        for name in os.listdir(path[0]):
            os.remove(os.path.join(path[0], name))
        os.rmdir(path[0])
    for key, name in (("dcp_same", second), ("load_same", third)):
        again = name.state_dict()
        result[key] = all(_local(state[k]).equal(_local(again[k])) for k in state)
    worst = 0.0
    for training in (False, True):
        CLOCK[0] += 2
        lengths, values = batch(7 + training, world)
        outs = []
        for m in (first, second, third):
            m.train(training)
            outs.append(_pooled(m(kjt(lengths, values, lo, hi))[0])[0])
        worst = max(worst, diff(outs[0], outs[1]), diff(outs[0], outs[2]))
    result["after_load"] = worst
    return result


def dmp_case(rank: int, world: int, build: Any, sharder: Any) -> dict[str, Any]:
    """DistributedModelParallel with an explicit row-wise plan over a model holding the module trains as the module
    sharded by hand (same plan, same fused SGD) under the same dense layer."""
    from tritonrec.dist import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan, row_wise

    module = make_module(5, ttl=True, remapped=False)
    torch.manual_seed(4)
    model = Model(copy.deepcopy(module), 11, _pooled)  # pooled [B, 4 + 4 + 3]
    reference = build(module)
    dense = copy.deepcopy(model.dense)
    per_table = {"t0": row_wise(), "t1": row_wise()}
    plan = ShardingPlan({"mc": construct_module_sharding_plan(module, per_table, sharder, world, world, "cpu")})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    for sharding in dmp.module.mc._embedding_module.shardings:
        sharding.lookup.backend = "torch"
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    worst = 0.0
    for step in range(3):
        CLOCK[0] += 2
        lengths, values = batch(step, world)
        got = dmp(kjt(lengths, values, lo, hi))
        embeddings, _ = reference(kjt(lengths, values, lo, hi))
        want = sum(dense(t).sum() for t in _pooled(embeddings))
        worst = max(worst, abs(float(got.detach()) - float(want.detach())))
        got.backward()
        want.backward()
    kinds = sorted({p.sharding_type for p in dmp.plan.plan["mc"].values()})
    return {"loss": worst, "kinds": kinds}


def refusals(world: int, sharder: Any, env: Any) -> dict[str, str]:
    """``name: "Error: message"`` of each plan or module the sharding refuses (t0 is the culprit in each)."""
    from tritonrec.dist import construct_module_sharding_plan, row_wise, table_wise

    cases = {
        "table_wise": (make_module(1), {"t0": table_wise(rank=0)}),
        "few_buckets": (make_module(1, t0={"buckets": 1}), {}),
        "uneven_buckets": (_twelve_rows(), {}),
        "misaligned": (make_module(1, t0={"output_segments": [0, 2, 4, 6, 16]}), {}),
        "disable_fallback": (make_module(1, t0={"disable_fallback": True}), {}),
    }
    messages = {}
    for name, (module, per_table) in cases.items():
        # the inner module's plan: the sharder's own planning would refuse the table-wise plan before the module
        plan = construct_module_sharding_plan(
            module._embedding_module, {"t0": row_wise(), "t1": row_wise(), **per_table}, None, world, world, "cpu"
        )
        try:
            sharder.shard(module, plan, env, torch.device("cpu"))
        except (ValueError, NotImplementedError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def _twelve_rows() -> Any:
    """t0 with 12 rows in 3 buckets (``total_num_buckets % world != 0``)."""
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from tritonrec.modules.mc_modules import ManagedCollisionCollection

    configs = [
        EmbeddingBagConfig(num_embeddings=12, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=12, embedding_dim=3, name="t1", feature_names=["f2"]),
    ]
    mcms = {"t0": hash_zch(12, 3, 0, False), "t1": hash_zch(12, 2, 50, False)}
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(configs, backend="torch"), ManagedCollisionCollection(mcms, configs)
    )


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from tritonrec.modules.mc_hash_zch import HashZchManagedCollisionModule

    torch.set_num_threads(1)
    HashZchManagedCollisionModule._current_hour = _pinned_hour  # type: ignore[method-assign]
    sharder, env, build = shard_setup(ManagedCollisionEmbeddingBagCollectionSharder, world)
    out: dict[str, Any] = {}
    for ttl in (False, True):
        CLOCK[0] = 1000
        out[f"ttl={ttl}"] = stream(rank, world, build, make_module(1, ttl), ttl)
    out["t0_ranged"] = stream(rank, world, build, make_module(1, True, t0={"size": 400}), True)  # t0 with H > 0 too
    for policy in ("lru", "per_feature", "opt_in"):  # the other eviction policies and opt-in, sharded
        CLOCK[0] = 1000
        out[policy] = stream(rank, world, build, make_module(1, policy), True)
    CLOCK[0] = 1000
    out["not_remapped"] = stream(rank, world, build, make_module(1, True, remapped=False), True)
    out["mixed"] = mixed_case(rank, world, build)
    from tests.sharding.hash_zch_ec_cases import ec_stream  # the MC-EC's stream, in this one spawn

    out["ec"] = ec_stream(rank, world)
    out["state"] = state_case(rank, world, build)
    out["dmp"] = dmp_case(rank, world, build, sharder)
    out["refusals"] = refusals(world, sharder, env)
    return out
