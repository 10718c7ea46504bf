"""torchrec's KJT all-to-all protocol as ``KeyedJaggedTensor`` methods: ``dist_labels`` / ``dist_splits`` /
``dist_tensors`` say what a KJT sends, ``dist_init`` rebuilds the KJT a rank receives.

Wire layout (torchrec's). The sender's keys are ordered by destination (``key_splits[r]`` consecutive keys go to rank
``r``), so every tensor is cut into contiguous per-destination chunks::

    labels  lengths [sum B_t]   values [N]   strides [T] (VBE only)   weights [N] (weighted only)
    splits  bags per rank       values/rank  key_splits               values per rank

A receiver concatenates what the ``W`` sources sent, so its tensors are in ``(source, key)`` order, and ``dist_init``
permutes them with ``recat`` (torchrec's ``_get_recat``) into the key-major ``(key, source)`` order of a KJT:

* fixed stride, equal batch per source: ``recat [T * W]`` picks rows of ``lengths.view(W * T, B)``;
* fixed stride, batch differing per source: ``recat`` indexes single bags (its expanded form);
* variable stride per key (VBE): ``strides`` arrive as ``[W * T]`` (source-major), ``recat [T * W]`` picks
  ``(source, key)`` segments; ``stride_per_key_per_rank`` is ``strides.view(W, T).T`` with, for ``stagger > 1``
  (TWRW), its columns in torchrec's staggered source order.

This file is the data layer's copy of the protocol, with torchrec's signature (``recat`` given by the caller);
:mod:`tritonrec.dist.kjt_dist` is the variant our own all-to-all calls.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from tritonrec.kernels import lengths_to_offsets, permute_1d_sparse_data, permute_2d_sparse_data
from tritonrec.kernels.checks import check_int, check_tensor

if TYPE_CHECKING:
    from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


def dist_labels(kjt: KeyedJaggedTensor) -> list[str]:
    """Names of the tensors :func:`dist_tensors` returns, in order: ``lengths, values[, strides][, weights]``."""
    labels = ["lengths", "values"]
    if kjt.variable_stride_per_key():
        labels.append("strides")
    if kjt.weights_or_none() is not None:
        labels.append("weights")
    return labels


def _sum_by_splits(numbers: list[int], splits: list[int]) -> list[int]:
    bounds = list(accumulate(splits, initial=0))
    return [sum(numbers[bounds[i] : bounds[i + 1]]) for i in range(len(splits))]


def dist_splits(kjt: KeyedJaggedTensor, key_splits: list[int]) -> list[list[int]]:
    """Per label of :func:`dist_labels`, how many entries go to each destination; ``key_splits[r]`` consecutive keys
    go to rank ``r`` (``[W]`` non-negative ints summing to the number of keys)."""
    num_keys = len(kjt.keys())
    if not isinstance(key_splits, (list, tuple)):
        raise TypeError(f"key_splits must be a list of non-negative ints, got {type(key_splits).__name__}")
    key_splits = [check_int(n, f"key_splits[{i}]", 0) for i, n in enumerate(key_splits)]
    if sum(key_splits) != num_keys:
        raise ValueError(f"key_splits must sum to the number of keys ({num_keys}), got {key_splits}")
    bags_per_split = _sum_by_splits(kjt.stride_per_key(), key_splits)
    values_per_split = _sum_by_splits(kjt.length_per_key(), key_splits)
    splits = [bags_per_split, values_per_split]
    if kjt.variable_stride_per_key():
        splits.append(key_splits)  # one stride entry per key
    if kjt.weights_or_none() is not None:
        splits.append(values_per_split)
    return splits


def dist_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    """The tensors of :func:`dist_labels`: ``lengths [sum B_t]``, ``values [N]``, for VBE ``strides [T]`` (int64, the
    batch size of each key), and ``weights [N]``. Values and weights stop at the last bag: a slack tail past it
    would not match :func:`dist_splits` (torchrec sends it and fails in the all-to-all). Each is contiguous (the
    all-to-all refuses strided views, e.g. the lengths of a one-sample column slice of a ``[F, B]`` tensor)."""
    used = kjt.offset_per_key()[-1] if kjt.keys() else 0
    values = kjt.values()
    tensors = [kjt.lengths(), values if values.shape[0] == used else values[:used]]
    if kjt.variable_stride_per_key():
        tensors.append(torch.tensor(kjt.stride_per_key(), dtype=torch.int64, device=kjt.device()))
    weights = kjt.weights_or_none()
    if weights is not None:
        tensors.append(weights if weights.shape[0] == used else weights[:used])
    return [t.contiguous() for t in tensors]


def _check_dist_init_args(
    keys: object,
    tensors: object,
    variable_stride_per_key: object,
    num_workers: object,
    recat: object,
    stride_per_rank: object,
    stagger: object,
) -> tuple[int, list[int] | None, int]:
    """Types and sizes of :func:`dist_init`'s arguments; returns ``(num_workers, stride_per_rank, stagger)``."""
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"keys must be a list of str, got {keys!r:.200}")
    if not isinstance(variable_stride_per_key, bool):
        raise TypeError(f"variable_stride_per_key must be a bool, got {type(variable_stride_per_key).__name__}")
    expected = (3, 4) if variable_stride_per_key else (2, 3)
    if not isinstance(tensors, (list, tuple)) or len(tensors) not in expected:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(
            f"tensors must be a list of {expected[0]} or {expected[1]} tensors (dist_labels order) for "
            f"variable_stride_per_key={variable_stride_per_key}, got {got}"
        )
    for i, t in enumerate(tensors):
        check_tensor(t, f"tensors[{i}]")
    check_tensor(tensors[0], "tensors[0] (lengths)", ndim=1, integer=True)
    if variable_stride_per_key:
        check_tensor(tensors[2], "tensors[2] (strides)", ndim=1, integer=True)
    num_workers = check_int(num_workers, "num_workers", 1)
    stagger = check_int(stagger, "stagger", 1)
    if num_workers % stagger:
        raise ValueError(f"stagger ({stagger}) must divide num_workers ({num_workers})")
    if recat is not None:
        check_tensor(recat, "recat", ndim=1, integer=True)
    if variable_stride_per_key:
        return num_workers, None, stagger
    if not isinstance(stride_per_rank, (list, tuple)) or len(stride_per_rank) != num_workers:
        raise ValueError(
            f"stride_per_rank must list the batch size of each of the {num_workers} workers when "
            f"variable_stride_per_key is False, got {stride_per_rank!r:.200}"
        )
    return num_workers, [check_int(s, f"stride_per_rank[{i}]", 0) for i, s in enumerate(stride_per_rank)], stagger


def dist_init(
    cls: type[KeyedJaggedTensor],
    keys: list[str],
    tensors: list[torch.Tensor],
    variable_stride_per_key: bool,
    num_workers: int,
    recat: torch.Tensor | None,
    stride_per_rank: list[int] | None,
    stagger: int = 1,
) -> KeyedJaggedTensor:
    """The KJT of ``keys`` rebuilt from the received ``tensors`` (:func:`dist_labels` order, ``(source, key)``
    layout), permuted to key-major by ``recat`` when given (see the module docstring). ``stride_per_rank [W]`` is each
    source's batch size (fixed stride; ignored for VBE, whose strides travel in ``tensors[2]``)."""
    num_workers, stride_per_rank, stagger = _check_dist_init_args(
        keys, tensors, variable_stride_per_key, num_workers, recat, stride_per_rank, stagger
    )
    keys = list(keys)
    lengths, values = tensors[0], tensors[1]
    weighted = len(tensors) == (4 if variable_stride_per_key else 3)
    weights = tensors[-1] if weighted else None
    if variable_stride_per_key:
        return _vbe_init(cls, keys, lengths, values, weights, tensors[2], num_workers, recat, stagger)
    stride = sum(stride_per_rank)
    if lengths.numel() != stride * len(keys):
        raise ValueError(
            f"tensors[0] (lengths) has {lengths.numel()} bags but {len(keys)} keys x sum(stride_per_rank) "
            f"{stride_per_rank} = {stride * len(keys)}"
        )
    if recat is not None:
        if all(s == stride_per_rank[0] for s in stride_per_rank):
            if stride_per_rank[0] > 0:  # rows of [W * T, B] lengths: one (source, key) segment each
                lengths, values, weights = permute_2d_sparse_data(
                    recat, lengths.view(-1, stride_per_rank[0]), values, weights
                )
                lengths = lengths.reshape(-1)
        else:  # batch differs per source: recat indexes single bags
            lengths, values, weights = permute_1d_sparse_data(recat, lengths, values, weights)
    return cls(keys=keys, values=values, weights=weights, lengths=lengths, stride=stride).sync()


def _vbe_init(
    cls: type[KeyedJaggedTensor],
    keys: list[str],
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    strides: torch.Tensor,
    num_workers: int,
    recat: torch.Tensor | None,
    stagger: int,
) -> KeyedJaggedTensor:
    """VBE ``dist_init``: ``strides [W * T]`` is source ``s``'s batch size for key ``t`` at ``s * T + t``."""
    if strides.numel() != num_workers * len(keys):
        raise ValueError(
            f"tensors[2] (strides) must hold num_workers x len(keys) = {num_workers * len(keys)} batch sizes "
            f"(source-major), got {strides.numel()}"
        )
    # one host read of the strides: the KJT keeps them as lists (torchrec: a CPU tensor)
    stride_per_key_per_rank = strides.view(num_workers, len(keys)).T.cpu()
    if recat is not None:
        segment_bags = strides.to(torch.int64)
        if int(segment_bags.sum()) != lengths.numel():
            raise ValueError(
                f"tensors[2] (strides) sums to {int(segment_bags.sum())} bags but tensors[0] (lengths) has "
                f"{lengths.numel()}"
            )
        # values per (source, key) segment: the complete cumsum of lengths read at the segment bounds
        bounds = lengths_to_offsets(segment_bags)
        segment_values = lengths_to_offsets(lengths).to(torch.int64).index_select(0, bounds)
        segment_values = segment_values[1:] - segment_values[:-1]
        _, lengths, _ = permute_1d_sparse_data(recat, segment_bags, lengths)
        _, values, weights = permute_1d_sparse_data(recat, segment_values, values, weights)
    if stride_per_key_per_rank.numel() == 0:  # no keys: torchrec keeps one (empty) rank column
        stride_per_key_per_rank = torch.zeros((len(keys), 1), dtype=torch.int64)
    if stagger > 1:  # columns in recat's staggered source order (TWRW), e.g. W=4, stagger=2: sources [0, 2, 1, 3]
        order = torch.arange(num_workers).view(stagger, -1).T.reshape(-1)
        stride_per_key_per_rank = stride_per_key_per_rank[:, order]
    return cls(
        keys=keys, values=values, weights=weights, lengths=lengths, stride_per_key_per_rank=stride_per_key_per_rank
    ).sync()
