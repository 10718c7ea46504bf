"""Edge cases of the sparse types that used to fail deep inside torch: a KeyedJaggedTensor built from empty offsets
(no bags) behaves as an empty batch, as in torchrec, and KeyedTensor.regroup names the keys whose batch sizes
differ."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig


def _empty_offsets_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["a", "b"], torch.empty(0, dtype=torch.int64), offsets=torch.tensor([], dtype=torch.int64))


def test_kjt_from_empty_offsets_is_an_empty_batch() -> None:
    kjt = _empty_offsets_kjt()
    assert kjt.stride() == 0
    assert kjt.length_per_key() == [0, 0] and kjt.offset_per_key() == [0, 0, 0]
    assert kjt.lengths().numel() == 0 and kjt.offsets().tolist() == [0]
    jts = kjt.to_dict()
    assert list(jts) == ["a", "b"]
    assert all(jt.values().numel() == 0 and jt.lengths().numel() == 0 for jt in jts.values())
    permuted = kjt.permute([1, 0])
    assert permuted.keys() == ["b", "a"] and permuted.length_per_key() == [0, 0]
    first, second = kjt.split([1, 1])
    assert first.keys() == ["a"] and second.length_per_key() == [0]
    assert "KeyedJaggedTensor" in repr(kjt)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(num_embeddings=4, embedding_dim=3, name="t", feature_names=["a", "b"])]
    )
    pooled = ebc(kjt)
    assert pooled.values().shape == (0, 6) and pooled.keys() == ["a", "b"]


def test_jagged_tensor_from_empty_offsets_is_empty() -> None:
    jt = JaggedTensor(torch.empty(0), offsets=torch.tensor([], dtype=torch.int64))
    assert jt.lengths().numel() == 0 and jt.offsets().tolist() == [0]
    assert jt.to_dense() == []


def test_regroup_names_keys_with_different_batch_sizes() -> None:
    kt_a = KeyedTensor.from_tensor_list(["a"], [torch.ones(3, 2)])
    kt_b = KeyedTensor.from_tensor_list(["b", "c"], [torch.ones(4, 3), torch.ones(4, 1)])
    with pytest.raises(ValueError, match=r"groups\[1\] mixes batch sizes: key 'a' has 3 rows, key 'b' has 4"):
        KeyedTensor.regroup([kt_a, kt_b], [["b", "c"], ["a", "b"]])
    grouped = KeyedTensor.regroup([kt_a, kt_b], [["b", "c"], ["a"]])  # no group mixes them: fine
    assert [g.shape for g in grouped] == [(4, 4), (3, 2)]
