"""Rank-side cases for the sharded managed-collision EBC (row-wise), against torchrec's decomposition written out:
per table, one unsharded MCH module per rank, rebuilt over that rank's rows (``rebuild_with_output_id_range``),
fed the global batch's raw ids of that rank's raw-id range (features in config order, each feature's ids rank by
rank), and one unsharded EBC looking the remapped global batch up (fused SGD written out as ``w -= lr * grad``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor

FEATURES = ["f0", "f1", "f2"]
BATCH = 3  # samples per rank
LR = 0.1
STEPS = 6
HASH = {"t0": 64, "t1": 40}  # input_hash_size per table


def _hash(ids: torch.Tensor, size: int) -> torch.Tensor:
    return (ids * 7 + 3) % size


def make_module(seed: int, pooling: str = "SUM", remapped: bool = False) -> Any:
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from tritonrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(
            num_embeddings=8, embedding_dim=3, name="t1", feature_names=["f2"], pooling=PoolingType[pooling]
        ),
    ]
    ebc = EmbeddingBagCollection(configs, backend="torch")
    mcms = {
        "t0": MCHManagedCollisionModule(10, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=HASH["t0"]),
        "t1": MCHManagedCollisionModule(
            8, "cpu", LRU_EvictionPolicy(), 2, input_hash_size=HASH["t1"], input_hash_func=_hash
        ),
    }
    return ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(mcms, configs), return_remapped_features=remapped
    )


def _batch(step: int, world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Global batch: ``lengths [F, world * BATCH]`` and per-feature raw ids (skewed, so evictions happen)."""
    g = torch.Generator().manual_seed(500 + step)
    lengths = torch.randint(0, 4, (len(FEATURES), world * BATCH), generator=g)
    sizes = [HASH["t0"], HASH["t0"], HASH["t1"]]
    values = [(torch.rand(int(n), generator=g) ** 2 * s).long() for n, s in zip(lengths.sum(1), sizes, strict=True)]
    return lengths, values


def _slice(lengths: torch.Tensor, values: list[torch.Tensor], lo: int, hi: int) -> KeyedJaggedTensor:
    parts, vals = [], []
    for i in range(len(FEATURES)):
        start, n = int(lengths[i, :lo].sum()), int(lengths[i, lo:hi].sum())
        parts.append(lengths[i, lo:hi])
        vals.append(values[i][start : start + n])
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(vals), lengths=torch.cat(parts))


class Reference:
    """torchrec's decomposition on one process: per table ``W`` rebuilt MCH modules and one EBC."""

    def __init__(self, module: Any, world: int, blocks: dict[str, list[int]]) -> None:
        self.module = copy.deepcopy(module)
        self.world = world
        self.mcc = self.module._managed_collision_collection
        self.mch: dict[str, list[Any]] = {}
        for table, rows in blocks.items():
            starts = [sum(rows[:r]) for r in range(world)]
            segments = [*starts, sum(rows)]
            base = self.mcc._managed_collision_modules[table]
            self.mch[table] = [
                base.rebuild_with_output_id_range((starts[r], starts[r] + rows[r]), segments) for r in range(world)
            ]

    def remap(self, lengths: torch.Tensor, values: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        """Global raw ids -> global rows per feature, and per (table, rank) the rows that rank's module output."""
        tables = {"t0": ["f0", "f1"], "t1": ["f2"]}
        ids = [v.clone() for v in values]
        rows = [torch.empty_like(v) for v in values]
        per_rank: dict[tuple[str, int], torch.Tensor] = {}
        sample_of = [torch.repeat_interleave(torch.arange(lengths.shape[1]), lengths[i]) for i in range(len(FEATURES))]
        for table, features in tables.items():
            size = HASH[table]
            idx = [FEATURES.index(f) for f in features]
            if table == "t1":  # input_hash_func runs on the sample-owning rank, before bucketing
                for i in idx:
                    ids[i] = _hash(ids[i], size)
            block = -(-size // self.world)
            for r, mch in enumerate(self.mch[table]):
                picks = []  # (feature, positions) in the order rank r receives them: feature, then source rank
                for i in idx:
                    for src in range(self.world):
                        mine = (ids[i] // block == r) & (sample_of[i] // BATCH == src)
                        picks.append((i, mine.nonzero().flatten()))
                stream = torch.cat([ids[i][p] for i, p in picks])
                jt = JaggedTensor(values=stream, lengths=torch.tensor([stream.numel()]))
                out = mch.remap(mch.profile({table: jt}))[table].values()
                per_rank[(table, r)] = out
                for (i, p), part in zip(picks, out.split([p.numel() for _, p in picks]), strict=True):
                    rows[i][p] = part
        return rows, per_rank

    def set_mode(self, training: bool) -> None:
        for modules in self.mch.values():
            for m in modules:
                m.train(training)


def run_suite(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan, row_wise
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from tritonrec.kernels.embedding import OptimType

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
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

    out: dict[str, Any] = {}
    for pooling in ("SUM", "MEAN"):
        out[pooling] = _training_case(rank, world, build, pooling)
    out["SUM_remapped"] = _training_case(rank, world, build, "SUM", remapped=True)
    out["state"] = _state_case(rank, world, build)
    out["refusals"] = _refusals(world, sharder, env)
    out["dmp"] = _dmp_case(rank, world, build, sharder)
    out["pipeline"] = _pipeline_case(rank, world, sharder)
    from tests.sharding.mc_ec_cases import run_ec_suite  # the MC-EC's cases, in this one spawn

    out["ec"] = run_ec_suite(rank, world)
    return out


class _Model(torch.nn.Module):
    """A model holding an MC-EBC as user code calls it: ``embeddings, _ = mc_ebc(kjt)``, then a dense layer."""

    def __init__(self, mc: Any) -> None:
        super().__init__()
        self.mc = mc
        self.dense = torch.nn.Linear(11, 1)  # pooled [B, 4 + 4 + 3]

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embeddings, _ = self.mc(kjt)
        return self.dense(embeddings.values()).sum()


def _dmp_case(rank: int, world: int, build: Any, sharder: Any) -> dict[str, Any]:
    """DistributedModelParallel over a model holding the MC-EBC (the planner's plan, the sharder given) trains as the
    module sharded by hand (same row-wise plan, same fused SGD) under the same dense layer."""
    from tritonrec.dist import DistributedModelParallel

    module = make_module(3)
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
        pooled, _ = reference(_slice(lengths, values, lo, hi))
        want = dense(pooled.wait().values()).sum()
        worst = max(worst, abs(float(got.detach()) - float(want.detach())))
        got.backward()
        want.backward()
    kinds = sorted({p.sharding_type for p in dmp.plan.plan["mc"].values()})
    return {"loss": worst, "kinds": kinds}


def _training_case(rank: int, world: int, build: Any, pooling: str, remapped: bool = False) -> dict[str, Any]:
    """With ``remapped`` (return_remapped_features=True): the returned KJT = the reference's rows of this rank's
    samples (``result["returned"]`` counts mismatches); ``result["outputs"]``: the pooled outputs per step."""
    from tritonrec.dist import get_gradient_division

    module = make_module(1, pooling, remapped)
    sharded = build(module)
    blocks = {t: [s.rows for s in sharded._embedding_module._tables[i].shards] for i, t in enumerate(("t0", "t1"))}
    ref = Reference(module, world, blocks)
    recorded: list[KeyedJaggedTensor] = []
    inner = sharded._embedding_module.input_transform

    def record(ctx: Any, sharding: Any, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        remapped = inner(ctx, sharding, kjt)
        recorded.append(remapped)
        return remapped

    sharded._embedding_module.input_transform = record
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    # the reduce-scatter's backward divides by the world size (torchrec's gradient division, on by default)
    divide = world if get_gradient_division() else 1
    result: dict[str, Any] = {"rows": 0, "forward": 0.0, "weights": 0.0, "state": 0, "returned": 0, "outputs": []}
    for step in range(STEPS):
        training = step != STEPS - 2  # one eval-mode step: remap only, state unchanged
        sharded.train(training)
        ref.set_mode(training)
        lengths, values = _batch(step, world)
        recorded.clear()
        pooled, returned = sharded(_slice(lengths, values, lo, hi))
        returned = returned.wait()
        rows, per_rank = ref.remap(lengths, values)
        if remapped:
            result["returned"] += int(not _same_kjt(returned, _slice(lengths, rows, lo, hi)))
        else:
            assert returned is None
        remapped_kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.cat(rows), lengths=lengths.flatten())
        full = ref.module._embedding_module(remapped_kjt).values()
        grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(77 + step))
        pooled = pooled.wait().values()
        result["outputs"].append(pooled.detach().clone())
        result["forward"] = max(result["forward"], float((pooled - full[lo:hi]).detach().abs().max()))
        # the remapped rows this rank looked up (made global again) = its reference modules' outputs
        (got,) = recorded
        segments = dict(zip(got.keys(), got.values().split(got.length_per_key()), strict=True))
        offsets = sharded._managed_collision_collection._table_to_offset
        for table, features in (("t0", ["f0", "f1"]), ("t1", ["f2"])):
            mine = torch.cat([segments[f] for f in features]) + offsets[table]
            result["rows"] += int(not torch.equal(mine, per_rank[(table, rank)]))
        if training:
            (pooled * grad[lo:hi]).sum().backward()
            (full * grad).sum().backward()
            with torch.no_grad():
                for bag in ref.module._embedding_module.embedding_bags.values():
                    bag.weight -= LR * bag.weight.grad / divide
                    bag.weight.grad = None
        for table, bag in sharded._embedding_module.embedding_bags.items():
            whole = ref.module._embedding_module.embedding_bags[table].weight
            for shard, weight in bag.local:
                s = shard.spec
                diff = (weight.weight.detach() - whole[s.row_offset : s.row_offset + s.rows]).abs().max()
                result["weights"] = max(result["weights"], float(diff))
        result["state"] += _state_mismatches(sharded, ref, rank)
    result["open_slots"] = {t: int(v) for t, v in sharded._managed_collision_collection.open_slots().items()}
    return result


def _same_kjt(got: KeyedJaggedTensor, want: KeyedJaggedTensor) -> bool:
    """Exact equality of keys, lengths, values and stride."""
    return (
        got.keys() == want.keys()
        and got.stride() == want.stride()
        and torch.equal(got.lengths(), want.lengths())
        and torch.equal(got.values(), want.values())
    )


def _state_mismatches(sharded: Any, ref: Any, rank: int) -> int:
    bad = 0
    for table, module in sharded._managed_collision_collection._managed_collision_modules.items():
        expected = dict(ref.mch[table][rank].named_buffers())
        for name, buffer in module.named_buffers():
            # history and the evicted rows are transient (the sharded module consumes the evicted rows each batch)
            if name in expected and not name.startswith("_history") and name != "_evicted_emb_indices":
                bad += int(not torch.equal(buffer, expected[name]))
    return bad


def _state_case(rank: int, world: int, build: Any) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    first = build(make_module(1))
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(3):
        lengths, values = _batch(step, world)
        pooled, _ = first(_slice(lengths, values, lo, hi))
        pooled.wait().values().sum().backward()
    state = first.state_dict()
    second = build(make_module(2))
    second.load_state_dict(state)
    again = second.state_dict()
    same = all(_local(state[k]).equal(_local(again[k])) for k in state)
    lengths, values = _batch(9, world)
    first.eval()  # eval: the non-persistent history (pending window) is not in the state dict, as in torchrec
    second.eval()
    a = first(_slice(lengths, values, lo, hi))[0].wait().values()
    b = second(_slice(lengths, values, lo, hi))[0].wait().values()
    sharded_keys = sorted(k for k, v in state.items() if isinstance(v, ShardedTensor))
    sizes = {k: list(v.size()) for k, v in state.items() if isinstance(v, ShardedTensor)}
    return {"keys": sorted(state), "sharded_keys": sharded_keys, "sizes": sizes, "round_trip": same,
            "after_load": float((a - b).abs().max())}  # fmt: skip


def _local(value: Any) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value


def _refusals(world: int, sharder: Any, env: Any) -> dict[str, str]:
    from tritonrec.dist import construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.mc_embeddingbag import ShardedManagedCollisionEmbeddingBagCollection

    module = make_module(1)
    messages = {}
    try:
        construct_module_sharding_plan(
            module, {"t0": row_wise(), "t1": table_wise(rank=0)}, sharder, world, world, "cpu"
        )
    except ValueError as error:
        messages["plan"] = str(error)
    ebc_plan = construct_module_sharding_plan(
        module._embedding_module, {"t0": row_wise(), "t1": table_wise(rank=0)}, None, world, world, "cpu"
    )
    try:
        ShardedManagedCollisionEmbeddingBagCollection(module, ebc_plan, env, device="cpu")
    except ValueError as error:
        messages["shard"] = str(error)
    return messages


class _BatchModel(torch.nn.Module):
    """``(loss, output) = model(batch)``, a pipeline's model: the MC-EBC on ``batch.sparse_features``, a dense layer."""

    def __init__(self, mc: Any) -> None:
        super().__init__()
        self.mc = mc
        self.dense = torch.nn.Linear(11, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings, _ = self.mc(batch.sparse_features)
        prediction = self.dense(embeddings.values()).squeeze(-1)
        return ((prediction - batch.labels) ** 2).mean(), prediction.detach()


def _pipeline_case(rank: int, world: int, sharder: Any) -> dict[str, Any]:
    """TrainPipelineSparseDist over a DMP model holding the MC-EBC pipelines its input dist and trains as
    TrainPipelineBase, bit for bit (the remap runs in compute, so prefetching the next input dist does not reorder
    the MCH updates)."""
    from tritonrec.data.batch import Batch
    from tritonrec.dist import DistributedModelParallel
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    def data() -> Any:
        for step in range(8):
            lengths, values = _batch(step, world)
            g = torch.Generator().manual_seed(step * 10 + rank)
            yield Batch(torch.randn(BATCH, 5, generator=g), _slice(lengths, values, rank * BATCH, (rank + 1) * BATCH),
                        torch.rand(BATCH, generator=g), torch.ones(BATCH, dtype=torch.bool))  # fmt: skip

    out: dict[str, Any] = {}
    for name, kind in (("base", TrainPipelineBase), ("sparse_dist", TrainPipelineSparseDist)):
        torch.manual_seed(4)
        dmp = DistributedModelParallel(_BatchModel(make_module(3)), device=torch.device("cpu"), sharders=[sharder])
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
    base, piped = out["base"], out["sparse_dist"]
    return {
        "losses_equal": base["losses"] == piped["losses"] and len(base["losses"]) == 8,
        "state_differs": [k for k in base["state"] if not torch.equal(base["state"][k], piped["state"][k])],
        "pipelined": piped["pipelined"],
    }
