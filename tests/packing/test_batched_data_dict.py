"""BatchedDataDict basics with NeMo-RL's semantics: plain sharding, stacking, slicing, reordering, iterators."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data.batched_data_dict import BatchedDataDict, SlicedDataDict


def test_shard_by_batch_size_interleaves_chunks() -> None:
    batch = BatchedDataDict({"ids": torch.arange(8), "other": torch.arange(10, 18), "names": list("ABCDEFGH")})
    shards = batch.shard_by_batch_size(shards=2, batch_size=4)
    assert [type(s) for s in shards] == [SlicedDataDict, SlicedDataDict]
    assert torch.equal(shards[0]["ids"], torch.tensor([0, 1, 4, 5]))
    assert torch.equal(shards[1]["ids"], torch.tensor([2, 3, 6, 7]))
    assert torch.equal(shards[1]["other"], torch.tensor([12, 13, 16, 17]))
    assert shards[0]["names"] == ["A", "B", "E", "F"]


def test_shard_by_batch_size_more_shapes() -> None:
    batch = BatchedDataDict({"x": torch.arange(12), "rows": torch.arange(24).reshape(12, 2)})
    shards = batch.shard_by_batch_size(shards=3, batch_size=3)
    assert [s["x"].tolist() for s in shards] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    assert torch.equal(shards[2]["rows"], torch.tensor([[4, 5], [10, 11], [16, 17], [22, 23]]))
    whole = batch.shard_by_batch_size(shards=2)  # batch_size=None: one chunk
    assert [s["x"].tolist() for s in whole] == [list(range(6)), list(range(6, 12))]
    assert BatchedDataDict({"x": torch.arange(4)}).shard_by_batch_size(shards=1, batch_size=2)[0]["x"].tolist() == [
        0,
        1,
        2,
        3,
    ]


def test_uneven_shards() -> None:
    batch = BatchedDataDict({"x": list(range(5)), "t": torch.arange(5)})
    shards = batch.shard_by_batch_size(shards=2, allow_uneven_shards=True)
    assert [s["x"] for s in shards] == [[0, 1, 2], [3, 4]]
    tail = BatchedDataDict({"t": torch.ones(2, 3), "x": [0, 1]}).shard_by_batch_size(shards=4, allow_uneven_shards=True)
    assert [s.size for s in tail] == [1, 1, 0, 0]
    assert tail[3]["t"].shape == (0, 3) and tail[3]["x"] == []


def test_shard_validation_errors() -> None:
    batch = BatchedDataDict({"data": torch.arange(10)})
    with pytest.raises(ValueError, match=r"Total batch size \(10\) is not a multiple of batch_size \(3\)"):
        batch.shard_by_batch_size(shards=2, batch_size=3)
    with pytest.raises(ValueError, match=r"Batch size \(4\) is not a multiple of shards \(3\)"):
        BatchedDataDict({"data": torch.arange(8)}).shard_by_batch_size(shards=3, batch_size=4)
    with pytest.raises(ValueError, match=r"key 'b' has 3 rows but key 'a' has 4"):
        BatchedDataDict({"a": torch.arange(4), "b": [0, 1, 2]})
    ragged = BatchedDataDict({"a": torch.arange(4)})
    ragged.data["b"] = [0, 1, 2]  # only by writing the underlying dict
    with pytest.raises(ValueError, match=r"not the same across the rollout batch.*'a': 4, 'b': 3"):
        ragged.shard_by_batch_size(shards=2, batch_size=2)
    with pytest.raises(ValueError, match="shards must be a positive int, got shards=0"):
        batch.shard_by_batch_size(shards=0)
    with pytest.raises(ValueError, match="batch_size must be None if allow_uneven_shards is True, got batch_size=5"):
        batch.shard_by_batch_size(shards=2, batch_size=5, allow_uneven_shards=True)
    with pytest.raises(TypeError, match="values must be tensors or lists, got dict for key 'bad'"):
        BatchedDataDict({"bad": {}}).shard_by_batch_size(shards=1)


def test_from_batches_pads_along_the_sequence_dim() -> None:
    first = {"ids": torch.tensor([[1, 2], [3, 4]]), "len": torch.tensor([2, 2]), "tag": ["a", "b"]}
    second = {"ids": torch.tensor([[5, 6, 7]]), "len": torch.tensor([3]), "tag": ["c"]}
    stacked = BatchedDataDict.from_batches([first, second], pad_value_dict={"ids": -1})
    assert torch.equal(stacked["ids"], torch.tensor([[1, 2, -1], [3, 4, -1], [5, 6, 7]]))
    assert torch.equal(stacked["len"], torch.tensor([2, 2, 3]))
    assert stacked["tag"] == ["a", "b", "c"]
    assert BatchedDataDict.from_batches([]).size == 0


@pytest.mark.parametrize("rank", [3, 4])
def test_from_batches_pads_higher_rank_tensors(rank: int) -> None:
    trailing = (4, 2)[: rank - 2]
    a = torch.arange(2 * 3 * int(torch.tensor(trailing).prod())).reshape(2, 3, *trailing).float()
    b = torch.ones(1, 5, *trailing)
    stacked = BatchedDataDict.from_batches([{"x": a}, {"x": b}], pad_value_dict={"x": -7})["x"]
    assert stacked.shape == (3, 5, *trailing)
    assert torch.equal(stacked[:2, :3], a)
    assert bool((stacked[:2, 3:] == -7).all())
    assert torch.equal(stacked[2:], b)


def test_from_batches_errors() -> None:
    with pytest.raises(KeyError, match=r"Key 'extra' is missing from non-empty batches \[0\]"):
        BatchedDataDict.from_batches([{"x": torch.ones(1)}, {"x": torch.ones(1), "extra": torch.ones(1)}])
    merged = BatchedDataDict.from_batches([{"x": torch.zeros(0)}, {"x": torch.ones(2), "extra": torch.ones(2)}])
    assert merged["extra"].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match=r"key 'x' mixes types \['Tensor', 'list'\]"):
        BatchedDataDict.from_batches([{"x": torch.ones(1)}, {"x": [1]}])
    with pytest.raises(ValueError, match=r"key 'x' has tensors of ranks \[1, 2\]"):
        BatchedDataDict.from_batches([{"x": torch.ones(1)}, {"x": torch.ones(1, 2)}])
    with pytest.raises(ValueError, match=r"key 'x' has tensors whose dims after the sequence dim differ"):
        BatchedDataDict.from_batches([{"x": torch.ones(1, 2, 3)}, {"x": torch.ones(1, 2, 4)}])


def test_chunk_slice_select_and_get_dict() -> None:
    batch = BatchedDataDict({"x": torch.arange(6), "y": list("abcdef")})
    part = batch.chunk(rank=1, chunks=3)
    assert part["x"].tolist() == [2, 3] and part["y"] == ["c", "d"]
    part["x"][0] = 99  # chunk copies tensors
    assert batch["x"][2] == 2
    assert batch.slice(1, 4)["y"] == ["b", "c", "d"]
    picked = batch.select_indices([5, 0, 5])
    assert picked["x"].tolist() == [5, 0, 5] and picked["y"] == ["f", "a", "f"]
    assert batch.select_indices(torch.tensor([1]))["y"] == ["b"]
    assert batch.get_dict() is batch.data
    with pytest.raises(ValueError, match=r"batch size \(6\) is not a multiple of chunks \(4\)"):
        batch.chunk(0, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, chunks=3\), got rank=3"):
        batch.chunk(3, 3)
    with pytest.raises(ValueError, match=r"need 0 <= start <= end <= size \(6\), got start=2, end=7"):
        batch.slice(2, 7)


def test_reorder_data_inverts_a_permutation() -> None:
    batch = BatchedDataDict({"x": torch.tensor([30, 10, 20]), "y": ["c", "a", "b"]})
    batch.reorder_data([2, 0, 1])  # row 0 came from original row 2, ...
    assert batch["x"].tolist() == [10, 20, 30] and batch["y"] == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"reorded_indices must be a permutation of range\(3\)"):
        batch.reorder_data([0, 0, 1])


def test_repeat_interleave_truncate_to_and_size() -> None:
    batch = BatchedDataDict({"x": torch.tensor([1, 2]), "items": [[1], [2]], "seq": torch.arange(8).reshape(2, 4)})
    repeated = batch.repeat_interleave(2)
    assert repeated["x"].tolist() == [1, 1, 2, 2] and repeated["items"] == [[1], [1], [2], [2]]
    repeated["items"][0].append(5)  # deep copies
    assert repeated["items"][1] == [1]
    batch.truncate_tensors(dim=1, truncated_len=2)
    assert batch["seq"].tolist() == [[0, 1], [4, 5]] and batch["x"].tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"truncated_len=3 exceeds dim 1 of 'seq'"):
        batch.truncate_tensors(dim=1, truncated_len=3)
    assert batch.size == 2 and BatchedDataDict().size == 0
    assert batch.to("cpu") is batch
    with pytest.raises(ValueError, match="num_repeats must be an int >= 0, got num_repeats=-1"):
        batch.repeat_interleave(-1)


def test_make_microbatch_iterator() -> None:
    batch = BatchedDataDict({"x": torch.arange(6)})
    assert [mb["x"].tolist() for mb in batch.make_microbatch_iterator(2)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"Data dict size \(6\) is not a multiple of microbatch_size=4"):
        list(batch.make_microbatch_iterator(4))
    with pytest.raises(ValueError, match="needs microbatch metadata for exactly one batch"):
        list(batch.make_microbatch_iterator_with_dynamic_shapes())


def test_get_batch_and_argument_errors() -> None:
    batch = BatchedDataDict({"x": torch.arange(8)})
    assert batch.get_batch(1, batch_size=4)["x"].tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="batch_size must be a positive int for this dict, got batch_size=None"):
        batch.get_batch(0)
    with pytest.raises(ValueError, match=r"need 0 <= start <= end <= size \(8\), got start=8, end=12"):
        batch.get_batch(2, batch_size=4)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int \(or None .*got batch_size=0"):
        batch.shard_by_batch_size(shards=2, batch_size=0)
    with pytest.raises(ValueError, match="value for key 'x' must have a batch dimension, got a 0-d tensor"):
        BatchedDataDict({"x": torch.tensor(3)}).shard_by_batch_size(shards=1)


@pytest.mark.parametrize("uneven", [False, True])
def test_empty_batch_shards_with_whole_batch_size(uneven: bool) -> None:
    """batch_size=None on an empty batch shards like any explicit batch_size does: ``shards`` empty shards (it used to
    refuse with "batch_size must be a positive int ..., got 0", a value the caller never passed)."""
    batch = BatchedDataDict({"x": torch.zeros(0, 3), "names": []})
    shards = batch.shard_by_batch_size(shards=2, allow_uneven_shards=uneven)
    assert len(shards) == 2
    assert all(s["x"].shape == (0, 3) and s["names"] == [] for s in shards)


def test_get_multimodal_dict_returns_nemo_rl_optional_keys() -> None:
    """NeMo-RL's policies call ``get_multimodal_dict(as_tensors=True, device=...)`` on every batch; without
    PackedTensor values it holds the model-specific optional tensors present, as stored."""
    text = BatchedDataDict({"input_ids": torch.ones(2, 3), "names": ["a", "b"]})
    assert text.get_multimodal_dict(as_tensors=True, device=torch.device("cpu")) == {}
    token_types = torch.zeros(2, 3, dtype=torch.long)
    batch = BatchedDataDict({"input_ids": torch.ones(2, 3), "token_type_ids": token_types})
    assert batch.get_multimodal_dict() == {"token_type_ids": token_types}
