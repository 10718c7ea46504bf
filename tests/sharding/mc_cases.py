"""Rank-side cases for the sharded managed-collision EBC (row-wise), against torchrec's decomposition written out:
per table, one unsharded MCH module per rank, rebuilt over that rank's rows (``rebuild_with_output_id_range``),
fed the global batch's raw ids of that rank's raw-id range (features in config order, each feature's ids rank by
rank), and one unsharded EBC looking the remapped global batch up (fused SGD written out as ``w -= lr * grad``);
the rows each rank's module hands to new ids get ``init_fn``'s rows before the lookup (torchrec's sharded module)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor

FEATURES = ["f0", "f1", "f2"]
TABLES = {"t0": ["f0", "f1"], "t1": ["f2"]}
BATCH = 3  # samples per rank
LR = 0.1
STEPS = 6
HASH = {"t0": 64, "t1": 40}  # input_hash_size per table
Outputs = Callable[[Any], list[torch.Tensor]]  # an MC module's embeddings (or their lazy awaitable) -> its tensors


def _hash(ids: torch.Tensor, size: int) -> torch.Tensor:
    return (ids * 7 + 3) % size


def reset_init(rows: torch.Tensor) -> torch.Tensor:
    """The tables' ``init_fn`` after the initial draw: a function of the shape only, so every redraw is reproducible."""
    g = torch.Generator().manual_seed(1000 * rows.shape[0] + rows.shape[1])
    return rows.copy_(torch.rand(rows.shape, generator=g) - 0.5)


def managed_collision(configs: list[Any]) -> Any:
    """The MCH modules of both suites' tables: t0 (10 rows, LFU) and t1 (8 rows, LRU behind an input hash)."""
    from tritonrec.modules import mc_modules as mc

    mcms = {
        "t0": mc.MCHManagedCollisionModule(10, "cpu", mc.LFU_EvictionPolicy(), 1, input_hash_size=HASH["t0"]),
        "t1": mc.MCHManagedCollisionModule(
            8, "cpu", mc.LRU_EvictionPolicy(), 2, input_hash_size=HASH["t1"], input_hash_func=_hash
        ),
    }
    return mc.ManagedCollisionCollection(mcms, configs)


def make_module(seed: int, pooling: str = "SUM", remapped: bool = False) -> Any:
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(
            num_embeddings=8, embedding_dim=3, name="t1", feature_names=["f2"], pooling=PoolingType[pooling]
        ),
    ]
    ebc = EmbeddingBagCollection(configs, backend="torch")
    for config in configs:
        config.init_fn = reset_init
    return ManagedCollisionEmbeddingBagCollection(ebc, managed_collision(configs), return_remapped_features=remapped)


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
        ids = [v.clone() for v in values]
        rows = [torch.empty_like(v) for v in values]
        per_rank: dict[tuple[str, int], torch.Tensor] = {}
        sample_of = [torch.repeat_interleave(torch.arange(lengths.shape[1]), lengths[i]) for i in range(len(FEATURES))]
        for table, features in TABLES.items():
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
                self.reset(table, mch.evict())
                for (i, p), part in zip(picks, out.split([p.numel() for _, p in picks]), strict=True):
                    rows[i][p] = part
        return rows, per_rank

    def reset(self, table: str, rows: torch.Tensor | None) -> None:
        """torchrec's sharded eviction: the (global) rows a rank's module handed to new ids get ``init_fn``'s rows."""
        inner = self.module._embedding_module
        weight = (inner.embedding_bags if hasattr(inner, "embedding_bags") else inner.embeddings)[table].weight
        if rows is not None:
            with torch.no_grad():
                weight[rows] = reset_init(weight[rows].clone())

    def set_mode(self, training: bool) -> None:
        for modules in self.mch.values():
            for m in modules:
                m.train(training)


def shard_setup(sharder_type: Any, world: int, optim: str = "EXACT_SGD") -> tuple[Any, Any, Callable[[Any], Any]]:
    """A ``sharder_type`` sharder (fused ``optim``, SGD by default, at ``LR``), the WORLD group's env, and
    ``build(module)``: a copy of the module sharded row-wise by it, torch lookups."""
    import torch.distributed as dist

    from tritonrec.dist import ShardingEnv, construct_module_sharding_plan, row_wise
    from tritonrec.kernels.embedding import OptimType

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder = sharder_type(fused_params={"optimizer": OptimType[optim], "learning_rate": LR, "backend": "torch"})

    def build(module: Any) -> Any:
        plan = construct_module_sharding_plan(
            module, {"t0": row_wise(), "t1": row_wise()}, sharder, world, world, "cpu"
        )
        sharded = sharder.shard(copy.deepcopy(module), plan, env, torch.device("cpu"))
        for sharding in sharded._embedding_module.shardings:
            sharding.lookup.backend = "torch"
        return sharded

    return sharder, env, build


def run_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    sharder, env, build = shard_setup(ManagedCollisionEmbeddingBagCollectionSharder, world)
    out: dict[str, Any] = {}
    for pooling in ("SUM", "MEAN"):
        out[pooling] = TrainingStream(rank, world, build, make_module(1, pooling), remapped=False).run()
    out["SUM_remapped"] = TrainingStream(rank, world, build, make_module(1, "SUM", True), remapped=True).run()
    out["state"] = state_case(rank, world, build, make_module, _pooled)
    out["refusals"] = refusals(world, sharder, env, make_module(1))
    out["dmp"] = dmp_case(rank, world, build, sharder, make_module(3), 11, _pooled)  # pooled [B, 4 + 4 + 3]
    from tests.sharding.mc_pipeline_cases import pipeline_case

    out["pipeline"] = pipeline_case(rank, world, sharder)
    from tests.sharding.mc_ec_cases import run_ec_suite  # the MC-EC's cases, in this one spawn
    from tests.sharding.mc_reset_cases import run_reset_suite

    out["ec"] = run_ec_suite(rank, world)
    out["reset"] = run_reset_suite(rank, world)
    return out


def _pooled(embeddings: Any) -> list[torch.Tensor]:
    """The MC-EBC's output (a KeyedTensor or its lazy awaitable, as user code reads it): ``[B, sum(D)]``."""
    return [embeddings.values()]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (0 for empty tensors; shapes must agree)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).detach().abs().amax()) if a.numel() else 0.0


def sgd_step(tables: Any, divide: int) -> None:
    """The reference's update: plain SGD on each table of ``tables`` (a module dict of tables with ``.weight``),
    its gradient divided as the sharded lookups' (``divide``: the world size under gradient division)."""
    with torch.no_grad():
        for table in tables.values():
            table.weight -= LR * table.weight.grad / divide
            table.weight.grad = None


def shard_weight_diff(sharded_tables: Any, whole_tables: Any) -> float:
    """Largest difference between this rank's row shards (``sharded_tables[t].local``) and the same rows of the
    reference's whole tables."""
    worst = 0.0
    for table, sharded_table in sharded_tables.items():
        whole = whole_tables[table].weight
        for shard, weight in sharded_table.local:
            s = shard.spec
            worst = max(worst, diff(weight.weight, whole[s.row_offset : s.row_offset + s.rows]))
    return worst


def count_evictions(reference: Any, out: dict[str, Any]) -> None:
    """Wrap the reference MC module's ``evict`` so that ``out["evicted"]`` counts the rows it evicts."""
    evict = reference._managed_collision_collection.evict

    def counting_evict() -> dict[str, Any]:
        evictions = evict()
        out["evicted"] += sum(0 if v is None else v.numel() for v in evictions.values())
        return evictions

    reference._managed_collision_collection.evict = counting_evict


class TrainingStream:
    """One rank's training stream against :class:`Reference`: ``STEPS`` global batches (inserts and evictions, one
    eval-mode step that only remaps), this rank's samples fed to the sharded MC-EBC's ``forward``. Counted in
    ``result``: the remapped rows this rank looked up that differ from its reference modules' outputs (``rows``), the
    largest pooled-output difference (``forward``), the returned remapped KJT's mismatches with ``remapped``
    (return_remapped_features=True; otherwise it must be None), the table shards' largest difference after fused SGD
    (``weights``), the MCH buffer mismatches (``state``), the open slots at the end; ``outputs``: the embeddings per
    step. The MC-EC's stream overrides ``forward`` and ``compare``."""

    tables = "embedding_bags"  # the inner module's {table: weights} attribute

    def __init__(self, rank: int, world: int, build: Callable[[Any], Any], module: Any, remapped: bool) -> None:
        self.rank, self.world, self.remapped = rank, world, remapped
        self.sharded = build(module)
        shards = self.sharded._embedding_module._tables
        self.ref = Reference(module, world, {t: [s.rows for s in shards[i].shards] for i, t in enumerate(TABLES)})
        self.lo, self.hi = rank * BATCH, (rank + 1) * BATCH
        self.result: dict[str, Any] = {"rows": 0, "forward": 0.0, "weights": 0.0, "state": 0, "returned": 0}
        self.result["outputs"] = []

    def forward(self, features: KeyedJaggedTensor, training: bool) -> tuple[Any, KeyedJaggedTensor | None]:
        """The sharded module's embeddings of this rank's ``features`` and its returned remapped KJT, both waited."""
        pooled, returned = self.sharded(features)
        returned = returned.wait()
        return pooled.wait().values(), returned

    def compare(self, embeddings: Any, full: Any, lengths: torch.Tensor, step: int) -> tuple[Any, Any]:
        """Record the embeddings and their difference from the reference's output of the global batch (``full``);
        return this rank's loss and the reference's under one random output gradient."""
        full = full.values()
        grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(77 + step))
        self.result["outputs"].append(embeddings.detach().clone())
        mine = full[self.lo : self.hi]
        self.result["forward"] = max(self.result["forward"], float((embeddings - mine).detach().abs().max()))
        return (embeddings * grad[self.lo : self.hi]).sum(), (full * grad).sum()

    def run(self) -> dict[str, Any]:
        from tritonrec.dist import get_gradient_division

        sharded, ref, result, lo, hi = self.sharded, self.ref, self.result, self.lo, self.hi
        recorded: list[KeyedJaggedTensor] = []
        inner = sharded._embedding_module.input_transform

        def record(ctx: Any, sharding: Any, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
            remapped = inner(ctx, sharding, kjt)
            recorded.append(remapped)
            return remapped

        sharded._embedding_module.input_transform = record
        # the output dist's backward divides by the world size (torchrec's gradient division, on by default)
        divide = self.world if get_gradient_division() else 1
        for step in range(STEPS):
            training = step != STEPS - 2  # one eval-mode step: remap only, state unchanged
            sharded.train(training)
            ref.set_mode(training)
            lengths, values = _batch(step, self.world)
            recorded.clear()
            embeddings, returned = self.forward(_slice(lengths, values, lo, hi), training)
            rows, per_rank = ref.remap(lengths, values)
            if self.remapped:
                result["returned"] += int(not _same_kjt(returned, _slice(lengths, rows, lo, hi)))
            else:
                assert returned is None
            remapped_kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.cat(rows), lengths=lengths.flatten())
            loss, loss_full = self.compare(embeddings, ref.module._embedding_module(remapped_kjt), lengths, step)
            # the remapped rows this rank looked up (made global again) = its reference modules' outputs
            (got,) = recorded
            segments = dict(zip(got.keys(), got.values().split(got.length_per_key()), strict=True))
            offsets = sharded._managed_collision_collection._table_to_offset
            for table, features in TABLES.items():
                mine = torch.cat([segments[f] for f in features]) + offsets[table]
                result["rows"] += int(not torch.equal(mine, per_rank[(table, self.rank)]))
            if training:
                loss.backward()
                loss_full.backward()
                sgd_step(getattr(ref.module._embedding_module, self.tables), divide)
            whole_tables = getattr(ref.module._embedding_module, self.tables)
            worst = shard_weight_diff(getattr(sharded._embedding_module, self.tables), whole_tables)
            result["weights"] = max(result["weights"], worst)
            result["state"] += _state_mismatches(sharded, ref, self.rank)
        result["open_slots"] = {t: int(v) for t, v in sharded._managed_collision_collection.open_slots().items()}
        return result


class Model(torch.nn.Module):
    """A model holding an MC module as user code calls it: ``embeddings, _ = mc(kjt)``, then one dense layer over
    every output tensor (``outputs`` reads them off the lazy awaitable)."""

    def __init__(self, mc: Any, width: int, outputs: Outputs) -> None:
        super().__init__()
        self.mc = mc
        self.dense = torch.nn.Linear(width, 1)
        self.outputs = outputs

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embeddings, _ = self.mc(kjt)
        return sum(self.dense(t).sum() for t in self.outputs(embeddings))  # type: ignore[return-value]


def dmp_case(rank: int, world: int, build: Any, sharder: Any, module: Any, width: int, outputs: Outputs) -> dict:
    """DistributedModelParallel over a model holding the MC module (the planner's plan, the sharder given) trains as
    the module sharded by hand (same row-wise plan, same fused SGD) under the same dense layer."""
    from tritonrec.dist import DistributedModelParallel

    torch.manual_seed(4)
    model = Model(copy.deepcopy(module), width, outputs)
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
        want = sum(dense(t).sum() for t in outputs(embeddings))
        worst = max(worst, abs(float(got.detach()) - float(want.detach())))
        got.backward()
        want.backward()
    kinds = sorted({p.sharding_type for p in dmp.plan.plan["mc"].values()})
    return {"loss": worst, "kinds": kinds}


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


def state_case(rank: int, world: int, build: Any, make: Callable[[int], Any], outputs: Outputs) -> dict[str, Any]:
    """Three training batches, then the state dict (its keys, ``ShardedTensor`` sizes) loaded into a module built
    from another seed: the same state dict again and, in eval mode, the same embeddings (``outputs`` of each)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    first = build(make(1))
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(3):
        lengths, values = _batch(step, world)
        out, _ = first(_slice(lengths, values, lo, hi))
        sum(t.sum() for t in outputs(out)).backward()  # type: ignore[union-attr]
    state = first.state_dict()
    second = build(make(2))
    second.load_state_dict(state)
    again = second.state_dict()
    same = all(_local(state[k]).equal(_local(again[k])) for k in state)
    lengths, values = _batch(9, world)
    first.eval()  # eval: the non-persistent history (pending window) is not in the state dict, as in torchrec
    second.eval()
    a = outputs(first(_slice(lengths, values, lo, hi))[0])
    b = outputs(second(_slice(lengths, values, lo, hi))[0])
    after = max(diff(x, y) for x, y in zip(a, b, strict=True))
    sharded_keys = sorted(k for k, v in state.items() if isinstance(v, ShardedTensor))
    sizes = {k: list(v.size()) for k, v in state.items() if isinstance(v, ShardedTensor)}
    return {"keys": sorted(state), "sharded_keys": sharded_keys, "sizes": sizes, "round_trip": same,
            "after_load": after}  # fmt: skip


def _local(value: Any) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value


def refusals(world: int, sharder: Any, env: Any, module: Any) -> dict[str, str]:
    """The messages of a plan with t1 table-wise, refused by the sharder's planning and by the sharded module (given
    the inner module's plan, which the sharder does not vet)."""
    from tritonrec.dist import construct_module_sharding_plan, row_wise, table_wise

    messages, per_table = {}, {"t0": row_wise(), "t1": table_wise(rank=0)}
    try:
        construct_module_sharding_plan(module, per_table, sharder, world, world, "cpu")
    except ValueError as error:
        messages["plan"] = str(error)
    inner_plan = construct_module_sharding_plan(module._embedding_module, per_table, None, world, world, "cpu")
    try:
        sharder.shard(module, inner_plan, env, torch.device("cpu"))
    except ValueError as error:
        messages["shard"] = str(error)
    return messages
