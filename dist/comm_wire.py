"""The three wire primitives every comm op is built from, codec-aware: all-to-all, reduce-scatter, all-gather.

Each primitive takes *blocks*: the tensor going to (or coming from) each peer, in rank order, and returns an
:class:`InFlight` (the launched ``async_op`` collective plus how to read its result). A block of shape
``[rows, *rest]`` travels as a ``[rows, prod(rest)]`` matrix; a 1-D block ``[n]`` as ``[1, n]``.

With a codec (one direction of :class:`~tritonrec.dist.qcomm_protocol.QuantizedCommCodecs`), per call::

    ctx = codec.create_context()
    widths -> codec.padded_size(...) per block width    # row-wise formats round widths up to whole rows
    zero-pad each block's columns, flatten, concatenate  # so no quantization row straddles two peers' blocks
    wire = codec.encode(flat, ctx)                      # one encode for all peers
    split sizes = codec.calc_quantized_size(rows * padded_width, ctx) per block
    collective(wire) -> codec.decode(received, ctx) -> per-block [rows, padded_width][:, :width]

Sender and receiver compute the padded widths and wire sizes independently; both are pure functions of a block's
shape and the codec's settings (the protocol's contract), so they agree without an extra exchange.

Backends: the plain paths are the backend's own ``all_to_all_single``, ``reduce_scatter_tensor`` and
``all_gather_into_tensor``. gloo (torch 2.13) rejects an all-gather of unequal sizes, so uneven all-gathers go
through ``all_to_all_single``; uneven and encoded reduce-scatters do too (see :func:`reduce_scatter`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.tensor_collectives import all_gather_tensor, reduce_scatter_tensor

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodec

R = TypeVar("R")
S = TypeVar("S")


@dataclass(frozen=True)
class WireTraffic:
    """What one collective handed to the backend: elements of ``dtype`` sent to / received from each rank (this
    rank's own block included, as the collective's input and output buffers hold it)."""

    collective: str
    dtype: torch.dtype
    send_splits: list[int]
    recv_splits: list[int]

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def send_bytes(self) -> int:
        return sum(self.send_splits) * self.element_size

    @property
    def recv_bytes(self) -> int:
        return sum(self.recv_splits) * self.element_size


class InFlight(Generic[R]):
    """A launched collective: ``wait()`` blocks on its work handle (with the collective timeout) and reads it.

    ``send`` is the buffer handed to the backend, held until the wait so an asynchronous backend never reads freed
    memory (the encoded buffer has no other owner).
    """

    def __init__(
        self,
        collective: str,
        group: dist.ProcessGroup,
        work: dist.Work | None,
        traffic: WireTraffic,
        read: Callable[[], R],
        send: torch.Tensor | None = None,
    ) -> None:
        self.collective = collective
        self.group = group
        self.traffic = traffic
        self._work = work
        self._read = read
        self._send = send

    def then(self, transform: Callable[[R], S]) -> InFlight[S]:
        """The same collective, with ``transform`` applied to what it reads."""
        read = self._read
        return InFlight(self.collective, self.group, self._work, self.traffic, lambda: transform(read()), self._send)

    def wait(self) -> R:
        if self._work is not None:
            wait_for_work(self._work, self.collective, self.group)
            self._work = self._send = None
        return self._read()


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """How a block of ``shape`` travels: ``[n] -> (1, n)``, ``[rows, *rest] -> (rows, prod(rest))``."""
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def _wire_dtype(codec: Any) -> torch.dtype:
    dtype = codec.quantized_dtype
    return dtype() if callable(dtype) else dtype  # torchrec's NoOp codec declares it as a method, not a property


def padded_widths(codec: QuantizedCommCodec, ctx: Any, widths: list[int], like: torch.Tensor) -> list[int]:
    """Each width rounded up as the codec wants it (``padded_size`` asked once per block, as that rank's width)."""
    if not widths:
        return []
    return [int(codec.padded_size(like.new_empty((0, w)), widths, r, ctx)[0]) for r, w in enumerate(widths)]


def wire_splits(
    codec: QuantizedCommCodec | None, ctx: Any, shapes: list[tuple[int, int]], like: torch.Tensor
) -> list[int]:
    """Wire elements of each ``(rows, width)`` block: ``rows * width`` plain, ``calc_quantized_size`` encoded."""
    if codec is None:
        return [rows * width for rows, width in shapes]
    padded = padded_widths(codec, ctx, [width for _, width in shapes], like)
    return [int(codec.calc_quantized_size(rows * p, ctx)) for (rows, _), p in zip(shapes, padded, strict=True)]


def _pack(
    blocks: Sequence[torch.Tensor], codec: QuantizedCommCodec | None, ctx: Any, whole: torch.Tensor | None
) -> tuple[torch.Tensor, list[int]]:
    """Blocks -> (flat wire tensor, wire elements per block). ``whole``: a contiguous tensor whose flattening is the
    concatenation of the flattened blocks (saves a copy when no padding is needed)."""
    like = blocks[0] if blocks else whole
    mats = [b.reshape(matrix_shape(b.shape)) for b in blocks]
    shapes = [(m.shape[0], m.shape[1]) for m in mats]
    if codec is None:
        if whole is not None and whole.is_contiguous():
            return whole.reshape(-1), [r * w for r, w in shapes]
        return torch.cat([m.reshape(-1) for m in mats]) if mats else like.new_empty(0), [r * w for r, w in shapes]
    padded = padded_widths(codec, ctx, [w for _, w in shapes], like)
    if padded != [w for _, w in shapes]:
        mats = [F.pad(m, (0, p - m.shape[1])) if p > m.shape[1] else m for m, p in zip(mats, padded, strict=True)]
        flat = torch.cat([m.reshape(-1) for m in mats])
    elif whole is not None and whole.is_contiguous():
        flat = whole.reshape(-1)
    else:
        flat = torch.cat([m.reshape(-1) for m in mats]) if mats else like.new_empty(0)
    flat = flat.to(torch.float32)  # codecs take fp32 (the protocol's input dtype)
    wire = codec.encode(flat, ctx).reshape(-1) if flat.numel() else flat.new_empty(0, dtype=_wire_dtype(codec))
    splits = [int(codec.calc_quantized_size(r * p, ctx)) for (r, _), p in zip(shapes, padded, strict=True)]
    if sum(splits) != wire.numel():
        raise ValueError(
            f"codec {codec!r} encoded {flat.numel()} values into {wire.numel()} wire elements, but "
            f"calc_quantized_size gives {splits} (sum {sum(splits)}) for the per-rank blocks"
        )
    return wire, splits


def _unpack(
    received: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    codec: QuantizedCommCodec | None,
    ctx: Any,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Received wire tensor -> one tensor per block, of the given shapes, in ``dtype``."""
    mats = [matrix_shape(s) for s in shapes]
    if codec is None:
        parts = received.split([r * w for r, w in mats])
        return [p.reshape(tuple(s)) for p, s in zip(parts, shapes, strict=True)]
    padded = padded_widths(codec, ctx, [w for _, w in mats], received)
    values = codec.decode(received, ctx).reshape(-1) if received.numel() else received.new_empty(0, dtype=dtype)
    expected = sum(r * p for (r, _), p in zip(mats, padded, strict=True))
    if values.numel() != expected:
        raise ValueError(f"codec {codec!r} decoded {values.numel()} values, expected {expected} for blocks {mats}")
    parts = values.split([r * p for (r, _), p in zip(mats, padded, strict=True)])
    return [
        part.view(r, p)[:, :w].reshape(tuple(s)).to(dtype)
        for part, (r, w), p, s in zip(parts, mats, padded, shapes, strict=True)
    ]


def cat_received(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, but a view without a copy when the parts are consecutive row-major pieces of one
    buffer - as the blocks of one receive buffer are (:func:`_unpack` without padding). A fresh
    multi-MiB ``cat`` output costs a page fault per 4 KiB on first touch: 1.4 ms a step for the 2 MiB gradient of
    row-wise sharding's all-gather on the benchmark's shape."""
    live = [p for p in parts if p.numel()]
    if len(live) > 1 and _consecutive(live):
        first = live[0]
        shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):  # row-major strides (a 1-row part's own stride[0] may be anything)
            strides[d] = strides[d + 1] * shape[d + 1]
        return first.as_strided(shape, strides, first.storage_offset())
    return torch.cat(list(parts))


def _consecutive(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` (non-empty) are contiguous, alike in trailing shape, and laid end to end in one storage."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    for before, part in itertools.pairwise(parts):
        if (
            part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
            or not part.is_contiguous()
            or not before.is_contiguous()
            or part.untyped_storage().data_ptr() != storage
            or part.data_ptr() != before.data_ptr() + before.numel() * before.element_size()
        ):
            return False
    return True


def all_to_all(
    collective: str,
    group: dist.ProcessGroup,
    send_blocks: Sequence[torch.Tensor],
    recv_shapes: Sequence[Sequence[int]],
    codec: QuantizedCommCodec | None = None,
    whole: torch.Tensor | None = None,
) -> InFlight[list[torch.Tensor]]:
    """``send_blocks[r]`` goes to rank ``r``; the result holds the block from each rank, of ``recv_shapes[r]``."""
    dtype = send_blocks[0].dtype if send_blocks else whole.dtype  # type: ignore[union-attr]
    ctx = codec.create_context() if codec is not None else None
    wire, send_splits = _pack(send_blocks, codec, ctx, whole)
    recv_splits = wire_splits(codec, ctx, [matrix_shape(s) for s in recv_shapes], wire)
    received = wire.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(received, wire, recv_splits, send_splits, group=group, async_op=True)
    traffic = WireTraffic(collective, wire.dtype, send_splits, recv_splits)
    read = lambda: _unpack(received, recv_shapes, codec, ctx, dtype)
    return InFlight(collective, group, work, traffic, read, send=wire)


def _sum_in_rank_order(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the blocks, accumulated in fp32 (or wider) in rank order, so every rank rounds the same way."""
    acc_dtype = torch.promote_types(blocks[0].dtype, torch.float32)
    total = blocks[0].to(acc_dtype, copy=True)
    for block in blocks[1:]:
        total.add_(block)
    return total.to(blocks[0].dtype)


def reduce_scatter(
    collective: str,
    group: dist.ProcessGroup,
    send_blocks: Sequence[torch.Tensor],
    recv_shape: Sequence[int],
    codec: QuantizedCommCodec | None = None,
    whole: torch.Tensor | None = None,
) -> InFlight[torch.Tensor]:
    """Rank ``r`` gets the sum over ranks of their ``send_blocks[r]`` (every rank's block ``r`` has shape
    ``recv_shape`` on rank ``r``).

    Equal blocks without a codec use the backend's reduce-scatter. Otherwise blocks go through ``all_to_all`` and are
    summed after decoding, in fp32 and in rank order: row-wise codes (FP8, INT8, MX4) cannot be added on the wire,
    and uneven blocks then need nothing from the backend beyond ``all_to_all_single`` (each rank sends ``W - 1``
    blocks and receives ``W - 1``, the same bytes as a ring reduce-scatter).
    """
    recv_shape = tuple(recv_shape)
    if codec is None and all(tuple(b.shape) == recv_shape for b in send_blocks):
        source = whole if whole is not None and whole.is_contiguous() else torch.cat(list(send_blocks))
        output = source.new_empty(recv_shape)
        work = reduce_scatter_tensor(output, source, group=group, async_op=True)
        splits = [output.numel()] * group.size()
        traffic = WireTraffic(collective, source.dtype, splits, splits)
        return InFlight(collective, group, work, traffic, lambda: output, send=source)
    gathered = all_to_all(collective, group, send_blocks, [recv_shape] * group.size(), codec, whole)
    return gathered.then(_sum_in_rank_order)


def all_gather(
    collective: str,
    group: dist.ProcessGroup,
    block: torch.Tensor,
    recv_shapes: Sequence[Sequence[int]],
    codec: QuantizedCommCodec | None = None,
) -> InFlight[list[torch.Tensor]]:
    """Every rank gets every rank's ``block`` (rank ``r``'s has shape ``recv_shapes[r]``), encoded once."""
    dtype = block.dtype
    ctx = codec.create_context() if codec is not None else None
    wire, (send_split,) = _pack([block], codec, ctx, block)
    world_size = group.size()
    recv_splits = wire_splits(codec, ctx, [matrix_shape(s) for s in recv_shapes], wire)
    received = wire.new_empty(sum(recv_splits))
    if all(split == send_split for split in recv_splits):
        work = all_gather_tensor(received, wire, group=group, async_op=True)
    else:
        # gloo's all_gather rejects tensors of different sizes, so the uneven case sends this rank's (encoded)
        # block to every peer through all_to_all_single: the same bytes per peer, one extra local copy.
        wire = wire.repeat(world_size)
        work = dist.all_to_all_single(
            received, wire, recv_splits, [send_split] * world_size, group=group, async_op=True
        )
    traffic = WireTraffic(collective, wire.dtype, [send_split] * world_size, recv_splits)
    read = lambda: _unpack(received, recv_shapes, codec, ctx, dtype)
    return InFlight(collective, group, work, traffic, read, send=wire)


__all__ = [
    "InFlight",
    "WireTraffic",
    "all_gather",
    "all_to_all",
    "cat_received",
    "matrix_shape",
    "reduce_scatter",
    "wire_splits",
]
