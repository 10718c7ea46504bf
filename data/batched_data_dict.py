"""``BatchedDataDict``: NeMo-RL's batch container (same names and semantics) for sharding rollouts across
data-parallel ranks and cutting them into microbatches, with dynamic batching and sequence packing.

Values are tensors (batch on dim 0; sequences on dim 1 where there is one) or Python lists, one entry per sample.
Unlike NeMo-RL, bad input raises ``ValueError`` (or ``TypeError`` for types) naming the argument and the offending
value, where NeMo-RL asserts. Microbatches from a sequence-packed shard also carry their packed tokens
(:attr:`BatchedDataDict.packed_sequences`, built by :func:`tritonrec.kernels.pack_sequences.pack_sequences`).
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from tritonrec.data.batch_gather import all_gather_data
from tritonrec.data.batch_sharding import (
    check_args,
    check_lengths_fit,
    dynamic_batching_order,
    dynamic_microbatches,
    sequence_packing_plan,
    shard_rows,
)
from tritonrec.data.batched_data_args import DynamicBatchingArgs, SequencePackingArgs
from tritonrec.data.batched_data_values import Indices, row_count, stack_values, take_rows
from tritonrec.data.packing.checks import integers_as_int64
from tritonrec.kernels.backend import Backend
from tritonrec.kernels.checks import check_int, check_optional_int, host_ints
from tritonrec.kernels.pack_sequences import PackedSequences, make_packing_plan, pack_sequences

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict, Generic[DictT]):
    """A dict of per-sample values sharing one batch size (see the module docstring): a value whose leading size
    differs from the other keys' is refused when it is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None  # per batch: [start, end] per microbatch
        self.micro_batch_lengths: list[list[int]] | None = None  # per batch: padded tokens per microbatch
        self.elem_counts_per_gb: list[int] | None = None  # per batch: rows (sequence packing)
        self.sequence_packing_args: SequencePackingArgs | None = None
        self._pack_options: tuple[float, Backend] | None = None  # set on microbatches of packed shards
        self._packed_sequences: PackedSequences | None = None

    def __setitem__(self, key: str, value: Any) -> None:
        rows = row_count(value, key)
        for other, existing in self.data.items():
            if other != key:
                if row_count(existing, other) != rows:
                    raise ValueError(
                        f"key {key!r} has {rows} rows but key {other!r} has {row_count(existing, other)}: every value "
                        "of a BatchedDataDict holds one entry per sample"
                    )
                break  # the stored keys already agree with each other
        self.data[key] = value

    @classmethod
    def from_batches(
        cls, batches: Sequence[Mapping[str, Any]], pad_value_dict: dict[str, float] | None = None
    ) -> BatchedDataDict:
        """Concatenate batches key by key; tensors of rank >= 2 are padded along dim 1 to the longest, with
        ``pad_value_dict[key]`` (default 0). A key may be absent only from empty batches."""
        stacked = cls()
        pad_value_dict = pad_value_dict or {}
        if not batches:
            return stacked

        def rows(batch: Mapping[str, Any]) -> int:
            return row_count(next(iter(batch.values())), "first key") if batch else 0

        for key in sorted({key for batch in batches for key in batch}):
            missing = [i for i, batch in enumerate(batches) if key not in batch and rows(batch)]
            if missing:
                raise KeyError(f"Key {key!r} is missing from non-empty batches {missing}.")
            stacked[key] = stack_values(
                [batch[key] for batch in batches if key in batch], key, pad_value_dict.get(key, 0)
            )
        return stacked

    def _uniform_size(self) -> int:
        sizes = {key: row_count(value, key) for key, value in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch sizes are not the same across the rollout batch, found sizes per key: {sizes}")
        return next(iter(sizes.values()), 0)

    def _select_rows(self, rows: Indices) -> dict[str, Any]:
        return {key: take_rows(value, rows) for key, value in self.data.items()}

    def _lengths(self, key: str, args_name: str) -> np.ndarray:
        if key not in self.data:
            raise ValueError(f"{args_name} names input_lengths_key={key!r}, which is not a key of the batch")
        value = self.data[key]
        lengths = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"{args_name}: batch[{key!r}] must hold one integer length per sample, "
                f"got dtype {lengths.dtype} and shape {lengths.shape}"
            )
        lengths = integers_as_int64(lengths, f"{args_name}: batch[{key!r}]")
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError(f"{args_name}: batch[{key!r}] holds a negative length {int(lengths.min())}")
        return lengths

    def all_gather(self, group: dist.ProcessGroup | None = None) -> BatchedDataDict:
        """Every rank's rows concatenated in rank order (ranks may hold different numbers of rows)."""
        return type(self)(all_gather_data(self.data, group))

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """The ``rank``-th of ``chunks`` equal contiguous parts (``size`` must divide evenly); tensors are copied."""
        total = self._uniform_size()
        chunks = check_int(chunks, "chunks", 1)
        if total % chunks:
            raise ValueError(f"batch size ({total}) is not a multiple of chunks ({chunks!r})")
        rank = check_int(rank, "rank", 0, chunks - 1, what=f"in [0, chunks={chunks})")
        return SlicedDataDict(self._select_rows(torch.arange(total).tensor_split(chunks)[rank]))

    def reorder_data(self, reorded_indices: Indices) -> None:
        """Undo a shuffle in place: row ``j`` now came from original row ``reorded_indices[j]`` (the indices that
        ``shard_by_batch_size`` returns), so afterwards the rows are back in original order."""
        total = self._uniform_size()
        indices = torch.as_tensor(reorded_indices, dtype=torch.int64).reshape(-1)
        if indices.numel() != total or not torch.equal(torch.sort(indices).values, torch.arange(total)):
            raise ValueError(f"reorded_indices must be a permutation of range({total}), got {indices.tolist()[:16]}...")
        self.data = self._select_rows(torch.argsort(indices))

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[SlicedDataDict] | tuple[list[SlicedDataDict], list[int]]:
        """Cut the batch into ``batch_size`` chunks and give shard ``s`` its part of every chunk (see
        :mod:`tritonrec.data.batch_sharding`). With dynamic batching or sequence packing, also returns the
        original row of every sharded row (shard after shard), which ``reorder_data`` inverts."""
        shards = check_int(shards, "shards", 1)
        if allow_uneven_shards and batch_size is not None:
            raise ValueError(f"batch_size must be None if allow_uneven_shards is True, got batch_size={batch_size!r}")
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError("dynamic_batching_args and sequence_packing_args cannot be passed together")
        total = self._uniform_size()
        # None: the whole batch; an empty one has no chunks, so any multiple of shards will do
        what = "a positive int (or None for the whole batch)"
        batch_size = check_optional_int(batch_size, "batch_size", 1, what=what) or total or shards
        if total % batch_size:
            raise ValueError(f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
        if not allow_uneven_shards and batch_size % shards:
            raise ValueError(f"Batch size ({batch_size}) is not a multiple of shards ({shards})")

        if dynamic_batching_args is not None:
            args = dynamic_batching_args
            check_args(
                args,
                "dynamic_batching_args",
                ("max_tokens_per_microbatch", "sequence_length_round"),
                ("input_key", "input_lengths_key"),
            )
            if allow_uneven_shards:
                raise ValueError("dynamic batching deals rows round-robin and needs allow_uneven_shards=False")
            lengths = self._lengths(args["input_lengths_key"], "dynamic_batching_args")
            inputs = self.data.get(args["input_key"])
            if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
                raise ValueError(
                    f"dynamic_batching_args['input_key']={args['input_key']!r} must name a [B, S, *] tensor"
                )
            check_lengths_fit(lengths, inputs, args, "dynamic_batching_args")
            order = dynamic_batching_order(lengths, batch_size, shards)
            indices, microbatch_lengths = dynamic_microbatches(
                lengths[order],
                batch_size,
                shards,
                args["max_tokens_per_microbatch"],
                args["sequence_length_round"],
                inputs.shape[1],
            )
            sharded, sharded_order = [], []
            for rows in shard_rows(total, batch_size, shards, False):
                sharded_order += order[rows].tolist()
                shard = SlicedDataDict(self._select_rows(order[rows]))
                shard.micro_batch_indices, shard.micro_batch_lengths = (
                    copy.deepcopy(indices),
                    copy.deepcopy(microbatch_lengths),
                )
                sharded.append(shard)
            # Shard-major, like the packing branch, so from_batches(shards).reorder_data(indices) restores the batch
            # with any number of chunks (NeMo-RL returns the chunk-major order; the two agree for a single chunk).
            return sharded, sharded_order

        if sequence_packing_args is not None:
            args = sequence_packing_args
            check_args(
                args,
                "sequence_packing_args",
                ("max_tokens_per_microbatch", "sequence_length_pad_multiple"),
                ("input_key", "input_lengths_key"),
                other=("algorithm",),
            )
            lengths = self._lengths(args["input_lengths_key"], "sequence_packing_args")
            inputs = self.data.get(args["input_key"])
            if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:  # else _pack names input_key when it is read
                check_lengths_fit(lengths, inputs, args, "sequence_packing_args")
            plans = sequence_packing_plan(lengths, batch_size, shards, args)
            sharded = []
            for plan in plans:
                shard = SlicedDataDict(self._select_rows(plan.rows))
                shard.micro_batch_indices, shard.micro_batch_lengths = (
                    plan.micro_batch_indices,
                    plan.micro_batch_lengths,
                )
                shard.elem_counts_per_gb, shard.sequence_packing_args = plan.elem_counts_per_gb, dict(args)  # type: ignore[assignment]
                sharded.append(shard)
            return sharded, [row for plan in plans for row in plan.rows]

        return [
            SlicedDataDict(self._select_rows(rows))
            for rows in shard_rows(total, batch_size, shards, allow_uneven_shards)
        ]

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """The ``batch_idx``-th global batch of a shard (its rows and its microbatch metadata)."""
        if self.elem_counts_per_gb is not None:
            counts = self.elem_counts_per_gb
            if not 0 <= batch_idx < len(counts):
                raise ValueError(f"batch_idx must be in [0, {len(counts)}), got batch_idx={batch_idx!r}")
            start = sum(counts[:batch_idx])
            batch = self.slice(start, start + counts[batch_idx])
            batch.elem_counts_per_gb = [counts[batch_idx]]
            batch.sequence_packing_args = self.sequence_packing_args
        else:
            batch_size = check_int(batch_size, "batch_size", 1, what="a positive int for this dict")
            batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None and self.micro_batch_lengths is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Rows ``start:end``."""
        total = self._uniform_size()
        start, end = check_int(start, "start"), check_int(end, "end")
        if not 0 <= start <= end <= total:
            raise ValueError(f"need 0 <= start <= end <= size ({total}), got start={start!r}, end={end!r}")
        return SlicedDataDict({key: value[start:end] for key, value in self.data.items()})

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict:
        """Every row ``num_repeats`` times in a row (list items are deep-copied)."""
        num_repeats = check_int(num_repeats, "num_repeats", 0, what="an int >= 0")
        repeated = type(self)()
        for key, value in self.data.items():
            if isinstance(value, torch.Tensor):
                repeated[key] = value.repeat_interleave(num_repeats, dim=0)
            else:
                repeated[key] = [copy.deepcopy(item) for item in value for _ in range(num_repeats)]
        return repeated

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Keep the first ``truncated_len`` entries along ``dim`` of every tensor that has that dim, in place."""
        for key, value in self.data.items():
            if isinstance(value, torch.Tensor) and value.dim() > dim:
                if truncated_len > value.shape[dim]:
                    raise ValueError(
                        f"truncated_len={truncated_len} exceeds dim {dim} of {key!r} ({tuple(value.shape)})"
                    )
                self.data[key] = value.narrow(dim, 0, truncated_len)

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        """Consecutive slices of ``microbatch_size`` rows (which must divide ``size``)."""
        total = self.size
        microbatch_size = check_int(microbatch_size, "microbatch_size", 1)
        if total % microbatch_size:
            raise ValueError(f"Data dict size ({total}) is not a multiple of microbatch_size={microbatch_size!r}")
        for start in range(0, total, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def _single_batch_microbatches(self, what: str) -> tuple[list[list[int]], list[int]]:
        if self.micro_batch_indices is None or self.micro_batch_lengths is None or len(self.micro_batch_indices) != 1:
            raise ValueError(
                f"{what} needs microbatch metadata for exactly one batch: shard with dynamic_batching_args or "
                "sequence_packing_args, then take get_batch(i)"
            )
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator[SlicedDataDict]:
        """Dynamic-batching microbatches, each truncated along ``sequence_dim`` to its padded length."""
        indices, lengths = self._single_batch_microbatches("make_microbatch_iterator_with_dynamic_shapes")
        for (start, end), length in zip(indices, lengths, strict=True):
            microbatch = self.slice(start, end)
            microbatch.truncate_tensors(dim=sequence_dim, truncated_len=length)
            yield microbatch

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(self._single_batch_microbatches("get_microbatch_iterator_dynamic_shapes_len")[0])

    def make_microbatch_iterator_for_packable_sequences(
        self, padding_value: float = 0, backend: Backend = "auto"
    ) -> Iterator[SlicedDataDict]:
        """Sequence-packing microbatches (one bin each). On shards made with ``sequence_packing_args``, each one's
        :attr:`packed_sequences` holds its ``input_key`` tensor packed into one flat buffer (built on first access)."""
        indices, _ = self._single_batch_microbatches("make_microbatch_iterator_for_packable_sequences")
        for start, end in indices:
            microbatch = self.slice(start, end)
            if self.sequence_packing_args is not None:
                microbatch.sequence_packing_args = self.sequence_packing_args
                microbatch._pack_options = (padding_value, backend)
            yield microbatch

    @property
    def packed_sequences(self) -> PackedSequences | None:
        """For a microbatch of a packed shard: ``pack_sequences`` of its ``input_key`` tensor, every sequence padded
        to ``sequence_length_pad_multiple``, in one flat buffer with ``cu_seqlens``, position and segment ids
        (scatter model outputs back with ``unpack_sequences(outputs, mb.packed_sequences.plan)``). Built on first
        access, then cached; None for other dicts."""
        if self._packed_sequences is None and self._pack_options is not None:
            self._packed_sequences = self._pack(*self._pack_options)
        return self._packed_sequences

    def _pack(self, padding_value: float, backend: Backend) -> PackedSequences:
        args = self.sequence_packing_args
        assert args is not None
        inputs = self.data[args["input_key"]]
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
            raise ValueError(f"sequence_packing_args['input_key']={args['input_key']!r} must name a [B, S, *] tensor")
        # The plan's [B]-sized index math runs on the host (no device syncs), then moves with one copy.
        lengths = torch.as_tensor(self.data[args["input_lengths_key"]], dtype=torch.int64).cpu()
        count = inputs.shape[0]
        plan = make_packing_plan(
            torch.arange(count),
            torch.tensor([0, count]),
            lengths=lengths,
            padded_len=inputs.shape[1],
            pad_to_multiple=int(args["sequence_length_pad_multiple"]),
        )
        return pack_sequences(inputs, plan.to(inputs.device), padding_value=padding_value, backend=backend)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """(number of packed microbatches, largest packed length)."""
        indices, lengths = self._single_batch_microbatches("get_microbatch_iterator_for_packable_sequences_len")
        return len(indices), max(lengths)

    @property
    def size(self) -> int:
        """Rows of the first value (0 when empty)."""
        return row_count(next(iter(self.data.values())), next(iter(self.data))) if self.data else 0

    def to(self, device: str | torch.device) -> BatchedDataDict:
        """Move every tensor to ``device`` in place; returns self."""
        for key, value in self.data.items():
            if isinstance(value, torch.Tensor):
                self.data[key] = value.to(device)
        return self

    def select_indices(self, indices: Indices) -> BatchedDataDict:
        """The rows at ``indices`` (any order, repeats allowed; negative ones count from the end, as in NeMo-RL)."""
        total = self._uniform_size()
        rows = torch.as_tensor(indices)
        if rows.dim() != 1 or (rows.numel() and (rows.is_floating_point() or rows.dtype == torch.bool)):
            raise ValueError(f"indices must be a 1-D sequence of ints, got {indices!r:.200}")
        low, high = host_ints(*torch.aminmax(rows)) if rows.numel() else (0, -1)  # one host read
        if rows.numel() and not -total <= low <= high < total:
            bad = rows[(rows < -total) | (rows >= total)][0].item()
            raise ValueError(f"indices holds {bad}, outside [-{total}, {total}) (the batch has {total} rows)")
        return type(self)(self._select_rows(indices))

    ADDITIONAL_OPTIONAL_KEY_TENSORS = ("token_type_ids", "mm_token_type_ids")  # NeMo-RL's model-specific extras

    def get_multimodal_dict(
        self, as_tensors: bool = False, device: torch.device | None = None, pixel_dtype: torch.dtype | None = None
    ) -> dict[str, Any]:
        """NeMo-RL's multimodal model inputs: tritonrec has no ``PackedTensor`` media values, so these are the
        :attr:`ADDITIONAL_OPTIONAL_KEY_TENSORS` present, as stored (NeMo-RL moves and casts only ``PackedTensor``
        values); ``{}`` for a text-only batch."""
        return {key: value for key, value in self.data.items() if key in self.ADDITIONAL_OPTIONAL_KEY_TENSORS}

    def get_dict(self) -> dict[Any, Any]:
        """The underlying dict."""
        return self.data


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a larger batch (a distinct type for readers and type checkers)."""
