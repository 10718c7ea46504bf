"""The torch twins of :mod:`tritonrec.kernels.pack_sequences`: the specification the Triton kernels must equal bit
for bit, and the CPU implementation of the ``pack_sequences`` / ``unpack_sequences`` operators.

Also here: the packed and source shapes a plan gives (``feature_shape``, ``packed_shape``, ``source_shape``), which the
twins, the Triton launchers and the operators' fake implementations share. Kept apart from the kernels so the op module
reads kernel, launcher, operator, public function; the twins are re-exported there.

Both twins are vectorised: a few ``index_select`` / ``index_copy_`` calls over per-token indices built once per call
by :class:`_Runs`, no loop over sequences.
"""

from __future__ import annotations

import torch

from tritonrec.kernels.packing_plan import PackingPlan


def feature_shape(plan: PackingPlan, values: torch.Tensor) -> tuple[int, ...]:
    """The per-token dims ``*`` of ``values`` in the plan's source layout (``[B, S, *]`` or ``[N, *]``)."""
    return tuple(values.shape[2:] if plan.padded_len is not None else values.shape[1:])


def packed_shape(plan: PackingPlan, feature: tuple[int, ...]) -> tuple[int, ...]:
    """``[num_bins, capacity, *feature]`` when the plan has a capacity, else ``[T, *feature]``."""
    return (plan.num_bins, plan.capacity, *feature) if plan.capacity is not None else (plan.num_packed_rows, *feature)


def source_shape(plan: PackingPlan, feature: tuple[int, ...]) -> tuple[int, ...]:
    """``[B, S, *feature]`` for a padded source, else ``[offsets[-1], *feature]``."""
    if plan.padded_len is not None:
        return (plan.num_sequences, plan.padded_len, *feature)
    return (plan.num_source_rows, *feature)


class _Runs:
    """Runs of ``counts [R]`` elements laid end to end (``total`` elements): per-element owner run and position in
    it, computed once and shared by every per-token index of one call. Per-run values are spread with
    ``index_select`` (several times faster on CPU than fancy indexing ``x[owner]``)."""

    def __init__(self, counts: torch.Tensor, total: int) -> None:
        self.owner = torch.repeat_interleave(
            torch.arange(counts.numel(), device=counts.device), counts, output_size=total
        )
        first = torch.cumsum(counts, 0).sub_(counts)  # exclusive cumsum: where each run starts in the stream
        self.position = torch.arange(total, device=counts.device).sub_(first.index_select(0, self.owner))

    def spread(self, per_run: torch.Tensor) -> torch.Tensor:
        """``[R]`` -> ``[total]``: each element gets its run's value."""
        return per_run.index_select(0, self.owner)

    def index(self, run_starts: torch.Tensor) -> torch.Tensor:
        """``[total]``: ``run_starts[r] + j`` for the ``j``-th element of run ``r``."""
        return self.spread(run_starts).add_(self.position)


def _total(counts: torch.Tensor) -> int:
    return int(counts.sum().item()) if counts.numel() else 0


def pack_sequences_reference(
    values: torch.Tensor, plan: PackingPlan, padding_value: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification: ``(tokens, position_ids, segment_ids)`` in the plan's packed layout (see
    :mod:`tritonrec.kernels.pack_sequences`)."""
    feature = feature_shape(plan, values)
    source = values.flatten(0, 1) if plan.padded_len is not None else values
    order, device = plan.sequence_order, values.device
    counts = plan.source_lengths.index_select(0, order)  # real tokens per packed position
    tokens_of = _Runs(counts, _total(counts))
    real = source.index_select(0, tokens_of.index(plan.source_starts.index_select(0, order)))
    if plan.pad_to_multiple == 1:  # slots are exactly the real tokens
        slots_of = tokens_of
    else:
        slots_of = _Runs((plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).long(), plan.num_slot_tokens)
    segment_of_sequence = (torch.arange(plan.num_sequences, device=device) - plan.bin_offsets[plan.bin_ids]).int()
    slot_segments = slots_of.spread(segment_of_sequence)
    if plan.capacity is None and plan.pad_to_multiple == 1:  # slots are the real tokens, already in packed order
        tokens, positions, segments = real, slots_of.position, slot_segments
    else:
        rows = plan.num_packed_rows
        tokens = values.new_full((rows, *feature), padding_value)
        tokens.index_copy_(0, tokens_of.index(plan.packed_starts), real)
        slot_rows = slots_of.index(plan.packed_starts)
        positions = torch.zeros(rows, dtype=torch.int64, device=device).index_copy_(0, slot_rows, slots_of.position)
        segments = torch.full((rows,), -1, dtype=torch.int32, device=device).index_copy_(0, slot_rows, slot_segments)
    shape = packed_shape(plan, feature)
    id_shape = shape[: len(shape) - len(feature)]
    return tokens.reshape(shape), positions.reshape(id_shape), segments.reshape(id_shape)


def unpack_sequences_reference(packed: torch.Tensor, plan: PackingPlan, padding_value: float = 0.0) -> torch.Tensor:
    """The specification: packed per-token values back to the source layout, ``padding_value`` past each length."""
    feature = tuple(packed.shape[2:] if plan.capacity is not None else packed.shape[1:])
    flat = packed.flatten(0, 1) if plan.capacity is not None else packed
    order = plan.sequence_order
    counts = plan.source_lengths.index_select(0, order)
    tokens_of = _Runs(counts, _total(counts))
    out = packed.new_full((plan.num_source_rows, *feature), padding_value)
    real = flat.index_select(0, tokens_of.index(plan.packed_starts))
    out.index_copy_(0, tokens_of.index(plan.source_starts.index_select(0, order)), real)
    return out.reshape(source_shape(plan, feature))
