"""Batches from DataLoader workers to the main process through a ring of shared-memory slots per worker.

A torch DataLoader sends each tensor of a worker's batch as its own shared-memory segment, and with the default
``file_descriptor`` strategy the main process receives every segment's descriptor over a fresh, authenticated
socket connection to the worker: about 0.5 ms per tensor, 2.4 ms for a 2048-row Criteo batch of five tensors, more
than reading the batch from a memory-mapped npy file. Here each worker owns a :class:`_Ring` of ``slots`` buffers in
shared memory, sent to the main process once; a batch is packed into a free slot (every tensor at a 64-byte aligned
offset, the KJT's other fields as its pytree context) and travels as a slot number. The main process copies the
slot into a buffer of its own, hands out views of it, and marks the slot free. ``make_rank_loader`` packs in its
workers and unpacks on the consumer's side.

The main process frees a slot when it is done with the :class:`RingBatch` naming it: when it copies the slot out,
or when it drops the RingBatch unread. Batches are dropped unread in more places than our own code: torchdata's
``StatefulDataLoader`` replays and discards the batches since its last snapshot when it resumes, and a reset
iterator discards its prefetched ones. Freeing in ``RingBatch.__del__`` covers them all without reaching into the
loader's internals.

Each word of shared state has one writer, so no check-then-write can race: the worker stamps each packed slot with
a fresh token (``packed[slot]``), the main process frees it by writing that token back (``freed[slot]``), and a slot
is free while the two agree. A new iteration frees every slot on the worker side alone, by moving a floor (every
token at or below it counts as returned), so a batch of the old iteration dropped late writes back an old token,
which frees nothing the worker has packed since. A batch larger than a slot, or one made while every slot is taken,
travels as a :class:`PackedBatch`: one shared buffer of its own.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tritonrec.data._pytree import _flatten_kjt, _unflatten_kjt
from tritonrec.data.batch import Batch

_ALIGN = 64
Layout = tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]


def _tensors_of(batch: Batch) -> tuple[list[torch.Tensor], tuple]:
    """A batch's tensors in packing order (dense, labels, valid mask, the KJT's) and the KJT's pytree context."""
    kjt_tensors, kjt_context = _flatten_kjt(batch.sparse_features)
    return [batch.dense_features, batch.labels, batch.valid_mask, *kjt_tensors], kjt_context


def _layout_of(tensors: list[torch.Tensor]) -> tuple[Layout, int]:
    """Each tensor's ``(offset, dtype, shape)`` at 64-byte aligned offsets, and the bytes they take in all."""
    layout, size = [], 0
    for tensor in tensors:
        size = -(-size // _ALIGN) * _ALIGN
        layout.append((size, tensor.dtype, tuple(tensor.shape)))
        size += tensor.numel() * tensor.element_size()
    return tuple(layout), size


class PackedBatch:
    """One :class:`Batch` in one buffer: ``buffer [nbytes] uint8``, each tensor's ``(offset, dtype, shape)`` in
    ``layout`` (dense, labels, valid mask, then the KJT's tensors) and the KJT's pytree context."""

    __slots__ = ("buffer", "kjt_context", "layout")

    def __init__(self, buffer: torch.Tensor, layout: Layout, kjt_context: tuple) -> None:
        self.buffer, self.layout, self.kjt_context = buffer, layout, kjt_context

    @classmethod
    def pack(cls, batch: Batch) -> PackedBatch:
        tensors, kjt_context = _tensors_of(batch)
        layout, size = _layout_of(tensors)
        storage = torch.UntypedStorage._new_shared(max(size, 1))  # shared from the start: pickling copies nothing
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        packed = cls(buffer, layout, kjt_context)
        for tensor, view in zip(tensors, packed._views(), strict=True):
            view.copy_(tensor)
        return packed

    def _views(self) -> list[torch.Tensor]:
        views = []
        for offset, dtype, shape in self.layout:
            count = 1
            for dim in shape:
                count *= dim
            nbytes = count * dtype.itemsize
            views.append(self.buffer[offset : offset + nbytes].view(dtype).view(shape))
        return views

    def unpack(self) -> Batch:
        """The batch, as views of :attr:`buffer` (no copy)."""
        dense, labels, valid_mask, *kjt_tensors = self._views()
        return Batch(dense, _unflatten_kjt(kjt_tensors, self.kjt_context), labels, valid_mask)

    def pin_memory(self) -> PackedBatch:
        """The DataLoader's pin-memory thread calls this: one pinned copy of the whole buffer."""
        return PackedBatch(self.buffer.pin_memory(), self.layout, self.kjt_context)


standalone_batches = 0  # main process: batches that came as a PackedBatch of their own (a full ring or oversize)


def unpacked(batch: Any) -> Any:
    global standalone_batches
    if isinstance(batch, PackedBatch):
        standalone_batches += 1
    return batch.unpack() if isinstance(batch, (PackedBatch, RingBatch)) else batch


class UnpackingIterator:
    """Wraps a DataLoader iterator: yields what it yields, with :class:`PackedBatch` es unpacked."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __iter__(self) -> UnpackingIterator:
        return self

    def __next__(self) -> Any:
        return unpacked(next(self.iterator))

    def __len__(self) -> int:
        return len(self.iterator)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the wrapped iterator's own API (state_dict, ...)
        return getattr(self.iterator, name)


_SLOTS = 4  # >= the loader's default prefetch of 2 per worker, plus the one being made and one being copied
_WAIT_S = 1.0  # longest wait for a free slot before a batch travels as its own PackedBatch
_RINGS: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # main process: ring id -> (slots, tokens, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _register(ring_id: str, ring: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    """Keep a worker's ring (its first batches carry it), and let go of the rings of workers that have exited."""
    if ring_id in _RINGS:
        return
    for old in [key for key, (_, _, pid) in _RINGS.items() if not _alive(pid)]:
        del _RINGS[old]
    _RINGS[ring_id] = ring


class _Ring:
    """A worker's slots: ``slots [count, slot_bytes] uint8`` and ``tokens [2, count] int64`` (row 0 ``packed``,
    written by the worker; row 1 ``freed``, written by the main process), both in shared memory; see the module
    docstring. The ring travels with every batch until the worker sees the main process free a slot (proof that it
    holds the ring); after that, batches carry only slot numbers."""

    def __init__(self, slot_bytes: int, count: int = _SLOTS) -> None:
        self.id = uuid.uuid4().hex
        storage = torch.UntypedStorage._new_shared(count * slot_bytes)
        self.slots = torch.empty(0, dtype=torch.uint8).set_(storage).view(count, slot_bytes)
        self.tokens = torch.zeros(2, count, dtype=torch.int64).share_memory_()
        self.sent = False
        self._outstanding: set[int] = set()  # slots packed in this iteration and not yet seen freed
        self._last_token = 0  # tokens start at 1: a slot with packed == freed == 0 has never been used
        self._floor = 0  # tokens up to here belong to finished iterations: their slots are free

    def next_token(self) -> int:
        self._last_token += 1
        return self._last_token

    def reclaim(self) -> None:
        """A new iteration: the main process has copied or dropped every slot it was sent."""
        self._floor = self._last_token
        self._outstanding.clear()

    def free_slots(self) -> list[bool]:
        packed, freed = self.tokens.tolist()
        return [p == f or p <= self._floor for p, f in zip(packed, freed, strict=True)]

    def take(self) -> int | None:
        """A free slot (the caller stamps it); None when none frees up within ``_WAIT_S``."""
        deadline = None
        while True:
            free = self.free_slots()
            if not self.sent and any(free[s] for s in self._outstanding):
                self.sent = True
            if True in free:
                slot = free.index(True)
                self._outstanding.add(slot)
                return slot
            deadline = deadline or time.monotonic() + _WAIT_S
            if time.monotonic() > deadline:
                return None
            time.sleep(50e-6)


def _free_slot(ring_id: str, slot: int, token: int, ring: Any) -> None:
    """Main process: hand ``slot`` back by writing its ``token`` to ``freed`` (see the module docstring). Skipped
    when the worker has packed the slot again since (a late drop): the old token would free nothing, but writing it
    could overwrite the newer batch's own release."""
    if ring is not None:
        _register(ring_id, ring)  # the worker stops sending the ring once it sees a slot freed
    entry = _RINGS.get(ring_id)
    if entry is None:  # we never saw this ring, or its worker has exited: nothing waits for the slot
        return
    tokens = entry[1]
    if int(tokens[0, slot]) == token:
        tokens[1, slot] = token


def _received_ring_batch(*fields: Any) -> RingBatch:
    """Unpickling a :class:`RingBatch` (in the main process, or its pin-memory thread)."""
    batch = RingBatch(*fields)
    batch._owner = True
    return batch


class RingBatch:
    """A batch in slot ``slot`` of ring ``ring_id``, stamped ``token`` (and the ring itself until the main process
    has it). The copy the main process receives owns the slot: it frees it once copied out, or when it is dropped
    unread (see the module docstring); the worker's own copy never frees anything."""

    __slots__ = ("_owner", "kjt_context", "layout", "ring", "ring_id", "size", "slot", "token")

    def __init__(
        self, ring_id: str, slot: int, token: int, size: int, layout: Layout, kjt_context: tuple, ring: Any
    ) -> None:
        self.ring_id, self.slot, self.token, self.size = ring_id, slot, token, size
        self.layout, self.kjt_context, self.ring = layout, kjt_context, ring
        self._owner = False

    def __reduce__(self) -> tuple[Any, tuple]:
        fields = (self.ring_id, self.slot, self.token, self.size, self.layout, self.kjt_context, self.ring)
        return _received_ring_batch, fields

    def copy_out(self) -> PackedBatch:
        """Main process: the slot's bytes in a buffer of our own, and the slot marked free."""
        if self.ring is not None:
            _register(self.ring_id, self.ring)
        slots, tokens, _ = _RINGS[self.ring_id]
        if int(tokens[0, self.slot]) != self.token:
            raise RuntimeError(
                f"ring slot {self.slot} no longer holds this batch (token {self.token}, slot holds "
                f"{int(tokens[0, self.slot])}): its worker packed it again (a new iteration began before this "
                "batch of the last one was read)"
            )
        buffer = torch.empty(max(self.size, 1), dtype=torch.uint8)
        buffer.copy_(slots[self.slot, : buffer.numel()])
        self._release()
        return PackedBatch(buffer, self.layout, self.kjt_context)

    def _release(self) -> None:
        _free_slot(self.ring_id, self.slot, self.token, self.ring)
        self._owner = False  # once only: the slot may be packed again right after

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Dropped unread (e.g. replayed by a resuming StatefulDataLoader): free the slot. Not at interpreter exit
        # (no worker waits any more): indexing the ring's tensors while torch's objects are torn down aborted the
        # process (an internal assert in THPVariable_clear), and module globals may already be cleared.
        if self._owner and not _finalizing() and _RINGS is not None:
            self._release()

    def unpack(self) -> Batch:
        return self.copy_out().unpack()

    def pin_memory(self) -> PackedBatch:
        return self.copy_out().pin_memory()


class WorkerPacker:
    """Worker side: packs each batch into a free slot of this worker's ring (made at the first batch, with slots
    a quarter larger than it)."""

    def __init__(self) -> None:
        self.ring: _Ring | None = None

    def new_iteration(self) -> None:
        if self.ring is not None:
            self.ring.reclaim()

    def pack(self, batch: Batch) -> RingBatch | PackedBatch:
        tensors, kjt_context = _tensors_of(batch)
        layout, size = _layout_of(tensors)
        if self.ring is None:
            self.ring = _Ring(-(-(size + size // 4 + _ALIGN) // _ALIGN) * _ALIGN)
        ring = self.ring
        slot = ring.take() if size <= ring.slots.shape[1] else None
        if slot is None:
            return PackedBatch.pack(batch)
        region = ring.slots[slot]
        for tensor, (offset, dtype, shape) in zip(tensors, layout, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            region[offset : offset + nbytes].view(dtype).view(shape).copy_(tensor)
        token = ring.next_token()
        ring.tokens[0, slot] = token  # after the data: the main process reads the slot only once the batch arrives
        payload = None if ring.sent else (ring.slots, ring.tokens, os.getpid())
        return RingBatch(ring.id, slot, token, size, layout, kjt_context, payload)
