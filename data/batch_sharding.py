"""Index plans behind ``BatchedDataDict.shard_by_batch_size``: which rows each data-parallel shard gets, in which
order, and where its microbatches start and end. Pure functions of the batch size and the sequence lengths, with
NeMo-RL's semantics:

* plain: the batch is cut into chunks of ``batch_size``; shard ``s`` takes the ``s``-th contiguous slice of every
  chunk.
* dynamic batching: inside every chunk rows are sorted by length and dealt round-robin to the shards; all shards
  share microbatch boundaries, each microbatch padded to the longest sequence at those positions across shards
  (rounded up to ``sequence_length_round``), with ``rows x padded length <= max_tokens_per_microbatch``.
* sequence packing: inside every chunk a packer forms bins of at most ``max_tokens_per_microbatch`` padded tokens,
  at least ``shards`` of them and a multiple of ``shards``; bins are dealt round-robin, one bin per microbatch, so
  every shard runs the same number of microbatches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonrec.data.packing import balance_bins_across_ranks, get_packer
from tritonrec.kernels.checks import check_int


def _round_up(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple


def check_args(
    args: Mapping[str, Any],
    name: str,
    int_keys: tuple[str, ...],
    key_names: tuple[str, ...],
    other: tuple[str, ...] = (),
) -> None:
    """Every required key present; counts positive ints; ``key_names`` (keys of the batch) strings. ``other`` keys
    only need to be present (their consumer checks them)."""
    required = (*int_keys, *key_names, *other)
    for key in required:
        if key not in args:
            raise ValueError(f"{name} is missing the key {key!r} (required: {list(required)})")
    for key in int_keys:
        check_int(args[key], f"{name}[{key!r}]", 1)
    for key in key_names:
        if not isinstance(args[key], str):
            raise ValueError(f"{name}[{key!r}] must be a str (a key of the batch), got {args[key]!r}")


def check_lengths_fit(lengths: np.ndarray, inputs: Any, args: Mapping[str, Any], name: str) -> None:
    """Every length fits the padded width ``S`` of the ``[B, S, *]`` tensor it describes (else the microbatches would
    be padded short of the sequence, or packing would read past it); the error names the global row."""
    width = inputs.shape[1]
    too_long = np.flatnonzero(lengths > width)
    if too_long.size:
        row = int(too_long[0])
        raise ValueError(
            f"{name}: batch[{args['input_lengths_key']!r}][{row}] = {int(lengths[row])} is longer than the padded "
            f"width {width} of batch[{args['input_key']!r}] (its dim 1)"
        )


def shard_rows(total: int, batch_size: int, shards: int, allow_uneven_shards: bool) -> list[np.ndarray]:
    """``[rows of shard s]`` for the plain split: the ``s``-th slice of every ``batch_size`` chunk."""
    shard_size = -(-batch_size // shards) if allow_uneven_shards else batch_size // shards
    chunk_starts = np.arange(0, total, batch_size)
    rows = []
    for shard in range(shards):
        start = np.minimum(chunk_starts + shard * shard_size, total)
        stop = np.minimum(chunk_starts + (shard + 1) * shard_size, total)
        if not allow_uneven_shards:
            stop = np.minimum(stop, chunk_starts + batch_size)
        counts = np.maximum(stop - start, 0)
        rows.append(np.repeat(start - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum())))
    return rows


def dynamic_batching_order(lengths: np.ndarray, batch_size: int, shards: int) -> np.ndarray:
    """``[total]`` original rows in the sharded order: per chunk, sorted by length (stable) and dealt round-robin,
    so shard ``s``'s slice of the chunk holds sorted ranks ``s, s + shards, ...``."""
    num_chunks = lengths.size // batch_size
    ranked = np.argsort(lengths.reshape(num_chunks, batch_size), axis=1, kind="stable")
    dealt = ranked.reshape(num_chunks, batch_size // shards, shards).transpose(0, 2, 1)
    return (dealt.reshape(num_chunks, batch_size) + np.arange(num_chunks)[:, None] * batch_size).reshape(-1)


def dynamic_microbatches(
    sorted_lengths: np.ndarray,
    batch_size: int,
    shards: int,
    max_tokens: int,
    length_round: int,
    padded_len: int,
) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Shared microbatch boundaries ``[[start, end], ...]`` and padded lengths per chunk.

    ``sorted_lengths`` are the lengths in the sharded order. Position ``p`` of a chunk needs the longest sequence
    at ``p`` over all shards, rounded up to ``length_round`` (and at most ``padded_len``, the stored sequence dim);
    a microbatch grows while ``rows x its longest padded length <= max_tokens``.
    """
    num_chunks = sorted_lengths.size // batch_size
    per_position = sorted_lengths.reshape(num_chunks, shards, batch_size // shards).max(axis=1)
    padded = np.minimum(_round_up(per_position, length_round), padded_len)
    if padded.size and int(padded.max()) > max_tokens:
        raise ValueError(
            f"dynamic_batching_args: a sequence padded to {int(padded.max())} tokens "
            f"(sequence_length_round={length_round}) exceeds max_tokens_per_microbatch={max_tokens}"
        )
    indices: list[list[list[int]]] = []
    lengths: list[list[int]] = []
    for chunk in padded.tolist():
        bounds, longest = [[0, 0]], [0]
        for position, length in enumerate(chunk):
            widest = max(longest[-1], length)
            if (bounds[-1][1] - bounds[-1][0] + 1) * widest <= max_tokens:
                bounds[-1][1] += 1
                longest[-1] = widest
            else:
                bounds.append([position, position + 1])
                longest.append(length)
        indices.append(bounds)
        lengths.append(longest)
    return indices, lengths


@dataclass
class ShardPacking:
    """One shard's share of a packed batch."""

    rows: list[int]  # original rows, microbatch after microbatch, chunk after chunk
    micro_batch_indices: list[list[list[int]]]  # per chunk: [start, end] of each microbatch, from 0 in the chunk
    micro_batch_lengths: list[list[int]]  # per chunk: padded tokens of each microbatch
    elem_counts_per_gb: list[int]  # per chunk: rows of this shard


def sequence_packing_plan(
    lengths: np.ndarray, batch_size: int, shards: int, args: Mapping[str, Any]
) -> list[ShardPacking]:
    """Pack each ``batch_size`` chunk with ``args['algorithm']`` and deal the bins round-robin (see module doc).

    ``args['microbatch_order'] == 'largest_first'`` runs each shard's bins by decreasing padded tokens;
    ``args['balance_ranks']`` first reorders the bins so the round-robin deal balances tokens across shards.
    """
    multiple = int(args["sequence_length_pad_multiple"])
    max_tokens = int(args["max_tokens_per_microbatch"])
    padded = _round_up(lengths, multiple)
    if padded.size and int(padded.max()) > max_tokens:
        where = int(padded.argmax())
        raise ValueError(
            f"sequence_packing_args: sequence {where} has {int(lengths[where])} tokens, {int(padded[where])} after "
            f"padding to sequence_length_pad_multiple={multiple}, more than max_tokens_per_microbatch={max_tokens}"
        )
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise ValueError(
            f"sequence_packing_args['microbatch_order'] must be 'packer' or 'largest_first', got {order!r}"
        )
    packer = get_packer(args["algorithm"], max_tokens, min_bin_count=shards, bin_count_multiple=shards)
    plans = [ShardPacking([], [], [], []) for _ in range(shards)]
    for chunk_start in range(0, lengths.size, batch_size):
        chunk = padded[chunk_start : chunk_start + batch_size]
        bins = packer.pack(chunk)
        if args.get("balance_ranks", False):
            bins = balance_bins_across_ranks(bins, chunk, shards)
        for shard, plan in enumerate(plans):
            mine = bins[shard::shards]
            tokens = [int(chunk[b].sum()) for b in mine]
            if order == "largest_first":
                ranking = sorted(range(len(mine)), key=lambda i: -tokens[i])  # stable: ties keep packer order
                mine, tokens = [mine[i] for i in ranking], [tokens[i] for i in ranking]
            ends = np.cumsum([len(b) for b in mine]).tolist()
            plan.micro_batch_indices.append([[s, e] for s, e in zip([0, *ends[:-1]], ends, strict=True)])
            plan.micro_batch_lengths.append(tokens)
            plan.elem_counts_per_gb.append(ends[-1] if ends else 0)
            plan.rows.extend(chunk_start + i for b in mine for i in b)
    return plans
