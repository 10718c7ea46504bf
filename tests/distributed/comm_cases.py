"""Comm-op cases shared by the exactness tests (test_comm_ops.py) and the codec tests (test_comm_codecs.py).

A case knows, for a world size ``W``: each rank's inputs (seeded by case name and rank, so every rank can rebuild
every rank's inputs), how a rank calls the op, and a single-process reference that computes every rank's outputs from
all ranks' inputs with plain torch slicing, concatenation and addition, so autograd gives the reference gradients.

:func:`run_case` runs one case on a rank (inside ``run_ranks``) and returns plain numbers, not tensors, so nothing
depends on shared memory outliving the rank processes.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    alltoallv,
    get_gradient_division,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    set_gradient_division,
    variable_batch_alltoall_pooled,
)


def _seed(parts: Sequence[Any]) -> int:
    return zlib.crc32(repr(tuple(parts)).encode())


def seeded(parts: Sequence[Any], shape: Sequence[int], kind: str) -> torch.Tensor:
    """Deterministic fp32 data. ``"ints"``: integers in [-1000, 1000], so sums of a few are exact in fp32 and every
    comparison can be ``torch.equal``. ``"unit"``: magnitudes in [1, 2] with random signs, so every quantization row
    has its max in [1, 2] and one absolute error bound per codec holds for every element."""
    generator = torch.Generator().manual_seed(_seed(parts))
    if kind == "ints":
        return torch.randint(-1000, 1001, tuple(shape), generator=generator).float()
    magnitude = 1 + torch.rand(tuple(shape), generator=generator)
    return magnitude * (torch.randint(0, 2, tuple(shape), generator=generator) * 2 - 1)


def seeded_rng(parts: Sequence[Any]) -> random.Random:
    """A ``random.Random`` seeded by ``parts`` the same way in every process (``hash()`` of str is not)."""
    return random.Random(_seed(parts))


def small_ints(parts: Sequence[Any], count: int, high: int = 3) -> list[int]:
    """``count`` seeded ints in [0, high] (batch sizes: zeros included on purpose)."""
    rng = seeded_rng(parts)
    return [rng.randint(0, high) for _ in range(count)]


def cumsum(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


def _cat(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like.new_empty(0)


def _sum_in_rank_order(pieces: list[torch.Tensor]) -> torch.Tensor:
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece
    return total


@dataclass
class OpCase:
    name: str
    make_inputs: Callable[[int, str], list[torch.Tensor]]  # (rank, kind) -> this rank's inputs
    call: Callable[[list[torch.Tensor], dist.ProcessGroup, Any], Any]  # (inputs, group, codecs) -> awaitable
    reference: Callable[[list[list[torch.Tensor]]], list[Any]]  # all ranks' inputs -> each rank's output(s)
    gradient_division: bool = True
    forward_sums: int = 1  # decoded pieces summed into one output element (codec error bounds add up)
    backward_sums: int = 1  # same for one gradient element


def _pooled_case(name: str, world: int, batch: list[int], dims: list[int], division: bool = True) -> OpCase:
    offsets = cumsum(batch)

    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        rows = [[all_inputs[s][0][offsets[r] : offsets[r + 1]] for s in range(world)] for r in range(world)]
        return [torch.cat(rows[r], dim=1) for r in range(world)]

    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank), (sum(batch), dims[rank]), kind)],
        lambda xs, pg, codecs: alltoall_pooled(xs[0], batch, dims, group=pg, codecs=codecs),
        reference,
        gradient_division=division,
    )


def _variable_batch_case(name: str, world: int, dims_per_rank: list[list[int]]) -> OpCase:
    owners = [owner for owner, dims in enumerate(dims_per_rank) for _ in dims]
    dims = [d for rank_dims in dims_per_rank for d in rank_dims]
    local = [[f for f, owner in enumerate(owners) if owner == rank] for rank in range(world)]
    batch = [small_ints((name, "batch", r), len(dims)) for r in range(world)]  # batch[r][f]: rank r's batch of f
    sizes = [[[batch[r][f] * dims[f] for f in local[s]] for r in range(world)] for s in range(world)]

    def make_inputs(rank: int, kind: str) -> list[torch.Tensor]:
        return [seeded((name, rank), (sum(map(sum, sizes[rank])),), kind)]

    def call(xs: list[torch.Tensor], pg: dist.ProcessGroup, codecs: Any) -> Any:
        me = pg.rank()
        per_rank_per_feature = [[batch[r][f] for f in local[me]] for r in range(world)]
        return variable_batch_alltoall_pooled(xs[0], per_rank_per_feature, batch[me], dims_per_rank, pg, codecs)

    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        pieces = [
            list(all_inputs[s][0].split([n for r in range(world) for n in sizes[s][r]])) for s in range(world)
        ]  # pieces[s]: (destination, feature) runs of rank s's input, destination-major
        outputs = []
        for r in range(world):
            mine = [pieces[s][r * len(local[s]) + i] for s in range(world) for i in range(len(local[s]))]
            outputs.append(_cat(mine, all_inputs[0][0]))
        return outputs

    return OpCase(name, make_inputs, call, reference)


def _even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def _alltoallv_case(name: str, world: int, local_dims: list[list[int]], batch: int, by_lengths: bool) -> OpCase:
    offsets = cumsum(_even_split(batch, world))

    def call(xs: list[torch.Tensor], pg: dist.ProcessGroup, codecs: Any) -> Any:
        if by_lengths:
            return alltoallv(xs, per_rank_split_lengths=[len(d) for d in local_dims], group=pg, codecs=codecs)
        return alltoallv(xs, out_split=[sum(d) for d in local_dims], group=pg, codecs=codecs)

    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        merged = [torch.cat(inputs, dim=1) for inputs in all_inputs]
        return [[merged[s][offsets[r] : offsets[r + 1]] for s in range(world)] for r in range(world)]

    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank, i), (batch, d), kind) for i, d in enumerate(local_dims[rank])],
        call,
        reference,
    )


def _reduce_rows_case(name: str, world: int, row_shape: tuple[int, ...], splits: list[int], op: str) -> OpCase:
    """reduce_scatter_base_pooled / reduce_scatter_v_pooled over ``[sum(splits), *row_shape]`` inputs."""
    offsets = cumsum(splits)

    def call(xs: list[torch.Tensor], pg: dist.ProcessGroup, codecs: Any) -> Any:
        if op == "base":
            return reduce_scatter_base_pooled(xs[0], group=pg, codecs=codecs)
        return reduce_scatter_v_pooled(xs[0], splits, group=pg, codecs=codecs)

    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        return [
            _sum_in_rank_order([all_inputs[s][0][offsets[r] : offsets[r + 1]] for s in range(world)])
            for r in range(world)
        ]

    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank), (sum(splits), *row_shape), kind)],
        call,
        reference,
        forward_sums=world,
    )


def _reduce_scatter_list_case(name: str, world: int, rows: list[int]) -> OpCase:
    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        return [_sum_in_rank_order([all_inputs[s][r] for s in range(world)]) for r in range(world)]

    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank, r), (rows[r], 3), kind) for r in range(world)],
        lambda xs, pg, codecs: reduce_scatter_pooled(xs, group=pg, codecs=codecs),
        reference,
        forward_sums=world,
    )


def _reduce_per_feature_case(name: str, world: int, dims: list[int]) -> OpCase:
    batch = [small_ints((name, "batch", r), len(dims)) for r in range(world)]
    splits = [sum(b * d for b, d in zip(row, dims, strict=True)) for row in batch]
    offsets = cumsum(splits)

    def reference(all_inputs: list[list[torch.Tensor]]) -> list[Any]:
        return [
            _sum_in_rank_order([all_inputs[s][0][offsets[r] : offsets[r + 1]] for s in range(world)])
            for r in range(world)
        ]

    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank), (sum(splits),), kind)],
        lambda xs, pg, codecs: reduce_scatter_v_per_feature_pooled(xs[0], batch, dims, group=pg, codecs=codecs),
        reference,
        forward_sums=world,
    )


def _all_gather_case(name: str, world: int, shape: tuple[int, ...]) -> OpCase:
    return OpCase(
        name,
        lambda rank, kind: [seeded((name, rank), shape, kind)],
        lambda xs, pg, codecs: all_gather_base_pooled(xs[0], group=pg, codecs=codecs),
        lambda all_inputs: [torch.cat([inputs[0] for inputs in all_inputs]) for _ in range(world)],
        backward_sums=world,
    )


# Per world size: uneven sizes with a zero on purpose (a rank with no batch, no columns, no rows).
_UNEVEN_BATCH = {2: [4, 0], 3: [2, 0, 3], 4: [1, 0, 3, 2]}
_UNEVEN_DIMS = {2: [5, 0], 3: [3, 0, 5], 4: [2, 0, 5, 1]}
_FEATURE_DIMS = {2: [[3], [2, 4]], 3: [[3], [], [2, 4]], 4: [[2], [], [3, 1], [4]]}
_ALLTOALLV_DIMS = {2: [[2, 1], [3]], 3: [[2, 1], [0], [3]], 4: [[1], [2, 2], [0], [3]]}
_ALLTOALLV_WIDTHS = {2: [[2], [2, 2]], 3: [[2], [2, 2], [2, 2, 2]], 4: [[2], [2, 2], [2], [2, 2, 2]]}
_ROW_SPLITS = {2: [3, 0], 3: [3, 0, 2], 4: [2, 0, 1, 3]}


def build_op_cases(world: int) -> list[OpCase]:
    """Every comm op (sequence all-to-all is covered through its module in test_dist_data.py)."""
    return [
        _pooled_case("alltoall_pooled/even_batch", world, [3] * world, [3, 1, 4, 2][:world]),
        _pooled_case("alltoall_pooled/uneven_batch_zero_dims", world, _UNEVEN_BATCH[world], _UNEVEN_DIMS[world]),
        _pooled_case("alltoall_pooled/empty_batch", world, [0] * world, [2] * world),
        _pooled_case("alltoall_pooled/no_gradient_division", world, [2] * world, [1, 3, 2, 2][:world], False),
        _variable_batch_case("variable_batch_alltoall_pooled", world, _FEATURE_DIMS[world]),
        _alltoallv_case("alltoallv/out_split", world, _ALLTOALLV_DIMS[world], 2 * world + 1, by_lengths=False),
        _alltoallv_case("alltoallv/per_rank_split_lengths", world, _ALLTOALLV_WIDTHS[world], 3, by_lengths=True),
        _reduce_scatter_list_case("reduce_scatter_pooled", world, _ROW_SPLITS[world]),
        _reduce_rows_case("reduce_scatter_base_pooled/2d", world, (3,), [2] * world, "base"),
        _reduce_rows_case("reduce_scatter_base_pooled/1d", world, (), [5] * world, "base"),
        _reduce_rows_case("reduce_scatter_v_pooled/uneven", world, (4,), _ROW_SPLITS[world], "v"),
        _reduce_rows_case("reduce_scatter_v_pooled/equal", world, (4,), [2] * world, "v"),
        _reduce_per_feature_case("reduce_scatter_v_per_feature_pooled", world, [2, 3, 1]),
        _all_gather_case("all_gather_base_pooled/2d", world, (3, 2)),
        _all_gather_case("all_gather_base_pooled/zero_rows", world, (0, 2)),
        _all_gather_case("all_gather_base_pooled/1d", world, (4,)),
    ]


def _as_list(output: Any) -> list[torch.Tensor]:
    return list(output) if isinstance(output, (list, tuple)) else [output]


def _compare(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, Any]:
    shapes_match = len(actual) == len(expected) and all(
        a.shape == e.shape for a, e in zip(actual, expected, strict=True)
    )
    if not shapes_match:
        return {
            "exact": False,
            "max_err": float("inf"),
            "detail": f"{[a.shape for a in actual]} vs {[e.shape for e in expected]}",
        }
    errors = [float((a - e).abs().max()) if a.numel() else 0.0 for a, e in zip(actual, expected, strict=True)]
    return {
        "exact": all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True)),
        "max_err": max(errors, default=0.0),
        "detail": f"max abs error {max(errors, default=0.0)}",
    }


def run_case(case: OpCase, rank: int, world: int, pg: dist.ProcessGroup, kind: str, codecs: Any) -> dict[str, Any]:
    """Run ``case`` on this rank and on the reference; return how they compare (plain Python values)."""
    previous = get_gradient_division()
    set_gradient_division(case.gradient_division)
    try:
        inputs = [t.requires_grad_() for t in case.make_inputs(rank, kind)]
        request = case.call(inputs, pg, codecs)
    finally:
        set_gradient_division(previous)  # the op captured the setting at call time
    launched_before_wait = request.forward_traffic is not None
    outputs = _as_list(request.wait())
    upstream = [seeded((case.name, "upstream", rank, k), o.shape, kind) for k, o in enumerate(outputs)]
    torch.autograd.backward(outputs, upstream)
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]

    all_inputs = [[t.requires_grad_() for t in case.make_inputs(r, kind)] for r in range(world)]
    reference = [_as_list(out) for out in case.reference(all_inputs)]
    loss = sum(
        (out * seeded((case.name, "upstream", r, k), out.shape, kind)).sum()
        for r in range(world)
        for k, out in enumerate(reference[r])
    )
    leaves = [t for inputs_of_rank in all_inputs for t in inputs_of_rank]
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        reference_grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    else:
        reference_grads = (None,) * len(leaves)
    start = sum(len(all_inputs[r]) for r in range(rank))
    mine = [
        g if g is not None else torch.zeros_like(x)
        for g, x in zip(reference_grads[start:], all_inputs[rank], strict=False)
    ]
    if case.gradient_division:
        mine = [g / world for g in mine]
    traffic = [
        None
        if t is None
        else {"dtype": str(t.dtype), "send": t.send_splits, "recv": t.recv_splits, "bytes": t.send_bytes}
        for t in (request.forward_traffic, request.backward_traffic)
    ]
    return {
        "forward": _compare([o.detach() for o in outputs], [o.detach() for o in reference[rank]]),
        "grad": _compare(grads, mine),
        "launched_before_wait": launched_before_wait,
        "input_shapes": [tuple(x.shape) for x in inputs],
        "traffic": traffic,
    }


def request_semantics(rank: int, world: int) -> dict[str, Any]:
    """Awaitable behaviour of a comm op's result: launched before wait, callbacks, repeated wait, no-grad input."""
    x = torch.arange(4.0 * world).view(2 * world, 2) + 100 * rank
    request = alltoall_pooled(x, [2] * world, [2] * world)
    launched = request.forward_traffic is not None
    request.callbacks.append(lambda out: out * 2)
    first = request.wait()
    second = request.wait()  # the collective ran once: the same output, through the callbacks again
    expected = torch.cat([torch.arange(4.0 * world).view(2 * world, 2)[2 * rank : 2 * rank + 2] + 100 * s
                          for s in range(world)], dim=1)  # fmt: skip
    return {
        "is_awaitable": isinstance(request, Awaitable),
        "launched_before_wait": launched,
        "callback_applied": torch.equal(first, expected * 2),
        "second_wait_same_result": torch.equal(second, expected * 2),
        "no_grad_output": not first.requires_grad,
    }
