"""Gradient synchronisation that a shard's own backward cannot do alone, done inside the backward.

Two cases need a collective between the local lookup's backward and the weight update:

* **Data parallel.** Every rank holds the whole table and sees only its own samples, so the gradient is all-reduced
  before it is used (averaged over ranks when :func:`~tritonrec.dist.comm_ops.get_gradient_division` is on, as the
  model-parallel outputs' gradients are). Dense kernel: the reduced gradient lands in the parameters' ``.grad``.
  Fused kernel: the reduced gradient of every row touched on any rank is applied by the fused rule, so all replicas
  take the same update (and equal the unsharded module's on the global batch): :mod:`~tritonrec.dist.dp_fused_update`.
* **Rowwise Adagrad on column shards.** The rule's per-row state grows by the mean of the row's squared gradient over
  the WHOLE row, which spans every column block of the table. Each block's holder computes its partial sum of squares
  for the rows it touched; holders of the same rows exchange those (small, ``[rows touched]`` fp32) partial sums
  point to point, and all apply the same total. (torchrec uses the per-block mean and so trains differently from the
  unsharded table; we do not): :mod:`~tritonrec.dist.column_adagrad`.

Both hook in the same way: the lookup's per-table weights are the outputs of :class:`_TableGradSink`, whose backward
receives every table's gradient of the lookup at once (one collective per lookup, not per table) and applies it.
The rules are the fused kernels' rules, written on (rows, summed gradient) pairs and applied to all tables of one
width at once (:mod:`~tritonrec.dist.fused_spans`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.comm_ops import get_gradient_division
from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.kernels.embedding import TableBatchedLayout

GradHandler = Callable[[Sequence[torch.Tensor | None]], None]


class _TableGradSink(torch.autograd.Function):
    """Per-table views of flat weight buffers whose backward hands all tables' gradients to ``handler``.

    ``trigger`` is an empty leaf that requires grad, so the views (and the lookup's output) require grad and the
    backward runs even though the buffers themselves never do. A table no lookup read gets ``None``, not zeros: the
    handlers take the touched rows from the lookup's sparse gradients (its ids), never from nonzero values."""

    @staticmethod
    def forward(ctx: Any, handler: GradHandler, trigger: torch.Tensor, layouts: Any, *flats: torch.Tensor) -> Any:
        ctx.handler = handler
        ctx.set_materialize_grads(False)
        return tuple(layout.table_view(flat, t) for layout, flat in zip(layouts, flats, strict=True)
                     for t in range(layout.num_tables))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        ctx.handler(grads)
        return (None,) * (3 + len(grads))


def sink_views(
    handler: GradHandler, layouts: Sequence[TableBatchedLayout], flats: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per group, its tables' views (to pass as ``table_weights`` with ``sparse_grad=True``); their gradients go to
    ``handler`` once per backward, all groups together, in group-then-table order."""
    if not torch.is_grad_enabled():
        return [
            [layout.table_view(flat, t) for t in range(layout.num_tables)]
            for layout, flat in zip(layouts, flats, strict=True)
        ]
    trigger = torch.empty(0, requires_grad=True, device=flats[0].device)
    views = _TableGradSink.apply(handler, trigger, tuple(layouts), *flats)
    out, k = [], 0
    for layout in layouts:
        out.append(list(views[k : k + layout.num_tables]))
        k += layout.num_tables
    return out


class _AllReduceGrads(torch.autograd.Function):
    """Identity on parameters whose backward all-reduces their (dense) gradients in one flat buffer."""

    @staticmethod
    def forward(ctx: Any, pg: dist.ProcessGroup, divide: bool, *params: torch.Tensor) -> Any:
        ctx.pg, ctx.divide = pg, divide
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device = next((g.device for g in grads if g is not None), None)
        dense = [torch.zeros(0, device=device) if g is None else (g.to_dense() if g.is_sparse else g) for g in grads]
        flat = torch.cat([g.reshape(-1).float() for g in dense]) if dense else torch.zeros(0)
        all_reduce_(flat, ctx.pg, ctx.divide, "data-parallel gradient all-reduce")
        out, start = [], 0
        for g, d in zip(grads, dense, strict=True):
            n = d.numel()
            out.append(None if g is None else flat[start : start + n].view_as(d).to(d.dtype))
            start += n
        return (None, None, *out)


def all_reduced_params(
    params: Sequence[torch.Tensor], pg: dist.ProcessGroup, average: bool | None = None
) -> list[torch.Tensor]:
    """Views of ``params`` whose gradients are all-reduced over ``pg``: averaged when ``average`` (default: when
    gradient division is on, as for replicated tables), else summed (parameters whose per-rank gradients are parts
    of one gradient, e.g. position weights used by several ranks' shards)."""
    if not torch.is_grad_enabled() or not params:
        return list(params)
    return list(_AllReduceGrads.apply(pg, get_gradient_division() if average is None else average, *params))


def all_reduce_(flat: torch.Tensor, pg: dist.ProcessGroup, divide: bool, what: str) -> None:
    work = dist.all_reduce(flat, group=pg, async_op=True)
    wait_for_work(work, what, pg)
    if divide and pg.size() > 1:
        flat.div_(pg.size())


__all__ = ["GradHandler", "all_reduce_", "all_reduced_params", "sink_views"]
