"""Regression tests from a differential audit against torchrec 1.8: the optional metadata arguments of the sparse
types are checked (they were trusted, so a wrong cache cut values at the wrong places), mixed dtypes are refused
instead of promoted, and a few torchrec behaviours (empty_like keeps the stride, inverse indices survive tree_map)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from tritonrec.data import BatchedDataDict, JaggedTensor, KeyedJaggedTensor, KeyedTensor, UnknownKeyError

VALUES = torch.arange(8)
LENGTHS = torch.tensor([2, 0, 1, 1, 1, 3])  # keys a, b; stride 3; a holds 3 values, b 5


def _kjt(**overrides: object) -> KeyedJaggedTensor:
    kwargs = {"keys": ["a", "b"], "values": VALUES, "lengths": LENGTHS, **overrides}
    return KeyedJaggedTensor(**kwargs)  # type: ignore[arg-type]


def _vbe(**overrides: object) -> KeyedJaggedTensor:
    """Key a: 2 bags, key b: 3 bags; inverse indices expand both to a batch of 3."""
    kwargs = {
        "keys": ["a", "b"],
        "values": torch.arange(7),
        "lengths": torch.tensor([1, 2, 1, 0, 3]),
        "stride_per_key_per_rank": [[2], [3]],
        "inverse_indices": (["a", "b"], torch.tensor([[0, 1, 1], [0, 2, 1]])),
        **overrides,
    }
    return KeyedJaggedTensor(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"stride_per_key_per_rank": torch.tensor([[4, -1], [2, 1]])}, r"stride_per_key_per_rank\[0\]\[1\]"),
        ({"length_per_key": [2, 6]}, r"length_per_key = \[2, 6\] disagrees with the lengths' per-key totals \[3, 5\]"),
        ({"length_per_key": [9, -1]}, r"length_per_key\[1\] must be a non-negative int, got length_per_key\[1\]=-1"),
        ({"offset_per_key": [0, 1, 8]}, r"offset_per_key = \[0, 1, 8\] disagrees with the per-key totals \[3, 5\]"),
        ({"offset_per_key": [0, 3]}, r"offset_per_key must be a list of 3 ints"),
        ({"stride_per_key": [2, 4]}, r"stride_per_key = \[2, 4\] disagrees with the strides: \[3, 3\]"),
        ({"index_per_key": {"x": 0}}, r"index_per_key = \{'x': 0\} must map each key to its position"),
        ({"jt_dict": {"x": None}}, r"jt_dict must be a dict with the keys \['a', 'b'\]"),
        ({"lengths": LENGTHS.view(3, 2)}, r"2-D lengths must be \[T, B\] with one row per key \(T = 2\)"),
        ({"lengths": LENGTHS, "stride_per_key_per_rank": [[3], [3]], "stride": -1}, "stride must be a non-negative"),
    ],
)
def test_kjt_metadata_arguments_are_checked(overrides: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _kjt(**overrides)


def test_kjt_consistent_metadata_is_kept() -> None:
    """Correct caches are accepted and used; a values buffer with a slack tail takes the true per-key totals (was
    refused: length_per_key had to sum to the whole buffer; torchrec accepts it)."""
    kjt = _kjt(length_per_key=[3, 5], offset_per_key=[0, 3, 8], stride_per_key=[3, 3], index_per_key={"a": 0, "b": 1})
    assert kjt["b"].values().tolist() == [3, 4, 5, 6, 7]
    slack = KeyedJaggedTensor(["a"], torch.arange(5), lengths=torch.tensor([2, 1]), length_per_key=[3])
    assert slack.length_per_key() == [3] and slack["a"].values().tolist() == [0, 1, 2]
    assert kjt.split([1, 1])[1].values().tolist() == [3, 4, 5, 6, 7]


def test_kjt_inverse_indices_are_checked() -> None:
    assert _vbe().stride() == 3
    with pytest.raises(ValueError, match=r"inverse_indices\[1\]\[0, 2\] = 2 is outside \[0, 2\), the bags of key 'a'"):
        _vbe(inverse_indices=(["a", "b"], torch.tensor([[0, 1, 2], [0, 2, 1]])))
    with pytest.raises(UnknownKeyError, match=r"inverse_indices\[0\] names key 'z'"):
        _vbe(inverse_indices=(["a", "z"], torch.zeros(2, 3, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"inverse_indices\[1\] must be an int32/int64 \[2, B\] tensor"):
        _vbe(inverse_indices=(["a", "b"], torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(TypeError, match="inverse_indices must be a"):
        _vbe(inverse_indices=torch.zeros(2, 3, dtype=torch.int64))


def test_kjt_permute_indices_tensor_must_match_indices() -> None:
    kjt = _kjt()
    assert kjt.permute([1, 0], torch.tensor([1, 0], dtype=torch.int32)).keys() == ["b", "a"]
    with pytest.raises(ValueError, match=r"indices_tensor \[0, 1\] disagrees with indices \[1, 0\]"):
        kjt.permute([1, 0], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"indices_tensor must be a \[2\] tensor"):
        kjt.permute([1, 0], torch.tensor([1]))


def test_kjt_concat_and_from_jt_dict_refuse_mixed_dtypes() -> None:
    """torch.cat promoted int64 ids to float32 (ids above 2**24 lose their low bits) without a word."""
    ids, floats = _kjt(), KeyedJaggedTensor(["c", "d"], VALUES.float(), lengths=LENGTHS)
    with pytest.raises(ValueError, match=r"kjt_list\[1\].values\(\) is torch.float32 on cpu but kjt_list\[0\]'s is"):
        KeyedJaggedTensor.concat([ids, floats])
    with pytest.raises(ValueError, match=r"jt_dict\['d'\].values\(\) is torch.float32"):
        KeyedJaggedTensor.from_jt_dict({"a": ids["a"], "d": floats["d"]})
    with pytest.raises(TypeError, match="kjt_list must be a list of KeyedJaggedTensor, got KeyedJaggedTensor"):
        KeyedJaggedTensor.concat(ids)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="jt_dict must be a dict of JaggedTensor, got list"):
        KeyedJaggedTensor.from_jt_dict([ids["a"]])  # type: ignore[arg-type]


def test_kjt_empty_like_and_keyless_concat_keep_the_stride() -> None:
    """torchrec's empty_like keeps the batch size (stride); it was reset to 0."""
    like = KeyedJaggedTensor.empty_like(_kjt())
    assert like.keys() == [] and like.stride() == 3
    assert KeyedJaggedTensor.concat([like, like]).stride() == 3
    assert KeyedJaggedTensor.concat([like, _kjt()]).stride() == 3


def test_tree_map_keeps_inverse_indices() -> None:
    """A VBE KJT moved by tree_map lost its inverse indices (and then failed in a sharded EBC)."""
    moved = pytree.tree_map(lambda t: t.clone(), {"features": _vbe()})["features"]
    keys, inverse = moved.inverse_indices()
    assert keys == ["a", "b"] and inverse.tolist() == [[0, 1, 1], [0, 2, 1]]
    assert moved.stride_per_key_per_rank() == [[2], [3]] and moved.stride() == 3


def test_keyed_tensor_metadata_and_regroup_checks() -> None:
    values = torch.arange(6.0).view(2, 3)
    with pytest.raises(ValueError, match=r"offset_per_key = \[0, 5, 9\] disagrees with length_per_key \[1, 2\]"):
        KeyedTensor(["a", "b"], [1, 2], values, offset_per_key=[0, 5, 9])
    with pytest.raises(ValueError, match=r"index_per_key = \{'q': 0\} must map each of the keys"):
        KeyedTensor(["a", "b"], [1, 2], values, index_per_key={"q": 0})
    with pytest.raises(ValueError, match=r"length_per_key\[0\] must be a non-negative int, got .*=True \(a bool\)"):
        KeyedTensor(["a", "b"], [True, 2], values)
    with pytest.raises(ValueError, match="key_dim must be a dim of values .*got key_dim=1.0"):
        KeyedTensor(["a", "b"], [1, 2], values, key_dim=1.0)  # type: ignore[arg-type]
    zeros, ones = KeyedTensor(["a"], [1], torch.zeros(2, 1)), KeyedTensor(["a"], [2], torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"key 'a' is held by keyed_tensors\[0\] and keyed_tensors\[1\]"):
        KeyedTensor.regroup([zeros, ones], [["a"]])  # ours took the first, torchrec the last
    assert KeyedTensor.regroup([zeros, zeros], [["a"]])[0].shape == (2, 1)  # the same input twice is fine
    with pytest.raises(TypeError, match="groups must be a list of lists of keys"):
        KeyedTensor.regroup([zeros], ["a"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"keys must name each group once: 2 groups, got keys \['x', 'x'\]"):
        KeyedTensor.regroup_as_dict([zeros], [["a"], ["a"]], ["x", "x"])


def test_from_dense_lengths_weights_shape() -> None:
    with pytest.raises(ValueError, match=r"weights must have shape \(2, 3\) \(\[B, N\]\), got \(2, 2\)"):
        JaggedTensor.from_dense_lengths(torch.zeros(2, 3), torch.tensor([1, 2]), torch.zeros(2, 2))


def test_batched_data_dict_select_indices_out_of_range() -> None:
    batch = BatchedDataDict({"x": torch.arange(4), "names": ["a", "b", "c", "d"]})
    assert batch.select_indices([-1, 0])["names"] == ["d", "a"]  # negative counts from the end, as in NeMo-RL
    with pytest.raises(ValueError, match=r"indices holds 4, outside \[-4, 4\) \(the batch has 4 rows\)"):
        batch.select_indices([0, 4])
    with pytest.raises(ValueError, match="indices must be a 1-D sequence of ints"):
        batch.select_indices([[0, 1]])
