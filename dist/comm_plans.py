"""The :class:`~tritonrec.dist.comm_request.CollectivePlan` of each comm op: which blocks go where, both ways.

Notation: ``W`` world size, ``B_r`` batch size of rank ``r``, ``D_r`` embedding dims summed over rank ``r``'s tables.
Each backward is the transposed collective of its forward (all-to-all <-> all-to-all with splits swapped,
reduce-scatter <-> all-gather), so a plan's backward sends exactly the shapes its forward received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tritonrec.dist import comm_wire
from tritonrec.dist.comm_request import CollectivePlan
from tritonrec.dist.comm_wire import InFlight
from tritonrec.kernels import permute_1d_sparse_data, permute_2d_sparse_data

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodecs


class PooledAllToAllPlan(CollectivePlan):
    """``[sum(B), D_me]`` (rows of every rank's batch) -> ``[B_me, sum(D)]`` (every rank's columns)."""

    name = "alltoall_pooled"

    def __init__(
        self,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        batch_size_per_rank: list[int],
        dim_sum_per_rank: list[int],
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.batch_size_per_rank = batch_size_per_rank
        self.dim_sum_per_rank = dim_sum_per_rank
        self.local_batch = batch_size_per_rank[self.rank]
        self.local_dim = dim_sum_per_rank[self.rank]

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (embs,) = inputs
        recv = [(self.local_batch, d) for d in self.dim_sum_per_rank]
        blocks = embs.split(self.batch_size_per_rank)
        return comm_wire.all_to_all(self.name, self.group, blocks, recv, self.forward_codec, whole=embs)

    def finish_forward(self, received: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(received, dim=1)

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (grad,) = grads
        recv = [(b, self.local_dim) for b in self.batch_size_per_rank]
        blocks = grad.split(self.dim_sum_per_rank, dim=1)
        return comm_wire.all_to_all(self.backward_name, self.group, blocks, recv, self.backward_codec)

    def finish_backward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (comm_wire.cat_received(received),)


class FlatAllToAllPlan(CollectivePlan):
    """Flat ``[sum(send_splits)]`` -> flat ``[sum(recv_splits)]``: chunk ``r`` of the input goes to rank ``r``.
    Used by ``variable_batch_alltoall_pooled``, whose chunks are per-feature ``batch x dim`` runs."""

    name = "variable_batch_alltoall_pooled"

    def __init__(
        self,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        send_splits: list[int],
        recv_splits: list[int],
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.send_splits = send_splits
        self.recv_splits = recv_splits

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (flat,) = inputs
        recv = [(n,) for n in self.recv_splits]
        return comm_wire.all_to_all(
            self.name, self.group, flat.split(self.send_splits), recv, self.forward_codec, whole=flat
        )

    def finish_forward(self, received: list[torch.Tensor]) -> torch.Tensor:
        return comm_wire.cat_received(received)

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (grad,) = grads
        recv = [(n,) for n in self.send_splits]
        return comm_wire.all_to_all(
            self.backward_name, self.group, grad.split(self.recv_splits), recv, self.backward_codec, whole=grad
        )

    def finish_backward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (comm_wire.cat_received(received),)


class SequenceAllToAllPlan(CollectivePlan):
    """Sequence embeddings ``[N_me, D]`` (rows in the order of this rank's KJT after input dist: feature-major, then
    source rank) -> ``[N_orig, D]`` (rows in the order of this rank's KJT before input dist).

    Forward: permute rows from (feature, source rank) to (source rank, feature) order with ``forward_recat``, then
    send source rank ``r`` its ``send_rows[r]`` rows. Backward: the reverse all-to-all, then ``backward_recat``.
    """

    name = "alltoall_sequence"

    def __init__(
        self,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        embedding_dim: int,
        lengths: torch.Tensor,
        forward_recat: torch.Tensor | None,
        backward_recat: torch.Tensor | None,
        send_rows: list[int],
        recv_rows: list[int],
        variable_batch_size: bool,
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.embedding_dim = embedding_dim
        self.lengths = lengths
        self.forward_recat = forward_recat
        self.backward_recat = backward_recat
        self.send_rows = send_rows
        self.recv_rows = recv_rows
        self.variable_batch_size = variable_batch_size
        self.permuted_lengths: torch.Tensor | None = None

    def _permute(self, recat: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.variable_batch_size:  # recat indexes single bags
            return permute_1d_sparse_data(recat, lengths.reshape(-1), rows)[:2]
        return permute_2d_sparse_data(recat, lengths, rows)[:2]  # recat indexes (feature, rank) rows of lengths

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (embs,) = inputs
        if self.forward_recat is not None and self.lengths.numel() > 0:
            lengths = self.lengths if self.variable_batch_size else self.lengths.view(self.forward_recat.numel(), -1)
            self.permuted_lengths, embs = self._permute(self.forward_recat, lengths, embs)
        recv = [(n, self.embedding_dim) for n in self.recv_rows]
        return comm_wire.all_to_all(
            self.name, self.group, embs.split(self.send_rows), recv, self.forward_codec, whole=embs
        )

    def finish_forward(self, received: list[torch.Tensor]) -> torch.Tensor:
        return comm_wire.cat_received(received).view(-1, self.embedding_dim)

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (grad,) = grads
        recv = [(n, self.embedding_dim) for n in self.send_rows]
        return comm_wire.all_to_all(
            self.backward_name, self.group, grad.split(self.recv_rows), recv, self.backward_codec, whole=grad
        )

    def finish_backward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        grad = comm_wire.cat_received(received).view(-1, self.embedding_dim)
        if self.permuted_lengths is not None and self.backward_recat is not None:
            grad = self._permute(self.backward_recat, self.permuted_lengths, grad)[1]
        return (grad,)


class AllToAllVPlan(CollectivePlan):
    """``D_i``-wide inputs ``[B_global, D_i]`` -> one ``[B_me, dims_sum_per_rank[r]]`` tensor per rank ``r``; the
    global batch is split into ``batch_split`` rows per rank."""

    name = "alltoallv"

    def __init__(
        self,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        batch_split: list[int],
        local_dims: list[int],
        dims_sum_per_rank: list[int],
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.batch_split = batch_split
        self.local_dims = local_dims
        self.dims_sum_per_rank = dims_sum_per_rank

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        merged = torch.cat(inputs, dim=1)
        recv = [(self.batch_split[self.rank], d) for d in self.dims_sum_per_rank]
        return comm_wire.all_to_all(
            self.name, self.group, merged.split(self.batch_split), recv, self.forward_codec, whole=merged
        )

    def finish_forward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(received)

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        recv = [(b, sum(self.local_dims)) for b in self.batch_split]
        return comm_wire.all_to_all(self.backward_name, self.group, grads, recv, self.backward_codec)

    def finish_backward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        grad = comm_wire.cat_received(received)
        return tuple(g.contiguous() for g in grad.split(self.local_dims, dim=1))


class ReduceScatterPlan(CollectivePlan):
    """Reduce-scatter of blocks along dim 0: rank ``r`` gets the sum over ranks of their block ``r``.

    ``splits`` given: one input tensor cut into ``splits`` rows per rank (``reduce_scatter_base_pooled``,
    ``reduce_scatter_v_pooled``, ``reduce_scatter_v_per_feature_pooled``). ``splits`` None: one input tensor per
    rank (``reduce_scatter_pooled``), with the same shapes on every rank. Backward: all-gather of the gradient.
    """

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        block_shapes: list[tuple[int, ...]],
        splits: list[int] | None,
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.name = name
        self.block_shapes = block_shapes
        self.splits = splits

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[torch.Tensor]:
        whole = inputs[0] if self.splits is not None else None
        blocks = inputs[0].split(self.splits) if self.splits is not None else inputs
        shape = self.block_shapes[self.rank]
        return comm_wire.reduce_scatter(self.name, self.group, blocks, shape, self.forward_codec, whole=whole)

    def finish_forward(self, received: torch.Tensor) -> torch.Tensor:
        return received

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (grad,) = grads
        return comm_wire.all_gather(self.backward_name, self.group, grad, self.block_shapes, self.backward_codec)

    def finish_backward(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.splits is None:
            return tuple(received)
        return (comm_wire.cat_received(received),)


class AllGatherPlan(CollectivePlan):
    """``[B, *rest]`` on every rank -> ``[W * B, *rest]`` (rank-major). Backward: reduce-scatter of the gradient."""

    name = "all_gather_base_pooled"

    def __init__(
        self,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        gradient_division: bool,
        input_shape: tuple[int, ...],
    ) -> None:
        super().__init__(group, codecs, gradient_division)
        self.input_shape = input_shape

    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[list[torch.Tensor]]:
        (block,) = inputs
        shapes = [self.input_shape] * self.world_size
        return comm_wire.all_gather(self.name, self.group, block, shapes, self.forward_codec)

    def finish_forward(self, received: list[torch.Tensor]) -> torch.Tensor:
        return comm_wire.cat_received(received)

    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[torch.Tensor]:
        (grad,) = grads
        blocks = grad.split([self.input_shape[0]] * self.world_size)
        return comm_wire.reduce_scatter(
            self.backward_name, self.group, blocks, self.input_shape, self.backward_codec, whole=grad
        )

    def finish_backward(self, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (received,)


__all__ = [
    "AllGatherPlan",
    "AllToAllVPlan",
    "FlatAllToAllPlan",
    "PooledAllToAllPlan",
    "ReduceScatterPlan",
    "SequenceAllToAllPlan",
]
