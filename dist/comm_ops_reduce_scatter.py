"""The reduce-scatter comm ops (torchrec's ``reduce_scatter_pooled``, ``reduce_scatter_base_pooled``,
``reduce_scatter_v_pooled``, ``reduce_scatter_v_per_feature_pooled``): every rank's contribution for rank ``r`` is
summed into rank ``r``'s output; the backward all-gathers the gradient. Conventions (checks, codecs, metadata
agreement, gradient division, awaitables) are those of :mod:`tritonrec.dist.comm_ops`, which re-exports these ops;
they live apart so that module holds the all-to-all and all-gather ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tritonrec.dist import comm_checks as checks
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_consistency import MetadataCheck, checked_call, describe_codecs
from tritonrec.dist.comm_gradient_division import get_gradient_division
from tritonrec.dist.comm_plans import ReduceScatterPlan
from tritonrec.dist.comm_request import Request

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs


def reduce_scatter_pooled(
    inputs: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """``inputs[r]`` of every rank is summed into rank ``r``'s output (``inputs`` has one tensor per rank; shapes
    may differ between entries but must be the same list on every rank)."""
    pg = checks.resolve_group(group)
    with checked_call("reduce_scatter_pooled", pg, metadata_check) as meta:
        if not isinstance(inputs, (list, tuple)):
            raise TypeError(f"inputs must be a list of tensors (one per rank), got {type(inputs).__name__}")
        if len(inputs) != pg.size():
            raise ValueError(f"inputs must hold one tensor per rank ({pg.size()}), got {len(inputs)}")
        for i, t in enumerate(inputs):
            checks.check_float_tensor(t, f"inputs[{i}]", min_ndim=1)
            if t.dtype != inputs[0].dtype or t.device != inputs[0].device:
                raise ValueError(
                    f"inputs[{i}] is {t.dtype} on {t.device}, inputs[0] is {inputs[0].dtype} on {inputs[0].device}"
                )
        codecs = checks.check_codecs(codecs)
        meta.same(shapes=[list(t.shape) for t in inputs], dtype=str(inputs[0].dtype), codecs=describe_codecs(codecs))
    shapes = [tuple(t.shape) for t in inputs]
    plan = ReduceScatterPlan("reduce_scatter_pooled", pg, codecs, get_gradient_division(), shapes, None)
    return Request(plan, tuple(inputs))


def _reduce_scatter_rows(
    name: str, input: torch.Tensor, splits: list[int], pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None
) -> Awaitable[torch.Tensor]:
    rest = tuple(input.shape[1:])
    shapes = [(n, *rest) for n in splits]
    plan = ReduceScatterPlan(name, pg, codecs, get_gradient_division(), shapes, splits)
    return Request(plan, (input,))


def reduce_scatter_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """``input [W * n, *rest]``: rank ``r`` gets the sum over ranks of rows ``[r * n, (r + 1) * n)``."""
    pg = checks.resolve_group(group)
    with checked_call("reduce_scatter_base_pooled", pg, metadata_check) as meta:
        checks.check_float_tensor(input, "input", min_ndim=1)
        if input.shape[0] % pg.size():
            raise ValueError(f"input has {input.shape[0]} rows, not divisible by the world size {pg.size()}")
        splits = [input.shape[0] // pg.size()] * pg.size()
        codecs = checks.check_codecs(codecs)
        meta.same(input_shape=list(input.shape), dtype=str(input.dtype), codecs=describe_codecs(codecs))
    return _reduce_scatter_rows("reduce_scatter_base_pooled", input, splits, pg, codecs)


def reduce_scatter_v_pooled(
    input: torch.Tensor,
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """``input [sum(input_splits), *rest]``: rank ``r`` gets the sum over ranks of its ``input_splits[r]`` rows."""
    pg = checks.resolve_group(group)
    with checked_call("reduce_scatter_v_pooled", pg, metadata_check) as meta:
        checks.check_float_tensor(input, "input", min_ndim=1)
        input_splits = checks.check_sizes(input_splits, "input_splits", pg.size())
        if sum(input_splits) != input.shape[0]:
            raise ValueError(
                f"input has {input.shape[0]} rows but sum(input_splits) = {sum(input_splits)} "
                f"(input_splits={input_splits})"
            )
        codecs = checks.check_codecs(codecs)
        meta.same(input_splits=input_splits, row_shape=list(input.shape[1:]), dtype=str(input.dtype),
                  codecs=describe_codecs(codecs))  # fmt: skip
    return _reduce_scatter_rows("reduce_scatter_v_pooled", input, input_splits, pg, codecs)


def reduce_scatter_v_per_feature_pooled(
    input: torch.Tensor,
    batch_size_per_rank_per_feature: list[list[int]],
    embedding_dims: list[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """Flat ``input``: for each rank ``r``, for each feature ``f``, ``batch_size_per_rank_per_feature[r][f] x
    embedding_dims[f]`` values; rank ``r`` gets the sum over ranks of its part (flat)."""
    pg = checks.resolve_group(group)
    with checked_call("reduce_scatter_v_per_feature_pooled", pg, metadata_check) as meta:
        checks.check_float_tensor(input, "input", ndim=1)
        embedding_dims = checks.check_sizes(embedding_dims, "embedding_dims", what="feature")
        batch_sizes = checks.check_size_table(
            batch_size_per_rank_per_feature,
            "batch_size_per_rank_per_feature",
            pg.size(),
            [len(embedding_dims)] * pg.size(),
        )
        splits = [sum(b * d for b, d in zip(row, embedding_dims, strict=True)) for row in batch_sizes]
        if sum(splits) != input.numel():
            raise ValueError(
                f"input has {input.numel()} values but batch_size_per_rank_per_feature x embedding_dims needs "
                f"{sum(splits)} (per rank {splits})"
            )
        codecs = checks.check_codecs(codecs)
        meta.same(batch_size_per_rank_per_feature=batch_sizes, embedding_dims=embedding_dims, dtype=str(input.dtype),
                  codecs=describe_codecs(codecs))  # fmt: skip
    return _reduce_scatter_rows("reduce_scatter_v_per_feature_pooled", input, splits, pg, codecs)
