"""Rank-side cases for a variable batch per feature (VBE) through the sharded managed-collision EBC (row-wise), as
torchrec 1.8 takes it: each rank's KJT has its own batch size per feature (``stride_per_key_per_rank``) and
``inverse_indices [F, B]`` expanding it to ``B`` samples. The reference is mc_cases.py's decomposition of torchrec's
sharded module (:class:`tests.sharding.mc_cases.Reference`) fed the same per-rank bags, padded to ``BATCH`` bags per
rank with empty bags (which the MCH modules never see), and one unsharded EBC looking the remapped bags up; its
pooled rows are expanded with each rank's inverse indices. Also the refusals: VBE with ``return_remapped_features``
(torchrec's refusal), without inverse indices, into the MC-EC. VBE over hash ZCH tables against the unsharded module
fed the padded global batch. The MC-EC index dedup cases are
mc_dedup_cases.py's, run in this spawn."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.sharding.mc_cases import (
    BATCH,
    FEATURES,
    HASH,
    STEPS,
    TABLES,
    Reference,
    _state_mismatches,
    count_evictions,
    make_module,
    sgd_step,
    shard_setup,
    shard_weight_diff,
)
from tritonrec.data import KeyedJaggedTensor

DIMS = [4, 4, 3]  # output columns per feature (f0, f1 read t0; f2 reads t1)


def vbe_batch(step: int, world: int) -> list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], torch.Tensor]]:
    """Per rank: per feature its batch size ``b_f`` (1..BATCH), ``[b_f]`` bag lengths and ids, and the inverse
    indices ``[F, BATCH]`` (values in ``[0, b_f)``), skewed ids so that evictions happen."""
    g = torch.Generator().manual_seed(900 + step)
    sizes = [HASH["t0"], HASH["t0"], HASH["t1"]]
    out = []
    for _ in range(world):
        strides = [int(torch.randint(1, BATCH + 1, (1,), generator=g)) for _ in FEATURES]
        lengths = [torch.randint(0, 4, (b,), generator=g) for b in strides]
        values = [(torch.rand(int(n.sum()), generator=g) ** 2 * s).long() for n, s in zip(lengths, sizes, strict=True)]
        inverse = torch.stack([torch.randint(0, b, (BATCH,), generator=g) for b in strides])
        out.append((strides, lengths, values, inverse))
    return out


def vbe_kjt(
    strides: list[int], lengths: list[torch.Tensor], values: list[torch.Tensor], inverse: Any, order: Any = None
) -> Any:
    """The rank's VBE KJT, its keys (and inverse-index rows) in ``order`` (feature indices; FEATURES' by default)."""
    order = order or range(len(FEATURES))
    return KeyedJaggedTensor(
        keys=[FEATURES[i] for i in order],
        values=torch.cat([values[i] for i in order]),
        lengths=torch.cat([lengths[i] for i in order]),
        stride_per_key_per_rank=[[strides[i]] for i in order],
        inverse_indices=None if inverse is None else ([FEATURES[i] for i in order], inverse[list(order)]),
    )


def padded(batch: list[Any], world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The ranks' bags as a global fixed batch: ``lengths [F, world * BATCH]`` (rank ``r``'s bag ``j`` of feature
    ``f`` at column ``r * BATCH + j``, empty bags after its ``b_f``) and per-feature ids in that order."""
    lengths = torch.zeros(len(FEATURES), world * BATCH, dtype=torch.int64)
    values = []
    for f in range(len(FEATURES)):
        for r, (_, per_rank_lengths, _, _) in enumerate(batch):
            lengths[f, r * BATCH : r * BATCH + per_rank_lengths[f].numel()] = per_rank_lengths[f]
        values.append(torch.cat([per_rank_values[f] for _, _, per_rank_values, _ in batch]))
    return lengths, values


def expand(full: torch.Tensor, inverse: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[BATCH, sum(D)]`` output of the padded global one: feature ``f``'s columns of sample ``i``
    are its bag ``inverse[f, i]`` (torchrec's VBE output)."""
    blocks = full[rank * BATCH : (rank + 1) * BATCH].split(DIMS, dim=1)
    return torch.cat([b.index_select(0, inverse[f]) for f, b in enumerate(blocks)], dim=1)


def vbe_stream(rank: int, world: int, build: Any, pooling: str) -> dict[str, Any]:
    """STEPS VBE batches (one in eval mode) through the sharded MC-EBC against the reference: remapped-row
    mismatches, largest output / weight difference after fused SGD, MCH buffer mismatches, whether it evicted."""
    from tritonrec.dist import get_gradient_division

    module = make_module(1, pooling)
    sharded = build(module)
    shards = sharded._embedding_module._tables
    ref = Reference(module, world, {t: [s.rows for s in shards[i].shards] for i, t in enumerate(TABLES)})
    result: dict[str, Any] = {"rows": 0, "forward": 0.0, "weights": 0.0, "state": 0, "shape": None}
    recorded: list[KeyedJaggedTensor] = []
    inner = sharded._embedding_module.input_transform

    def record(ctx: Any, sharding: Any, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        recorded.append(inner(ctx, sharding, kjt))
        return recorded[-1]

    sharded._embedding_module.input_transform = record
    divide = world if get_gradient_division() else 1
    bags = ref.module._embedding_module.embedding_bags
    for step in range(STEPS):
        training = step != STEPS - 2
        sharded.train(training)
        ref.set_mode(training)
        batch = vbe_batch(step, world)
        recorded.clear()
        pooled, returned = sharded(vbe_kjt(*batch[rank], order=[2, 0, 1] if step % 2 else None))  # keys permuted too
        assert returned.wait() is None
        got = pooled.wait().values()
        result["shape"] = list(got.shape)
        lengths, values = padded(batch, world)
        rows, per_rank = ref.remap(lengths, values)
        full = ref.module._embedding_module(
            KeyedJaggedTensor(keys=FEATURES, values=torch.cat(rows), lengths=lengths.flatten())
        ).values()
        grads = [torch.randn(BATCH, sum(DIMS), generator=torch.Generator().manual_seed(70 + 10 * step + r))
                 for r in range(world)]  # fmt: skip
        want = expand(full, batch[rank][3], rank)
        result["forward"] = max(result["forward"], float((got - want).detach().abs().amax()))
        (remapped,) = recorded
        segments = dict(zip(remapped.keys(), remapped.values().split(remapped.length_per_key()), strict=True))
        offsets = sharded._managed_collision_collection._table_to_offset
        for table, features in TABLES.items():
            mine = torch.cat([segments[f] for f in features]) + offsets[table]
            result["rows"] += int(not torch.equal(mine, per_rank[(table, rank)]))
        if training:
            (got * grads[rank]).sum().backward()
            sum((expand(full, b[3], r) * grads[r]).sum() for r, b in enumerate(batch)).backward()  # type: ignore[union-attr]
            sgd_step(bags, divide)
        result["weights"] = max(result["weights"], shard_weight_diff(sharded._embedding_module.embedding_bags, bags))
        result["state"] += _state_mismatches(sharded, ref, rank)
    result["open_slots"] = {t: int(v) for t, v in sharded._managed_collision_collection.open_slots().items()}
    return result


def hash_zch_vbe_stream(rank: int, world: int, build: Any) -> dict[str, Any]:
    """VBE batches through the sharded MC-EBC over hash ZCH tables (hash_zch_cases.py's module, SINGLE_TTL under its
    pinned clock) against the unsharded module fed the padded global batch (its choices are the sharded ones there):
    largest output / weight difference after fused SGD and the rows the unsharded module evicted."""
    from tests.sharding import hash_zch_cases as hz
    from tritonrec.dist import get_gradient_division

    module = hz.make_module(1, True, remapped=False)
    sharded, ref = build(module), copy.deepcopy(module)
    out: dict[str, Any] = {"forward": 0.0, "weights": 0.0, "evicted": 0}
    divide = world if get_gradient_division() else 1
    hz.CLOCK[0] = 1000
    count_evictions(ref, out)
    for step in range(STEPS):
        hz.CLOCK[0] += 2
        training = step != STEPS - 2
        sharded.train(training)
        ref.train(training)
        batch = vbe_batch(step, world)
        got = sharded(vbe_kjt(*batch[rank]))[0].wait().values()
        lengths, values = padded(batch, world)
        full = ref(KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths.flatten()))[0].values()
        out["forward"] = max(out["forward"], float((got - expand(full, batch[rank][3], rank)).detach().abs().amax()))
        if training:
            seed = torch.Generator().manual_seed(step)
            grads = [torch.randn(BATCH, sum(DIMS), generator=seed) for _ in range(world)]
            (got * grads[rank]).sum().backward()
            sum((expand(full, b[3], r) * grads[r]).sum() for r, b in enumerate(batch)).backward()  # type: ignore[union-attr]
            sgd_step(ref._embedding_module.embedding_bags, divide)
        worst = shard_weight_diff(sharded._embedding_module.embedding_bags, ref._embedding_module.embedding_bags)
        out["weights"] = max(out["weights"], worst)
    return out


def vbe_refusals(rank: int, world: int, build: Any) -> dict[str, str]:
    """The messages (``type: text``) of the VBE inputs refused: with return_remapped_features, without inverse
    indices, on hash ZCH tables, into the MC-EC."""
    from tests.sharding.mc_ec_cases import make_ec_module
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    strides, lengths, values, inverse = vbe_batch(0, world)[rank]
    _, _, build_ec = shard_setup(ManagedCollisionEmbeddingCollectionSharder, world)
    cases = {
        "remapped": (build(make_module(1, "SUM", True)), inverse),
        "no_inverse": (build(make_module(1)), None),
        "ec": (build_ec(make_ec_module(1)), inverse),
    }
    messages = {}
    for name, (module, inv) in cases.items():
        try:
            module(vbe_kjt(strides, lengths, values, inv))
            messages[name] = "accepted"
        except (NotImplementedError, ValueError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def run_vbe_suite(rank: int, world: int) -> dict[str, Any]:
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    _, _, build = shard_setup(ManagedCollisionEmbeddingBagCollectionSharder, world)
    out: dict[str, Any] = {p: vbe_stream(rank, world, build, p) for p in ("SUM", "MEAN")}
    out["refusals"] = vbe_refusals(rank, world, build)
    from tests.sharding.hash_zch_cases import _pinned_hour
    from tritonrec.modules.mc_hash_zch import HashZchManagedCollisionModule

    HashZchManagedCollisionModule._current_hour = _pinned_hour  # type: ignore[method-assign]
    out["hash_zch"] = hash_zch_vbe_stream(rank, world, build)
    from tests.sharding.mc_dedup_cases import run_dedup_suite

    out["dedup"] = run_dedup_suite(rank, world)
    return out
