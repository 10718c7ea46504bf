"""Inputs the batch container and the packers used to accept and mishandle: mismatched batch sizes in a
BatchedDataDict, lengths longer than the padded width (dynamic batching and sequence packing, reported at shard time
with the global row), a tensor passed where a PackingPlan goes, and unsigned lengths that do not fit int64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tritonrec.data.batched_data_dict import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
from tritonrec.data.packing import get_packer
from tritonrec.kernels.pack_sequences import make_packing_plan, pack_sequences, unpack_sequences


def test_batched_data_dict_refuses_mismatched_batch_sizes() -> None:
    with pytest.raises(ValueError, match=r"key 'b' has 3 rows but key 'a' has 4"):
        BatchedDataDict({"a": torch.zeros(4, 3), "b": [1, 2, 3]})
    batch = BatchedDataDict({"a": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"key 'c' has 5 rows but key 'a' has 4"):
        batch["c"] = torch.zeros(5)
    assert list(batch) == ["a"]  # the refused value was not stored
    batch["a"] = torch.zeros(6)  # replacing the only key may change the batch size
    batch["b"] = list(range(6))
    assert batch.size == 6
    with pytest.raises(ValueError, match=r"key 'b' has 1 rows but key 'a' has 2"):
        BatchedDataDict.from_batches([{"a": torch.zeros(2), "b": [0]}])
    with pytest.raises(TypeError, match="values must be tensors or lists, got dict for key 'bad'"):
        BatchedDataDict({"bad": {}})


def _batch(lengths: list[int], width: int) -> BatchedDataDict:
    return BatchedDataDict({"input_ids": torch.ones(len(lengths), width), "lengths": torch.tensor(lengths)})


def test_dynamic_batching_refuses_lengths_past_the_padded_width() -> None:
    args = DynamicBatchingArgs(
        max_tokens_per_microbatch=64, sequence_length_round=1, input_key="input_ids", input_lengths_key="lengths"
    )
    with pytest.raises(ValueError, match=r"batch\['lengths'\]\[1\] = 9 is longer than the padded width 6"):
        _batch([3, 9, 2, 4], width=6).shard_by_batch_size(shards=2, dynamic_batching_args=args)


def test_sequence_packing_refuses_lengths_past_the_padded_width_at_shard_time() -> None:
    args = SequencePackingArgs(
        max_tokens_per_microbatch=64, input_key="input_ids", input_lengths_key="lengths",
        algorithm="modified_first_fit_decreasing", sequence_length_pad_multiple=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"batch\['lengths'\]\[6\] = 9 is longer than the padded width 6"):
        _batch([3, 2, 4, 1, 5, 6, 9, 2], width=6).shard_by_batch_size(shards=2, sequence_packing_args=args)


def test_pack_sequences_needs_a_plan() -> None:
    values = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"plan must be a PackingPlan \(build it with make_packing_plan\), got Tensor"):
        pack_sequences(values, torch.tensor([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plan must be a PackingPlan .*got list"):
        unpack_sequences(values, [1, 2])  # type: ignore[arg-type]
    plan = make_packing_plan(torch.arange(2), torch.tensor([0, 2]), lengths=torch.tensor([1, 2]), padded_len=3)
    assert pack_sequences(values, plan).tokens.shape == (3,)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_unsigned_lengths_past_int64_are_refused(as_tensor: bool) -> None:
    lengths = np.array([3, 2**63 + 5], dtype=np.uint64)
    given = torch.from_numpy(lengths) if as_tensor else lengths
    with pytest.raises(ValueError, match=r"sequence_lengths\[1\] = 9223372036854775813 \(uint64\) does not fit int64"):
        get_packer("first_fit_decreasing", 16).pack(given)
    batch = BatchedDataDict({"input_ids": torch.ones(2, 4), "lengths": torch.from_numpy(lengths)})
    args = DynamicBatchingArgs(
        max_tokens_per_microbatch=64, sequence_length_round=1, input_key="input_ids", input_lengths_key="lengths"
    )
    with pytest.raises(ValueError, match=r"batch\['lengths'\]\[1\] = 9223372036854775813 \(uint64\) does not fit"):
        batch.shard_by_batch_size(shards=1, dynamic_batching_args=args)
    assert get_packer("first_fit_decreasing", 16).pack(np.array([3, 5], dtype=np.uint64)) == [[1, 0]]
