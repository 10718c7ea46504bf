"""Comm ops for model parallelism (torchrec's ``comm_ops`` names and semantics), on torch.distributed.

Every op checks its input, launches its collective with ``async_op=True`` and returns an
:class:`~tritonrec.dist.awaitable.Awaitable`; ``wait()`` gives the output, which is differentiable: its backward
is the transposed collective, launched as soon as the output's gradient exists. With ``codecs``, ``codecs.forward``
encodes before and decodes after the forward collective and ``codecs.backward`` does the same for gradients; split
sizes on the wire come from ``calc_quantized_size`` and rows are padded per rank (``padded_size``) so no
quantization row straddles two ranks. Waits honour :func:`~tritonrec.dist.comm_timeout.set_collective_timeout`.

Gradients are divided by the world size when :func:`get_gradient_division` is on (the default, as in torchrec); the
setting in force when an op is called applies to its backward.

Notation: ``W`` world size, ``B_r`` batch size of rank ``r``, ``D_r`` sum of embedding dims of rank ``r``'s tables.
All ranks must call an op with the same metadata (splits, dims); each rank passes its own tensors. Backward is a
collective too: every rank must backpropagate through an op's output (or none may). The first calls of each op (and
of each module instance, which passes its own ``metadata_check``) verify that the ranks agree before any data moves:
see :mod:`tritonrec.dist.comm_consistency`.

The reduce-scatter ops live in :mod:`tritonrec.dist.comm_ops_reduce_scatter` and the gradient-division setting in
:mod:`tritonrec.dist.comm_gradient_division`; both are re-exported here, so torchrec's ``comm_ops`` names all import
from this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tritonrec.dist import comm_checks as checks
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_consistency import MetadataCheck, checked_call, describe_codecs
from tritonrec.dist.comm_gradient_division import get_gradient_division, set_gradient_division
from tritonrec.dist.comm_ops_reduce_scatter import (
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
)
from tritonrec.dist.comm_plans import (
    AllGatherPlan,
    AllToAllVPlan,
    FlatAllToAllPlan,
    PooledAllToAllPlan,
    SequenceAllToAllPlan,
)
from tritonrec.dist.comm_request import Request
from tritonrec.kernels.checks import check_lengths_total, check_tensor

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs


def alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    dim_sum_per_rank_tensor: torch.Tensor | None = None,
    cumsum_dim_sum_per_rank_tensor: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """Pooled embeddings of this rank's tables for the global batch -> every rank's tables for this rank's batch.

    ``a2a_pooled_embs_tensor [sum(batch_size_per_rank), D_me]`` -> ``[B_me, sum(dim_sum_per_rank)]``: rows
    ``B_0 + ... + B_{r-1}`` onwards go to rank ``r``; the output holds rank ``r``'s columns at offset
    ``D_0 + ... + D_{r-1}``. ``dim_sum_per_rank_tensor`` and ``cumsum_dim_sum_per_rank_tensor`` are accepted for
    torchrec compatibility (its fast recat kernel needs them; our layout does not) and are only type-checked.
    """
    pg = checks.resolve_group(group)
    with checked_call("alltoall_pooled", pg, metadata_check) as meta:
        world_size, rank = pg.size(), pg.rank()
        checks.check_float_tensor(a2a_pooled_embs_tensor, "a2a_pooled_embs_tensor", ndim=2)
        batch_size_per_rank = checks.check_sizes(batch_size_per_rank, "batch_size_per_rank", world_size)
        dim_sum_per_rank = checks.check_sizes(dim_sum_per_rank, "dim_sum_per_rank", world_size)
        for name, extra in (("dim_sum_per_rank_tensor", dim_sum_per_rank_tensor),
                            ("cumsum_dim_sum_per_rank_tensor", cumsum_dim_sum_per_rank_tensor)):  # fmt: skip
            if extra is not None:
                check_tensor(extra, name, ndim=1, integer=True)
        rows, cols = a2a_pooled_embs_tensor.shape
        if rows != sum(batch_size_per_rank):
            raise ValueError(
                f"a2a_pooled_embs_tensor has {rows} rows but sum(batch_size_per_rank) = {sum(batch_size_per_rank)} "
                f"(batch_size_per_rank={batch_size_per_rank})"
            )
        if cols != dim_sum_per_rank[rank]:
            raise ValueError(
                f"a2a_pooled_embs_tensor has {cols} columns but dim_sum_per_rank[{rank}] = {dim_sum_per_rank[rank]} "
                f"on rank {rank} (dim_sum_per_rank={dim_sum_per_rank})"
            )
        codecs = checks.check_codecs(codecs)
        meta.same(batch_size_per_rank=batch_size_per_rank, dim_sum_per_rank=dim_sum_per_rank,
                  dtype=str(a2a_pooled_embs_tensor.dtype), codecs=describe_codecs(codecs))  # fmt: skip
    plan = PooledAllToAllPlan(pg, codecs, get_gradient_division(), batch_size_per_rank, dim_sum_per_rank)
    return Request(plan, (a2a_pooled_embs_tensor,))


def variable_batch_alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank_per_feature: list[list[int]],
    batch_size_per_feature_pre_a2a: list[int],
    emb_dim_per_rank_per_feature: list[list[int]],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """Pooled all-to-all with a batch size per (rank, feature): flat in, flat out.

    Input (flattened): for each destination rank ``r``, for each of this rank's features ``f`` (the order of
    ``emb_dim_per_rank_per_feature[me]``), ``batch_size_per_rank_per_feature[r][f] x dim_f`` values. Output: for each
    source rank ``s``, for each of its features ``f``, ``batch_size_per_feature_pre_a2a[i] x dim_f`` values, where
    ``i`` runs over all ranks' features in rank order (``f_0 of rank 0, ..., f_last of rank W-1``).
    """
    pg = checks.resolve_group(group)
    with checked_call("variable_batch_alltoall_pooled", pg, metadata_check) as meta:
        world_size, rank = pg.size(), pg.rank()
        checks.check_float_tensor(a2a_pooled_embs_tensor, "a2a_pooled_embs_tensor")
        dims = checks.check_size_table(emb_dim_per_rank_per_feature, "emb_dim_per_rank_per_feature", world_size)
        if isinstance(batch_size_per_rank_per_feature, list) and not batch_size_per_rank_per_feature and not dims[rank]:
            batch_size_per_rank_per_feature = [[] for _ in range(world_size)]  # torchrec's [] for a featureless rank
        batch_sizes = checks.check_size_table(
            batch_size_per_rank_per_feature,
            "batch_size_per_rank_per_feature",
            world_size,
            [len(dims[rank])] * world_size,
        )
        pre_a2a = checks.check_sizes(
            batch_size_per_feature_pre_a2a, "batch_size_per_feature_pre_a2a", sum(len(d) for d in dims), "feature"
        )
        send_splits = [sum(b * d for b, d in zip(row, dims[rank], strict=True)) for row in batch_sizes]
        recv_splits, feature = [], 0
        for rank_dims in dims:
            recv_splits.append(sum(pre_a2a[feature + i] * d for i, d in enumerate(rank_dims)))
            feature += len(rank_dims)
        flat = a2a_pooled_embs_tensor.reshape(-1)
        if flat.numel() != sum(send_splits):
            raise ValueError(
                f"a2a_pooled_embs_tensor has {flat.numel()} values but batch_size_per_rank_per_feature x "
                f"emb_dim_per_rank_per_feature[{rank}] needs {sum(send_splits)} (per rank {send_splits})"
            )
        codecs = checks.check_codecs(codecs)
        meta.same(emb_dim_per_rank_per_feature=dims, dtype=str(flat.dtype), codecs=describe_codecs(codecs))
        meta.sizes("its batch_size_per_rank_per_feature[{peer}] x embedding dims", send_splits,
                   "its batch_size_per_feature_pre_a2a x embedding dims of rank {peer}'s features", recv_splits,
                   "values")  # fmt: skip
    plan = FlatAllToAllPlan(pg, codecs, get_gradient_division(), send_splits, recv_splits)
    return Request(plan, (flat,))


def alltoall_sequence(
    a2a_sequence_embs_tensor: torch.Tensor,
    forward_recat_tensor: torch.Tensor | None,
    backward_recat_tensor: torch.Tensor | None,
    lengths_after_sparse_data_all2all: torch.Tensor,
    input_splits: list[int],
    output_splits: list[int],
    variable_batch_size: bool = False,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """Sequence embeddings back to the ranks their ids came from (the reverse of the sparse-feature all-to-all).

    ``a2a_sequence_embs_tensor [N_me, D]``: one row per id this rank received, in its post-input-dist KJT order
    (feature-major, then source rank). ``lengths_after_sparse_data_all2all``: that KJT's lengths. ``input_splits[r]``:
    ids this rank sent to rank ``r`` in the sparse all-to-all (rows it gets back); ``output_splits[r]``: ids it got
    from ``r`` (rows it returns). Without variable batch, ``forward_recat_tensor [T_me * W]`` reorders the
    ``(feature, rank)`` rows of ``lengths.view(T_me * W, -1)`` to rank-major; with it, both recats index single bags.
    Output: ``[sum(input_splits), D]`` in this rank's original KJT value order.
    """
    pg = checks.resolve_group(group)
    with checked_call("alltoall_sequence", pg, metadata_check) as meta:
        world_size = pg.size()
        embs = checks.check_float_tensor(a2a_sequence_embs_tensor, "a2a_sequence_embs_tensor", ndim=2)
        lengths = check_tensor(lengths_after_sparse_data_all2all, "lengths_after_sparse_data_all2all", integer=True)
        input_splits = checks.check_sizes(input_splits, "input_splits", world_size)
        output_splits = checks.check_sizes(output_splits, "output_splits", world_size)
        variable_batch_size = checks.check_bool(variable_batch_size, "variable_batch_size")
        if sum(output_splits) != embs.shape[0]:
            raise ValueError(
                f"a2a_sequence_embs_tensor has {embs.shape[0]} rows but sum(output_splits) = {sum(output_splits)} "
                f"(output_splits={output_splits})"
            )
        if (forward_recat_tensor is None) != (backward_recat_tensor is None):
            recats = (("forward_recat_tensor", forward_recat_tensor), ("backward_recat_tensor", backward_recat_tensor))
            given = {name: "None" if t is None else "a tensor" for name, t in recats}
            raise ValueError(
                f"forward_recat_tensor and backward_recat_tensor must both be tensors or both be None, got {given}"
            )
        if forward_recat_tensor is not None:
            check_tensor(forward_recat_tensor, "forward_recat_tensor", ndim=1, integer=True)
            check_tensor(backward_recat_tensor, "backward_recat_tensor", ndim=1, integer=True)
            bags = lengths.numel()
            recat_size = forward_recat_tensor.numel()
            if variable_batch_size and recat_size != bags:
                raise ValueError(
                    f"with variable_batch_size, forward_recat_tensor must index the {bags} bags of "
                    f"lengths_after_sparse_data_all2all, got {recat_size} entries"
                )
            if not variable_batch_size and bags and (recat_size == 0 or bags % recat_size):
                raise ValueError(
                    f"forward_recat_tensor has {recat_size} entries (features x ranks), which must divide the {bags} "
                    "entries of lengths_after_sparse_data_all2all"
                )
            if backward_recat_tensor.numel() != recat_size:  # type: ignore[union-attr]
                raise ValueError(
                    f"backward_recat_tensor must have as many entries as forward_recat_tensor ({recat_size}), "
                    f"got {backward_recat_tensor.numel()}"  # type: ignore[union-attr]
                )
        check_lengths_total(
            lengths, "lengths_after_sparse_data_all2all", embs.shape[0], "rows of a2a_sequence_embs_tensor"
        )
        codecs = checks.check_codecs(codecs)
        meta.same(
            embedding_dim=embs.shape[1],
            dtype=str(embs.dtype),
            variable_batch_size=variable_batch_size,
            codecs=describe_codecs(codecs),
        )
        meta.sizes("its output_splits[{peer}]", output_splits, "its input_splits[{peer}]", input_splits, "rows")
    plan = SequenceAllToAllPlan(
        pg, codecs, get_gradient_division(), embs.shape[1], lengths, forward_recat_tensor, backward_recat_tensor,
        send_rows=output_splits, recv_rows=input_splits, variable_batch_size=variable_batch_size,
    )  # fmt: skip
    return Request(plan, (embs,))


def _even_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` ranks, the first ``total % parts`` ranks taking one more (torchrec's rule)."""
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def alltoallv(
    inputs: list[torch.Tensor],
    out_split: list[int] | None = None,
    per_rank_split_lengths: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[list[torch.Tensor]]:
    """All-to-all of ``inputs`` (``[B_global, D_i]`` each) cut along the batch: rank ``r`` gets rows
    ``[B_0 + ... + B_{r-1}, + B_r)`` with ``B`` split as evenly as possible (the first ranks take the remainder).

    The result holds one ``[B_me, out_split[r]]`` tensor per rank ``r``. ``out_split`` gives each rank's
    ``sum(D_i)``; without it, ``per_rank_split_lengths[r] x D_0`` (all inputs of equal width).
    """
    pg = checks.resolve_group(group)
    with checked_call("alltoallv", pg, metadata_check) as meta:
        world_size, rank = pg.size(), pg.rank()
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise TypeError(f"inputs must be a non-empty list of tensors, got {inputs!r}")
        for i, t in enumerate(inputs):
            checks.check_float_tensor(t, f"inputs[{i}]", ndim=2)
            if t.shape[0] != inputs[0].shape[0] or t.dtype != inputs[0].dtype or t.device != inputs[0].device:
                raise ValueError(
                    f"inputs must share rows, dtype and device; inputs[{i}] is {tuple(t.shape)} {t.dtype} {t.device}, "
                    f"inputs[0] is {tuple(inputs[0].shape)} {inputs[0].dtype} {inputs[0].device}"
                )
        local_dims = [t.shape[1] for t in inputs]
        if out_split is not None:
            dims_sum_per_rank = checks.check_sizes(out_split, "out_split", world_size)
        elif per_rank_split_lengths is not None:
            lengths = checks.check_sizes(per_rank_split_lengths, "per_rank_split_lengths", world_size)
            dims_sum_per_rank = [n * local_dims[0] for n in lengths]
        else:
            raise ValueError("alltoallv needs out_split or per_rank_split_lengths, got out_split=None and "
                             "per_rank_split_lengths=None")  # fmt: skip
        if dims_sum_per_rank[rank] != sum(local_dims):
            raise ValueError(
                f"this rank's inputs have {sum(local_dims)} columns in all but the output split for rank {rank} is "
                f"{dims_sum_per_rank[rank]} (dims per rank {dims_sum_per_rank})"
            )
        codecs = checks.check_codecs(codecs)
        split_field = {"out_split": dims_sum_per_rank} if out_split is not None else {
            "per_rank_split_lengths": lengths, "width_of_inputs": local_dims[0]}  # fmt: skip
        meta.same(**split_field, rows_of_inputs=inputs[0].shape[0], dtype=str(inputs[0].dtype),
                  codecs=describe_codecs(codecs))  # fmt: skip
    batch_split = _even_split(inputs[0].shape[0], world_size)
    plan = AllToAllVPlan(pg, codecs, get_gradient_division(), batch_split, local_dims, dims_sum_per_rank)
    return Request(plan, tuple(inputs))


def all_gather_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    metadata_check: MetadataCheck | None = None,
) -> Awaitable[torch.Tensor]:
    """``input [n, *rest]`` (same shape on every rank) -> ``[W * n, *rest]``, rank ``r``'s rows at ``r * n``."""
    pg = checks.resolve_group(group)
    with checked_call("all_gather_base_pooled", pg, metadata_check) as meta:
        checks.check_float_tensor(input, "input", min_ndim=1)
        codecs = checks.check_codecs(codecs)
        meta.same(input_shape=list(input.shape), dtype=str(input.dtype), codecs=describe_codecs(codecs))
    plan = AllGatherPlan(pg, codecs, get_gradient_division(), tuple(input.shape))
    return Request(plan, (input,))


__all__ = [
    "all_gather_base_pooled",
    "alltoall_pooled",
    "alltoall_sequence",
    "alltoallv",
    "get_gradient_division",
    "reduce_scatter_base_pooled",
    "reduce_scatter_pooled",
    "reduce_scatter_v_per_feature_pooled",
    "reduce_scatter_v_pooled",
    "set_gradient_division",
    "variable_batch_alltoall_pooled",
]
