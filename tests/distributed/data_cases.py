"""Rank-side cases of the dist_data tests: the sparse all-to-all against a single-process reference, sequence
embeddings through the whole sparse-then-embedding round trip, and torchrec's documented examples.

Every KJT value is a *tag* ``rank * 100_000 + position`` (unique across ranks), so a reference can tell where each id
came from, and the "embedding lookup" is a fixed function of the tag (:func:`table`), so any rank can compute any
row. All comparisons are exact; functions return plain Python values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.comm_cases import cumsum, seeded, seeded_rng, small_ints
from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.dist_data import (
    KJTAllToAll,
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
    get_recat,
)
from tritonrec.dist.kjt_dist import _rank_order

TAG_STRIDE = 100_000


@dataclass(frozen=True)
class KJTCase:
    name: str
    num_keys: int
    splits: tuple[int, ...]
    batch: str = "fixed"  # "fixed" | "per_rank" (a stride per rank) | "vbe" (a stride per rank and key)
    weighted: bool = False
    stagger: int = 1
    empty_bags: bool = False


def kjt_cases(world: int) -> list[KJTCase]:
    if world == 2:
        return [
            KJTCase("kjt/fixed", 3, (2, 1)),
            KJTCase("kjt/weighted_zero_split", 3, (3, 0), weighted=True),
            KJTCase("kjt/batch_per_rank", 3, (1, 2), batch="per_rank", weighted=True),
            KJTCase("kjt/vbe", 4, (2, 2), batch="vbe", weighted=True),
            KJTCase("kjt/empty_bags", 2, (1, 1), empty_bags=True),
        ]
    return [
        KJTCase("kjt/fixed", 5, (2, 1, 0, 2)),
        KJTCase("kjt/batch_per_rank", 4, (1, 1, 1, 1), batch="per_rank", weighted=True),
        KJTCase("kjt/vbe", 5, (1, 2, 0, 2), batch="vbe", weighted=True),
        KJTCase("kjt/stagger2", 4, (1, 1, 1, 1), stagger=2, weighted=True),
        KJTCase("kjt/vbe_stagger2", 4, (1, 0, 2, 1), batch="vbe", stagger=2),
    ]


def _strides(case: KJTCase, world: int) -> list[list[int]]:
    """``strides[r][t]``: batch size of key ``t`` on rank ``r``."""
    if case.batch == "fixed":
        return [[3] * case.num_keys for _ in range(world)]
    if case.batch == "per_rank":
        return [[1 + r] * case.num_keys for r in range(world)]
    return [small_ints((case.name, "strides", r), case.num_keys) for r in range(world)]


@functools.cache  # references rebuild every rank's input many times; KJTs are never modified in place
def make_kjt(case: KJTCase, rank: int, world: int) -> KeyedJaggedTensor:
    strides = _strides(case, world)[rank]
    rng = seeded_rng((case.name, "lengths", rank))
    lengths = [0 if case.empty_bags else rng.randint(0, 3) for t in range(case.num_keys) for _ in range(strides[t])]
    values = torch.arange(sum(lengths), dtype=torch.int64) + rank * TAG_STRIDE
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(case.num_keys)],
        values=values,
        weights=values.double().float() * 0.5 if case.weighted else None,
        lengths=torch.tensor(lengths, dtype=torch.int32),
        stride=strides[0] if case.batch != "vbe" else None,
        stride_per_key_per_rank=[[s] for s in strides] if case.batch == "vbe" else None,
    )


@functools.cache
def reference_all_to_all(case: KJTCase, world: int, owner: int) -> dict[str, Any]:
    """Rank ``owner``'s output keys, lengths, values, weights and strides, from every rank's input KJT."""
    inputs = [make_kjt(case, r, world) for r in range(world)]
    bounds = cumsum(case.splits)
    keys = inputs[0].keys()[bounds[owner] : bounds[owner + 1]]
    order = _rank_order(world, case.stagger)
    lengths, values, weights, strides = [], [], [], []
    for key in keys:
        for source in order:
            jt = inputs[source][key]
            lengths.append(jt.lengths().long())
            values.append(jt.values())
            if case.weighted:
                weights.append(jt.weights())
        strides.append([inputs[source].stride_per_key()[inputs[source].keys().index(key)] for source in order])
    empty = torch.empty(0)
    return {
        "keys": keys,
        "lengths": torch.cat(lengths) if lengths else empty.long(),
        "values": torch.cat(values) if values else empty.long(),
        "weights": (torch.cat(weights) if weights else empty) if case.weighted else None,
        "stride_per_key_per_rank": strides if case.batch == "vbe" else None,
        "stride": sum(_strides(case, world)[r][0] for r in range(world)) if case.batch != "vbe" else None,
    }


def run_kjt_case(case: KJTCase, rank: int, world: int) -> dict[str, bool]:
    awaitable = KJTAllToAll(dist.group.WORLD, list(case.splits), stagger=case.stagger)(make_kjt(case, rank, world))
    tensors = awaitable.wait()
    out = tensors.wait()
    expected = reference_all_to_all(case, world, rank)
    weights = out.weights_or_none()
    checks = {
        "keys": out.keys() == expected["keys"],
        "lengths": torch.equal(out.lengths().long(), expected["lengths"]),
        "values": torch.equal(out.values(), expected["values"]),
        "weights": (weights is None) == (expected["weights"] is None)
        and (weights is None or torch.equal(weights, expected["weights"])),
        "values_splits_received": tensors.output_splits["values"]
        == [sum(len(make_kjt(case, s, world)[k].values()) for k in expected["keys"]) for s in range(world)],
    }
    if case.batch == "vbe":
        checks["stride_per_key_per_rank"] = out.stride_per_key_per_rank() == expected["stride_per_key_per_rank"]
    else:
        checks["stride"] = out.stride() == expected["stride"] and not out.variable_stride_per_key()
    return checks


def table(tags: torch.Tensor, dim: int) -> torch.Tensor:
    """The embedding of each tag: integer-valued fp32 rows, a fixed function of the tag."""
    return ((tags.view(-1, 1) * 31 + torch.arange(dim) * 7) % 2001 - 1000).float()


def run_sequence_case(case: KJTCase, rank: int, world: int, dim: int = 3) -> dict[str, bool]:
    """Sparse all-to-all, lookup, SequenceEmbeddingsAllToAll back; forward and gradients against a reference."""
    pg = dist.group.WORLD
    kjt = make_kjt(case, rank, world)
    tensors = KJTAllToAll(pg, list(case.splits))(kjt).wait()
    local = tensors.wait()
    local_embs = table(local.values(), dim).requires_grad_()
    kwargs: dict[str, Any] = {}
    batch_size_per_rank = [_strides(case, world)[r][0] for r in range(world)]
    if case.batch == "per_rank":
        kwargs["batch_size_per_rank"] = batch_size_per_rank
        kwargs["sparse_features_recat"] = get_recat(case.splits[rank], world, batch_size_per_rank=batch_size_per_rank)
    unbucketize = torch.randperm(kjt.values().numel(), generator=torch.Generator().manual_seed(rank))
    module = SequenceEmbeddingsAllToAll(pg, list(case.splits))
    out = module(
        local_embs, local.lengths(), tensors.input_splits["values"], tensors.output_splits["values"],
        unbucketize_permute_tensor=unbucketize, **kwargs,
    ).wait()  # fmt: skip
    upstream = seeded((case.name, "seq", rank), out.shape, "ints")
    out.backward(upstream)

    # Reference: every rank's looked-up rows as leaves; each rank's output gathers its own tags' rows from them.
    leaves = [table(reference_all_to_all(case, world, s)["values"], dim).requires_grad_() for s in range(world)]
    received = torch.cat([reference_all_to_all(case, world, s)["values"] for s in range(world)])
    where = {int(tag): i for i, tag in enumerate(received)}
    everything = torch.cat(leaves)
    loss = 0
    for r in range(world):
        tags = make_kjt(case, r, world).values()
        perm = torch.randperm(tags.numel(), generator=torch.Generator().manual_seed(r))
        rows = everything.index_select(0, torch.tensor([where[int(t)] for t in tags], dtype=torch.long))
        ref_out = rows.index_select(0, perm)
        if r == rank:
            expected = ref_out.detach()
        loss = loss + (ref_out * seeded((case.name, "seq", r), ref_out.shape, "ints")).sum()
    expected_grad = torch.autograd.grad(loss, leaves[rank])[0] / world
    return {
        "forward": torch.equal(out.detach(), expected),
        "grad": torch.equal(local_embs.grad, expected_grad),
    }


def run_documented_examples(rank: int, world: int) -> dict[str, Any]:
    """torchrec's docstring examples (2 ranks), reproduced exactly."""
    pg = dist.group.WORLD
    # KJTAllToAll: keys A, B, C, splits [2, 1]; value V of key K on rank r is tagged 100 * key + 10 * rank + index.
    lengths = {0: [1, 0, 2, 0, 1, 1, 1, 1, 0], 1: [1, 1, 0, 0, 1, 2, 1, 1, 0]}[rank]
    values = {0: [0, 1, 2, 100, 101, 200, 201], 1: [10, 11, 110, 111, 112, 210, 211]}[rank]
    kjt = KeyedJaggedTensor(["A", "B", "C"], torch.tensor(values), lengths=torch.tensor(lengths))
    out = KJTAllToAll(pg, [2, 1])(kjt).wait().wait()
    expected_bags = {
        0: {"A": [[0], [], [1, 2], [10], [11], []], "B": [[], [100], [101], [], [110], [111, 112]]},
        1: {"C": [[200], [201], [], [210], [211], []]},
    }[rank]
    bags = {key: [b.tolist() for b in jt.to_dense()] for key, jt in out.to_dict().items()}
    # the same KJT over strided views (every other entry, as a [F, 1] column slice of lengths gives): the
    # all-to-all needs contiguous tensors
    strided = KeyedJaggedTensor(
        ["A", "B", "C"],
        torch.tensor(values).repeat_interleave(2)[::2],
        lengths=torch.tensor(lengths).repeat_interleave(2)[::2],
    )
    try:
        strided_out = KJTAllToAll(pg, [2, 1])(strided).wait().wait()
        strided_bags = {key: [b.tolist() for b in jt.to_dense()] for key, jt in strided_out.to_dict().items()}
    except ValueError as error:  # both ranks raise before sending: no hang
        strided_bags = {"error": str(error)}
    # PooledEmbeddingsAllToAll with dim_sum_per_rank [2, 1]: [6, 2] and [6, 1] in, [3, 3] out on both ranks.
    inputs = [seeded(("pooled_example", r), (6, [2, 1][r]), "ints") for r in range(2)]
    pooled = PooledEmbeddingsAllToAll(pg, [2, 1])(inputs[rank]).wait()
    pooled_expected = torch.cat([inputs[0][3 * rank : 3 * rank + 3], inputs[1][3 * rank : 3 * rank + 3]], dim=1)
    # VariableBatchPooledEmbeddingsAllToAll: rank 0 owns f0 (dim 2), rank 1 owns f1 and f2 (dim 3).
    t = [seeded(("vb_example", r), ([6, 24][r],), "ints") for r in range(2)]
    vb = VariableBatchPooledEmbeddingsAllToAll(pg, [[2], [3, 3]])
    vb_out = vb(t[rank], [[[2], [1]], [[1, 3], [2, 2]]][rank], [[2, 1, 3], [1, 2, 2]][rank]).wait()
    vb_expected = [torch.cat([t[0][0:4], t[1][0:3], t[1][3:12]]), torch.cat([t[0][4:6], t[1][12:18], t[1][18:24]])]
    return {
        "kjt_keys": out.keys() == list(expected_bags),
        "kjt_bags": bags == expected_bags,
        "kjt_stride": out.stride() == 6,
        "kjt_strided_views": strided_bags == expected_bags,
        "pooled_shape": tuple(pooled.shape) == (3, 3),
        "pooled_values": torch.equal(pooled, pooled_expected),
        "vb_numel": vb_out.numel() == [16, 14][rank],
        "vb_values": torch.equal(vb_out, vb_expected[rank]),
    }


def run_module_wrappers(rank: int, world: int) -> dict[str, bool]:
    """The pooled modules route to the right comm op and apply callbacks (ops themselves: test_comm_ops)."""
    pg = dist.group.WORLD
    uneven = [3] + [2] * (world - 1)
    splits = cumsum(uneven)
    x = [seeded(("rs", r), (sum(uneven), 2), "ints") for r in range(world)]
    even = [seeded(("rs_even", r), (2 * world, 2), "ints") for r in range(world)]
    rs_uneven = PooledEmbeddingsReduceScatter(pg)(x[rank], uneven).wait()
    rs_equal = PooledEmbeddingsReduceScatter(pg)(even[rank], [2] * world).wait()
    flat = [seeded(("vbrs", r), (sum(uneven) * 2,), "ints") for r in range(world)]
    vbrs = VariableBatchPooledEmbeddingsReduceScatter(pg)(flat[rank], [[n] for n in uneven], [2]).wait()
    gathered = PooledEmbeddingsAllGather(pg)(even[rank][:2]).wait()
    a2a = PooledEmbeddingsAllToAll(pg, [2] * world, callbacks=[lambda t: t + 1])
    pooled = a2a(even[rank]).wait()

    def total(pieces: list[torch.Tensor]) -> torch.Tensor:
        out = pieces[0]
        for piece in pieces[1:]:
            out = out + piece
        return out

    return {
        "reduce_scatter_v": torch.equal(rs_uneven, total([t[splits[rank] : splits[rank + 1]] for t in x])),
        "reduce_scatter_base": torch.equal(rs_equal, total([t[2 * rank : 2 * rank + 2] for t in even])),
        "variable_batch_reduce_scatter": torch.equal(
            vbrs, total([t[2 * splits[rank] : 2 * splits[rank + 1]] for t in flat])
        ),
        "all_gather": torch.equal(gathered, torch.cat([t[:2] for t in even])),
        "callbacks": torch.equal(pooled, torch.cat([t[2 * rank : 2 * rank + 2] for t in even], dim=1) + 1),
        "callbacks_property": len(a2a.callbacks) == 1,
    }


def sequence_cases(world: int) -> list[KJTCase]:
    if world == 2:
        return [KJTCase("seq/fixed", 3, (2, 1)), KJTCase("seq/batch_per_rank", 3, (1, 2), batch="per_rank")]
    return [KJTCase("seq/fixed", 4, (1, 0, 2, 1)), KJTCase("seq/batch_per_rank", 4, (1, 1, 0, 2), batch="per_rank")]


def run_data_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {case.name: run_kjt_case(case, rank, world) for case in kjt_cases(world)}
    results.update({case.name: run_sequence_case(case, rank, world) for case in sequence_cases(world)})
    results["modules"] = run_module_wrappers(rank, world)
    if world == 2:
        results["documented_examples"] = run_documented_examples(rank, world)
    return results
