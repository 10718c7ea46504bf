"""What the sparse all-to-all needs from a ``KeyedJaggedTensor``: the tensors it sends, their splits per destination,
and how to rebuild a KJT from what arrives (torchrec's ``KJT.dist_labels/dist_splits/dist_tensors/dist_init``,
kept here as functions so the data layer stays free of distribution logic), plus the recat permutations.

Wire layout. The input KJT's keys are ordered by destination rank (``key_splits[r]`` keys for rank ``r``), so each
label's tensor is already cut into contiguous per-destination chunks. A rank receives, for every source rank ``s``,
its ``T_me`` keys with ``B_s`` bags each: ``(source, key)`` order. :func:`dist_init` permutes the ``(source, key)``
segments to ``(key, source)`` order, which makes each key's bags from all sources contiguous (key-major KJT).
"""

from __future__ import annotations

import itertools

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.kernels import lengths_to_offsets, permute_1d_sparse_data, permute_2d_sparse_data


def dist_labels(kjt: KeyedJaggedTensor) -> list[str]:
    """Names of the tensors the all-to-all sends, in order (the KJT's own ``dist_labels``)."""
    return kjt.dist_labels()


def dist_splits(kjt: KeyedJaggedTensor, key_splits: list[int]) -> list[list[int]]:
    """Per label, the number of entries going to each rank (``key_splits[r]`` consecutive keys go to rank ``r``)."""
    return kjt.dist_splits(key_splits)


def dist_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    """The tensors of :func:`dist_labels` (values and weights without any slack tail past the last bag)."""
    return kjt.dist_tensors()


def _rank_order(num_workers: int, stagger: int) -> list[int]:
    """Source ranks in output order: ``0, 1, ..., W-1`` for ``stagger == 1``; with ``stagger`` (TWRW), rank ``x +
    (W / stagger) * y`` for ``x`` outer, ``y`` inner, e.g. ``W=4, stagger=2 -> [0, 2, 1, 3]``."""
    group = num_workers // stagger
    return [x + group * y for x in range(group) for y in range(stagger)]


def get_recat(
    local_split: int,
    num_splits: int,
    stagger: int = 1,
    device: torch.device | None = None,
    batch_size_per_rank: list[int] | None = None,
) -> torch.Tensor | None:
    """torchrec's ``_get_recat``: the permutation from ``(source rank, key)`` to ``(key, source rank)`` order.

    Entry ``i`` of the result is the input segment placed at output position ``i``, for ``local_split`` keys from
    ``num_splits`` ranks (``None`` when ``local_split`` is 0). With ``batch_size_per_rank`` of unequal sizes, the
    permutation is expanded to single bags (``B_r`` per segment), as variable-batch sequence sharding needs.

    Example: ``get_recat(2, 4) -> [0, 2, 4, 6, 1, 3, 5, 7]``,
    ``get_recat(2, 4, stagger=2) -> [0, 4, 2, 6, 1, 5, 3, 7]``.
    """
    if local_split == 0:
        return None
    recat = [t + r * local_split for t in range(local_split) for r in _rank_order(num_splits, stagger)]
    if batch_size_per_rank is None or len(set(batch_size_per_rank)) <= 1:
        return torch.tensor(recat, dtype=torch.int32, device=device)
    bags_per_segment = [b for b in batch_size_per_rank for _ in range(local_split)]
    input_offsets = torch.tensor([0, *itertools.accumulate(bags_per_segment)], dtype=torch.int64, device=device)
    permuted = [bags_per_segment[i] for i in recat]
    output_offsets = torch.tensor([0, *itertools.accumulate(permuted)], dtype=torch.int64, device=device)
    recat_tensor = torch.tensor(recat, dtype=torch.int64, device=device)
    return expand_into_jagged_permute(recat_tensor, input_offsets, output_offsets, int(output_offsets[-1])).int()


def expand_into_jagged_permute(
    permute: torch.Tensor, input_offsets: torch.Tensor, output_offsets: torch.Tensor, output_size: int
) -> torch.Tensor:
    """FBGEMM's op: a segment permutation expanded to element level. Output segment ``k`` (``output_offsets[k]`` to
    ``output_offsets[k + 1]``) lists the positions of input segment ``permute[k]``."""
    lengths = output_offsets[1:] - output_offsets[:-1]
    shift = input_offsets[permute.long()] - output_offsets[:-1]
    return torch.arange(output_size, device=permute.device) + shift.repeat_interleave(lengths, output_size=output_size)


def invert_permute(permute: torch.Tensor) -> torch.Tensor:
    """``inverse[permute[i]] = i``."""
    inverse = torch.empty_like(permute)
    inverse[permute.long()] = torch.arange(permute.numel(), dtype=permute.dtype, device=permute.device)
    return inverse


def _segment_totals(lengths: torch.Tensor, bags_per_segment: list[int]) -> torch.Tensor:
    """Sum of ``lengths`` over consecutive segments of ``bags_per_segment`` bags (int64)."""
    offsets = lengths_to_offsets(lengths).to(torch.int64)
    bounds = torch.tensor([0, *itertools.accumulate(bags_per_segment)], dtype=torch.int64, device=lengths.device)
    at = offsets.index_select(0, bounds)
    return at[1:] - at[:-1]


def dist_init(
    keys: list[str],
    tensors: list[torch.Tensor],
    variable_stride_per_key: bool,
    num_workers: int,
    stride_per_rank: list[int] | None,
    stagger: int = 1,
) -> KeyedJaggedTensor:
    """Rebuild the key-major KJT of this rank's ``keys`` from the received ``tensors`` (:func:`dist_labels` order).

    ``stride_per_rank``: each source rank's batch size (fixed-stride inputs); the output then has
    ``sum(stride_per_rank)`` bags per key. Variable-stride (VBE) inputs carry a ``strides`` tensor instead and give a
    VBE KJT whose ``stride_per_key_per_rank[t][s]`` is key ``t``'s batch size on source rank ``s``.
    """
    lengths, values = tensors[0], tensors[1]
    weights = (
        tensors[3 if variable_stride_per_key else 2] if len(tensors) == (4 if variable_stride_per_key else 3) else None
    )
    num_keys = len(keys)
    if variable_stride_per_key:
        strides = tensors[2].view(num_workers, num_keys)  # [source, key]
        bags_per_segment = strides.reshape(-1).tolist()
    else:
        assert stride_per_rank is not None, "fixed-stride inputs need stride_per_rank"
        bags_per_segment = [b for b in stride_per_rank for _ in range(num_keys)]
    order = _rank_order(num_workers, stagger)
    if not variable_stride_per_key and num_keys and len(set(stride_per_rank)) == 1:
        return _equal_batch_init(keys, lengths, values, weights, num_workers, stride_per_rank[0], order)
    recat = torch.tensor(
        [s * num_keys + t for t in range(num_keys) for s in order], dtype=torch.int64, device=lengths.device
    )
    segment_bags = torch.tensor(bags_per_segment, dtype=torch.int64, device=lengths.device)
    _, lengths, _ = permute_1d_sparse_data(recat, segment_bags, lengths)
    _, values, weights = permute_1d_sparse_data(recat, _segment_totals(tensors[0], bags_per_segment), values, weights)
    if variable_stride_per_key:
        stride_per_key_per_rank = strides.T[:, order].tolist()
        return KeyedJaggedTensor(
            keys, values, weights, lengths=lengths, stride_per_key_per_rank=stride_per_key_per_rank
        ).sync()
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=sum(stride_per_rank)).sync()


def _equal_batch_init(
    keys: list[str],
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    num_workers: int,
    batch: int,
    order: list[int],
) -> KeyedJaggedTensor:
    """:func:`dist_init` when every source rank sent ``batch`` bags per key: the received ``[source, key]`` segments
    are the rows of one ``[W * K, batch]`` lengths matrix, so one 2-D permute moves lengths, values and weights
    together, and the per-key totals come from one row sum. The parts are consistent by construction (our own
    all-to-all of checked KJTs, splits taken from those lengths), so the KJT is built without re-validating them."""
    num_keys = len(keys)
    lengths_2d = lengths.view(num_workers * num_keys, batch)
    segment_totals = lengths_2d.sum(dim=1, dtype=torch.int64).tolist()  # [source * K + key]
    recat = [s * num_keys + t for t in range(num_keys) for s in order]
    out_lengths, out_values, out_weights = permute_2d_sparse_data(
        torch.tensor(recat, dtype=torch.int32, device=lengths.device), lengths_2d, values, weights, sum(segment_totals)
    )
    length_per_key = [sum(segment_totals[s * num_keys + t] for s in range(num_workers)) for t in range(num_keys)]
    return KeyedJaggedTensor._trusted(
        keys, out_values, out_weights, out_lengths.reshape(-1), num_workers * batch, length_per_key=length_per_key
    )


__all__ = [
    "dist_init",
    "dist_labels",
    "dist_splits",
    "dist_tensors",
    "expand_into_jagged_permute",
    "get_recat",
    "invert_permute",
]
