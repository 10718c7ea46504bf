"""Rank-side case for the reset of evicted rows in the sharded MC-EBC / MC-EC under fused optimizers with state (run
from :func:`tests.sharding.mc_cases.run_suite`, in its spawn): each training forward, the local rows this rank's MCH
modules handed to new ids hold ``init_fn``'s rows and fresh optimizer state (rowwise Adagrad's ``momentum1`` zeroed,
as torchrec's FBGEMM reset; Adam's moments zeroed too), every other row of the shard and its state is unchanged bit
for bit; then the backward trains them (so the next batch starts from non-zero state)."""

from __future__ import annotations

from typing import Any

import torch

from tests.sharding.mc_cases import BATCH, _batch, _slice, make_module, reset_init, shard_setup


def _row_state(group: Any, t: int) -> dict[str, torch.Tensor]:
    """Table ``t`` of a lookup group: its fused state as ``[rows, k]`` views (k = 1 for rowwise Adagrad)."""
    from tritonrec.kernels.embedding import OptimType

    layout, state, out = group.layout, group.state, {}
    for name in ("momentum1", "momentum2"):
        flat = getattr(state, name)
        if flat is None:
            continue
        if state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
            start = layout.table_row_offsets[t]
            out[name] = flat[start : start + layout.tables[t].num_rows].view(-1, 1)
        else:
            out[name] = layout.table_view(flat, t)
    return out


def _snapshot(sharded: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per local table shard: its weight and per-row state, cloned."""
    out = {}
    for sharding in sharded._embedding_module.shardings:
        for group in sharding.lookup.groups:
            for t, (shard, module) in enumerate(zip(group.shards, group.table_group.modules, strict=True)):
                tensors = {"weight": module.weight.detach(), **_row_state(group, t)}
                out[shard.table.name] = {k: v.clone() for k, v in tensors.items()}
    return out


def reset_case(rank: int, world: int, optimizer: str, make: Any, sharder_type: Any, outputs: Any) -> dict[str, Any]:
    """Four training batches through a copy of ``make(1)`` sharded with fused ``optimizer``; counts of rows reset
    (``reset``), of reset rows whose weight or state is not the fresh one (``bad_reset``) and of other rows that
    changed during the forward (``changed``)."""
    _, _, build = shard_setup(sharder_type, world, optimizer)
    sharded = build(make(1))
    mcc, seen = sharded._managed_collision_collection, []
    original = mcc.evict

    def spy() -> dict[str, torch.Tensor | None]:
        evictions = original()
        seen.append({t: r.clone() for t, r in evictions.items() if r is not None})
        return evictions

    mcc.evict = spy
    result = {"reset": 0, "bad_reset": 0, "changed": 0, "state_names": set()}
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(4):
        before = _snapshot(sharded)
        seen.clear()
        embeddings, _ = sharded(_slice(*_batch(step, world), lo, hi))
        looked_up = outputs(embeddings)  # waited: the remap and the reset have run
        after = _snapshot(sharded)
        evicted = {t: r for evictions in seen for t, r in evictions.items()}
        for table, tensors in after.items():
            rows = evicted.get(table, torch.empty(0, dtype=torch.int64))
            kept = torch.ones(tensors["weight"].shape[0], dtype=torch.bool)
            kept[rows] = False
            result["reset"] += rows.numel()
            for name, tensor in tensors.items():
                result["state_names"].add(name)
                result["changed"] += int(not torch.equal(tensor[kept], before[table][name][kept]))
                fresh = reset_init(tensor[rows].clone()) if name == "weight" else torch.zeros_like(tensor[rows])
                result["bad_reset"] += int(not torch.equal(tensor[rows], fresh))
        sum(t.sum() for t in looked_up).backward()
    result["state_names"] = sorted(result["state_names"])
    return result


def run_reset_suite(rank: int, world: int) -> dict[str, Any]:
    """The case for the MC-EBC and the MC-EC under fused rowwise Adagrad and Adam."""
    from tests.sharding.mc_cases import _pooled
    from tests.sharding.mc_ec_cases import _per_feature, make_ec_module
    from tritonrec.dist.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from tritonrec.dist.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    kinds = {
        "ebc": (make_module, ManagedCollisionEmbeddingBagCollectionSharder, _pooled),
        "ec": (make_ec_module, ManagedCollisionEmbeddingCollectionSharder, _per_feature),
    }
    return {
        f"{kind}_{optimizer}": reset_case(rank, world, optimizer, *args)
        for kind, args in kinds.items()
        for optimizer in ("EXACT_ROWWISE_ADAGRAD", "ADAM")
    }
