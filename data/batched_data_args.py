"""The argument types of :meth:`BatchedDataDict.shard_by_batch_size
<tritonrec.data.batched_data_dict.BatchedDataDict.shard_by_batch_size>` (NeMo-RL's names and keys):
:class:`SequencePackingArgs` and :class:`DynamicBatchingArgs`, TypedDicts a caller builds and passes.

Separate from :mod:`tritonrec.data.batched_data_dict` to keep that module small; both names are also importable
from there and from :mod:`tritonrec.data`.
"""

# no ``from __future__ import annotations``: TypedDict reads NotRequired from evaluated annotations, and with
# postponed (string) ones it counted every key as required (``__optional_keys__`` was empty)
from typing import Literal, TypedDict

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired


class SequencePackingArgs(TypedDict):
    """Pass to ``shard_by_batch_size`` to pack each shard's sequences into microbatches."""

    max_tokens_per_microbatch: int  # bin capacity, in padded tokens
    input_key: str  # the [B, S, *] tensor to pack (used by make_microbatch_iterator_for_packable_sequences)
    input_lengths_key: str  # per-sample sequence lengths
    algorithm: str  # a tritonrec.data.packing algorithm name
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]  # run a rank's bins in packer order (default)
    balance_ranks: NotRequired[bool]  # reorder bins so the round-robin deal balances tokens across ranks (tritonrec)
    sequence_length_pad_multiple: int  # pad every sequence to a multiple of this (context-parallel alignment)


class DynamicBatchingArgs(TypedDict):
    """Pass to ``shard_by_batch_size`` to form microbatches of similar lengths under a token budget."""

    max_tokens_per_microbatch: int  # rows x padded length of a microbatch stays at or below this
    sequence_length_round: int  # round each microbatch's sequence length up to this multiple
    input_key: str  # the [B, S, *] tensor (S bounds the padded lengths)
    input_lengths_key: str  # per-sample sequence lengths
