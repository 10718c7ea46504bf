"""Where every token goes when sequences are packed into bins: the index bookkeeping shared by the pack and unpack
ops (:mod:`tritonrec.kernels.pack_sequences`) and both of their backends.

Everything here is ``[B]``- or ``[num_bins]``-sized, computed once per batch with a few vectorised torch ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from tritonrec.kernels.checks import (
    check_index_range,
    check_int,
    check_nonnegative,
    check_offsets,
    check_optional_int,
    check_same_device,
    check_tensor,
)

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class PackingPlan:
    """The packed layout of ``B`` sequences in ``num_bins`` bins (build with :func:`make_packing_plan`).

    Packed position ``j`` holds original sequence ``sequence_order[j]``; bin ``b`` holds packed positions
    ``bin_offsets[b]:bin_offsets[b + 1]``. Every sequence occupies a slot of ``ceil(length / pad_to_multiple) *
    pad_to_multiple`` tokens.
    """

    sequence_order: torch.Tensor  # int64 [B]
    bin_offsets: torch.Tensor  # int64 [num_bins + 1]
    cu_seqlens: torch.Tensor  # int32 [B + 1]: slot boundaries of the packed positions, one flat token stream
    source_starts: torch.Tensor  # int64 [B], by original index: first row of the sequence in the flat source
    source_lengths: torch.Tensor  # int64 [B], by original index: real tokens of the sequence
    packed_starts: torch.Tensor  # int64 [B], by packed position: first row of the slot in the flat packed output
    bin_ids: torch.Tensor  # int64 [B], by packed position: the bin holding it
    capacity: int | None  # None: one flat [T, *] buffer; else [num_bins, capacity, *]
    padded_len: int | None  # S of a padded [B, S, *] source; None for a jagged [N, *] source
    pad_to_multiple: int
    num_source_rows: int  # B * S (padded) or offsets[-1] (jagged)
    num_slot_tokens: int  # T = cu_seqlens[-1]
    max_seqlen: int  # longest slot (FlashAttention's max_seqlen)

    @property
    def num_sequences(self) -> int:
        return self.sequence_order.numel()

    @property
    def num_bins(self) -> int:
        return self.bin_offsets.numel() - 1

    @property
    def num_packed_rows(self) -> int:
        """Rows of the packed output once flattened: ``T`` (flat) or ``num_bins * capacity``."""
        return self.num_bins * self.capacity if self.capacity is not None else self.num_slot_tokens

    def bin_cu_seqlens(self, bin_id: int) -> torch.Tensor:
        """int32 ``[k + 1]``: FlashAttention varlen boundaries of bin ``bin_id``'s ``k`` sequences, from 0."""
        first, last = int(self.bin_offsets[bin_id]), int(self.bin_offsets[bin_id + 1])
        return self.cu_seqlens[first : last + 1] - self.cu_seqlens[first]

    def cu_seqlens_per_bin(self) -> torch.Tensor:
        """int32 ``[num_bins, max_k + 1]``: every bin's boundaries from 0, short rows repeating their last value
        (zero-length dummy sequences) so the rows stack."""
        sizes = self.bin_offsets[1:] - self.bin_offsets[:-1]
        width = int(sizes.max().item()) + 1 if self.num_bins else 1
        # Row b, column c reads boundary min(first_b + c, last_b) and subtracts the bin's first boundary.
        index = torch.minimum(
            self.bin_offsets[:-1, None] + torch.arange(width, device=sizes.device), self.bin_offsets[1:, None]
        )
        return self.cu_seqlens[index] - self.cu_seqlens[self.bin_offsets[:-1, None]]

    def to(self, device: torch.device | str) -> PackingPlan:
        """The same plan with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


# A plan travels into the pack / unpack ops as its tensors and its ints (op schemas take no dataclasses).
PLAN_TENSORS = ("sequence_order", "bin_offsets", "cu_seqlens", "source_starts", "source_lengths", "packed_starts",
                "bin_ids")  # fmt: skip


def plan_args(plan: PackingPlan) -> tuple[list[torch.Tensor], int | None, int | None, list[int]]:
    """``(tensors, capacity, padded_len, ints)``: the plan as op arguments (inverse of :func:`plan_from_args`)."""
    tensors = [getattr(plan, name) for name in PLAN_TENSORS]
    ints = [plan.num_source_rows, plan.num_slot_tokens, plan.max_seqlen, plan.pad_to_multiple]
    return tensors, plan.capacity, plan.padded_len, ints


def plan_from_args(
    tensors: list[torch.Tensor], capacity: int | None, padded_len: int | None, ints: list[int]
) -> PackingPlan:
    num_source_rows, num_slot_tokens, max_seqlen, pad_to_multiple = ints
    return PackingPlan(
        **dict(zip(PLAN_TENSORS, tensors, strict=True)),
        capacity=capacity,
        padded_len=padded_len,
        pad_to_multiple=pad_to_multiple,
        num_source_rows=num_source_rows,
        num_slot_tokens=num_slot_tokens,
        max_seqlen=max_seqlen,
    )


def segment_owner(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]``: for every element of ``counts.numel()`` concatenated segments, the index of its segment
    (``total = counts.sum()``, passed so that CUDA needs no sync)."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)


def bin_assignment(
    bins: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packer output (lists of sequence indices per bin) -> ``(sequence_order [B], bin_offsets [num_bins + 1])``."""
    sizes = [len(b) for b in bins]
    order = torch.tensor([i for b in bins for i in b], dtype=torch.int64, device=device)
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64, device=device)
    if sizes:
        offsets[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64, device=device), 0)
    return order, offsets


def _check_permutation(order: torch.Tensor, count: int) -> None:
    check_index_range(order, "sequence_order", count, what="number of sequences B")
    seen = torch.bincount(order, minlength=count)
    if bool((seen != 1).any()):
        where = int((seen != 1).nonzero()[0].item())
        raise ValueError(
            f"sequence_order must list every sequence exactly once; sequence {where} appears {int(seen[where])} times"
        )


def make_packing_plan(
    sequence_order: torch.Tensor,
    bin_offsets: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    padded_len: int | None = None,
    offsets: torch.Tensor | None = None,
    capacity: int | None = None,
    pad_to_multiple: int = 1,
) -> PackingPlan:
    """Plan packing ``B`` sequences into bins.

    Source layout, one of: ``lengths [B]`` with ``padded_len`` (S) for padded ``[B, S, *]`` values, or ``offsets
    [B + 1]`` for jagged ``[N, *]`` values. ``capacity`` selects the ``[num_bins, capacity, *]`` output (every bin
    must fit); ``None`` gives one flat buffer. All tensors must share a device; the plan lives there.
    """
    check_tensor(sequence_order, "sequence_order", ndim=1, integer=True)
    check_tensor(bin_offsets, "bin_offsets", ndim=1, integer=True)
    if (lengths is None) == (offsets is None):
        raise ValueError("pass exactly one source layout: lengths (padded values) or offsets (jagged values)")
    pad_to_multiple = check_int(pad_to_multiple, "pad_to_multiple", 1)
    capacity = check_optional_int(capacity, "capacity", 1, what="None or a positive int")
    if bin_offsets.numel() == 0:
        raise ValueError("bin_offsets must have num_bins + 1 >= 1 entries, got an empty tensor")
    order = sequence_order.to(torch.int64)
    count = order.numel()
    if lengths is not None:
        check_tensor(lengths, "lengths", ndim=1, integer=True)
        check_same_device(sequence_order=sequence_order, bin_offsets=bin_offsets, lengths=lengths)
        padded_len = check_int(padded_len, "padded_len", 0, what="an int >= 0 (S of the padded values)")
        if lengths.numel() != count:
            raise ValueError(f"lengths has {lengths.numel()} entries but sequence_order has {count}")
        check_nonnegative(lengths, "lengths")
        source_lengths = lengths.to(torch.int64)
        if count and int(source_lengths.max()) > padded_len:
            where = int(source_lengths.argmax())
            raise ValueError(f"lengths[{where}] = {int(source_lengths[where])} exceeds padded_len={padded_len}")
        source_starts = torch.arange(count, device=order.device) * padded_len
        num_source_rows = count * padded_len
    else:
        assert offsets is not None
        check_tensor(offsets, "offsets", ndim=1, integer=True)
        check_same_device(sequence_order=sequence_order, bin_offsets=bin_offsets, offsets=offsets)
        if padded_len is not None:
            raise ValueError(f"padded_len only applies to padded values (lengths), got padded_len={padded_len!r}")
        if offsets.numel() != count + 1:
            raise ValueError(f"offsets must have B + 1 = {count + 1} entries, got {offsets.numel()}")
        check_offsets(offsets, "offsets")
        source_offsets = offsets.to(torch.int64)
        source_starts, source_lengths = source_offsets[:-1], source_offsets[1:] - source_offsets[:-1]
        num_source_rows = int(source_offsets[-1])
    _check_permutation(order, count)
    check_offsets(bin_offsets, "bin_offsets", total=count)
    bounds = bin_offsets.to(torch.int64)

    slots = -(-source_lengths[order] // pad_to_multiple) * pad_to_multiple
    cu = torch.zeros(count + 1, dtype=torch.int64, device=order.device)
    torch.cumsum(slots, 0, out=cu[1:])
    total = int(cu[-1])
    if total > _INT32_MAX:
        raise ValueError(f"the packed batch holds {total} tokens, more than int32 cu_seqlens can address")
    bin_ids = segment_owner(bounds[1:] - bounds[:-1], count)
    packed_starts = cu[:-1]
    if capacity is not None:
        loads = cu[bounds[1:]] - cu[bounds[:-1]]
        if loads.numel() and int(loads.max()) > capacity:
            where = int(loads.argmax())
            raise ValueError(f"bin {where} holds {int(loads[where])} tokens, more than capacity={capacity}")
        packed_starts = bin_ids * capacity + cu[:-1] - cu[bounds[:-1]][bin_ids]
    return PackingPlan(
        sequence_order=order,
        bin_offsets=bounds,
        cu_seqlens=cu.to(torch.int32),
        source_starts=source_starts,
        source_lengths=source_lengths,
        packed_starts=packed_starts,
        bin_ids=bin_ids,
        capacity=capacity,
        padded_len=padded_len,
        pad_to_multiple=pad_to_multiple,
        num_source_rows=num_source_rows,
        num_slot_tokens=total,
        max_seqlen=int(slots.max()) if count else 0,
    )
