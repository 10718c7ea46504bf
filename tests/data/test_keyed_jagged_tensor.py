"""KeyedJaggedTensor: torchrec's documented examples reproduced exactly, VBE, and a property test against a plain
list-of-lists model of the batch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, kjt_is_equal

VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
WEIGHTS = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5])
OFFSETS = torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["index_0", "index_1"], values=VALUES, offsets=OFFSETS, weights=WEIGHTS)


def test_layout_of_the_docstring_example() -> None:
    kjt = _kjt()
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert kjt.offset_per_key() == [0, 3, 8]
    assert kjt.length_per_key() == [3, 5]
    assert kjt.index_per_key() == {"index_0": 0, "index_1": 1}
    assert kjt.stride() == 3 and kjt.stride_per_key() == [3, 3] and not kjt.variable_stride_per_key()
    assert kjt.lengths_offset_per_key() == [0, 3, 6]


def test_key_lookup_and_to_dict() -> None:
    kjt = _kjt()
    for jt in (kjt["index_0"], kjt.to_dict()["index_0"]):
        assert isinstance(jt, JaggedTensor)
        assert jt.lengths().tolist() == [2, 0, 1]
        assert jt.values().tolist() == [1.0, 2.0, 3.0]
        assert jt.weights().tolist() == [1.0, 0.5, 1.5]
    j1 = kjt["index_1"]
    assert j1.lengths().tolist() == [1, 1, 3]
    assert j1.values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0]
    assert j1.weights().tolist() == [1.0, 0.5, 1.0, 1.0, 1.5]
    assert list(kjt.to_dict()) == ["index_0", "index_1"]


def test_key_lookup_vb() -> None:
    kjt = KeyedJaggedTensor(
        keys=["index_0", "index_1"], values=VALUES, offsets=OFFSETS, weights=WEIGHTS, stride_per_key_per_rank=[[2], [4]]
    )
    assert kjt.variable_stride_per_key() and kjt.stride() == 4 and kjt.stride_per_key() == [2, 4]
    j0, j1 = kjt["index_0"], kjt["index_1"]
    assert j0.lengths().tolist() == [2, 0] and j0.values().tolist() == [1.0, 2.0]
    assert j1.lengths().tolist() == [1, 1, 1, 3]
    assert j1.values().tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert j1.weights().tolist() == [1.5, 1.0, 0.5, 1.0, 1.0, 1.5]


def test_split() -> None:
    j0, j1 = _kjt().split([1, 1])
    assert j0.keys() == ["index_0"] and j1.keys() == ["index_1"]
    assert j0.lengths().tolist() == [2, 0, 1] and j0.values().tolist() == [1.0, 2.0, 3.0]
    assert j1.weights().tolist() == [1.0, 0.5, 1.0, 1.0, 1.5]
    empty, everything = _kjt().split([0, 2])
    assert empty.keys() == [] and empty.values().numel() == 0 and empty.weights().numel() == 0
    assert empty.stride() == 3 and everything.stride() == 3
    assert torch.equal(everything.values(), VALUES)


def test_split_vb() -> None:
    values = torch.arange(1.0, 11.0)
    kjt = KeyedJaggedTensor(
        keys=["index_0", "index_1", "index_2", "index_3"],
        values=values,
        lengths=torch.tensor([2, 0, 1, 1, 1, 3, 0, 2], dtype=torch.int32),
        stride_per_key_per_rank=[[3], [0], [1], [4]],
    )
    j0, j1, j2 = kjt.split([1, 1, 2])
    assert [j.stride() for j in (j0, j1, j2)] == [4, 4, 4]
    assert j0.lengths().tolist() == [2, 0, 1] and j0.values().tolist() == [1.0, 2.0, 3.0]
    assert j1.lengths().tolist() == [] and j1.values().tolist() == []
    assert j2.lengths().tolist() == [1, 1, 3, 0, 2] and j2.values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert j2.stride_per_key_per_rank() == [[1], [4]]
    parts = kjt.split([0, 3, 0, 1])
    assert [p.keys() for p in parts] == [[], ["index_0", "index_1", "index_2"], [], ["index_3"]]
    assert parts[1].lengths().tolist() == [2, 0, 1, 1] and parts[3].lengths().tolist() == [1, 3, 0, 2]
    assert parts[3].values().tolist() == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]


def test_permute_with_weights() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["index_0", "index_1", "index_2"],
        values=VALUES,
        lengths=torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0], dtype=torch.int32),
        weights=WEIGHTS,
    )
    permuted = kjt.permute([1, 0, 2])
    assert permuted.keys() == ["index_1", "index_0", "index_2"]
    assert permuted.offset_per_key() == [0, 3, 5, 8]
    assert permuted.values().tolist() == [3.0, 4.0, 5.0, 1.0, 2.0, 6.0, 7.0, 8.0]
    assert permuted.lengths().tolist() == [1, 1, 1, 0, 2, 0, 0, 3, 0]
    assert permuted.weights().tolist() == [1.5, 1.0, 0.5, 1.0, 0.5, 1.0, 1.0, 1.5]
    duplicated = kjt.permute([1, 0, 2, 1, 1])
    assert duplicated.offset_per_key() == [0, 3, 5, 8, 11, 14]
    assert duplicated.values().tolist() == [3, 4, 5, 1, 2, 6, 7, 8, 3, 4, 5, 3, 4, 5]
    assert duplicated.lengths().tolist() == [1, 1, 1, 0, 2, 0, 0, 3, 0, 1, 1, 1, 1, 1, 1]
    assert kjt.permute([2]).values().tolist() == [6.0, 7.0, 8.0]  # keys may be dropped


def test_permute_vb_with_duplicates() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["index_0", "index_1", "index_2"],
        values=VALUES,
        lengths=torch.tensor([1, 0, 1, 3, 0, 1, 0, 2, 0], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [4], [3]],
    )
    permuted = kjt.permute([1, 0, 2])
    assert permuted.offset_per_key() == [0, 5, 6, 8]
    assert permuted.values().tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 7.0, 8.0]
    assert permuted.lengths().tolist() == [1, 3, 0, 1, 1, 0, 0, 2, 0]
    assert permuted.stride_per_key_per_rank() == [[4], [2], [3]]
    doubled = kjt.permute([1, 1, 0, 0, 2, 2])
    assert doubled.keys() == ["index_1", "index_1", "index_0", "index_0", "index_2", "index_2"]
    assert doubled.values().tolist() == [2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 1, 1, 7, 8, 7, 8]
    assert doubled.lengths().tolist() == [1, 3, 0, 1, 1, 3, 0, 1, 1, 0, 1, 0, 0, 2, 0, 0, 2, 0]


def test_concat_and_from_jt_dict() -> None:
    values = torch.arange(1.0, 10.0)
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0, 0, 1, 0], dtype=torch.int32)
    keys = ["index_0", "index_1", "index_2"]
    expected = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    parts = [
        KeyedJaggedTensor.from_lengths_sync(keys=keys[:1], values=values[:3], lengths=lengths[:4]),
        KeyedJaggedTensor.from_lengths_sync(keys=keys[1:], values=values[3:], lengths=lengths[4:]),
    ]
    combined = KeyedJaggedTensor.concat(parts)
    assert kjt_is_equal(combined, expected)
    assert combined.length_per_key() == expected.length_per_key() == [3, 5, 1]
    assert torch.equal(combined.offsets(), expected.offsets())
    assert kjt_is_equal(KeyedJaggedTensor.from_jt_dict(expected.to_dict()), expected)
    # different batch sizes per key give a VBE KJT
    vbe = KeyedJaggedTensor.from_jt_dict(
        {"a": JaggedTensor(torch.arange(3.0), lengths=torch.tensor([1, 2])), "b": JaggedTensor.from_dense([])}
    )
    assert vbe.variable_stride_per_key() and vbe.stride_per_key() == [2, 0]


def test_values_may_carry_a_slack_tail() -> None:
    """As in torchrec and FBGEMM, values may be longer than the bags need; every op ignores the tail."""
    padded = torch.cat([VALUES, torch.full((3,), -1.0)])
    kjt = KeyedJaggedTensor(keys=["index_0", "index_1"], values=padded, offsets=OFFSETS)
    assert kjt["index_1"].values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0]
    assert kjt.to_dict()["index_1"].to_dense()[-1].tolist() == [6.0, 7.0, 8.0]
    assert kjt.permute([1, 0]).values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 1.0, 2.0, 3.0]
    assert KeyedJaggedTensor.concat([kjt, kjt]).values().numel() == 16


def test_length_vs_offsets_and_2d_values() -> None:
    offsets = torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8], dtype=torch.int32)
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3], dtype=torch.int32)
    a = KeyedJaggedTensor.from_offsets_sync(keys=["a", "b"], values=VALUES, offsets=offsets, weights=WEIGHTS)
    b = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=VALUES, lengths=lengths, weights=WEIGHTS)
    assert torch.equal(a.lengths(), b.lengths()) and torch.equal(a.offsets(), b.offsets())
    rows = torch.tensor([[i * 0.5, i * 1.0, i * 1.5] for i in range(1, 9)])
    two_d = KeyedJaggedTensor.from_offsets_sync(keys=["a", "b"], values=rows, offsets=OFFSETS, weights=WEIGHTS)
    assert two_d["a"].values().tolist() == [[0.5, 1.0, 1.5], [1.0, 2.0, 3.0], [1.5, 3.0, 4.5]]


def test_empty_and_movement() -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True)
    assert empty.keys() == [] and empty.to_dict() == {} and empty.stride() == 0
    like = KeyedJaggedTensor.empty_like(_kjt())
    assert like.values().dtype == VALUES.dtype and like.weights().dtype == WEIGHTS.dtype
    one_key_no_bags = KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), lengths=torch.tensor([]))
    assert one_key_no_bags.stride() == 0 and one_key_no_bags["a"].lengths().numel() == 0
    moved = _kjt().to("cpu", dtype=torch.float64)
    assert moved.weights().dtype == torch.float64 and moved.values().dtype == VALUES.dtype
    assert kjt_is_equal(_kjt().to("cpu"), _kjt())
    assert "index_1" in repr(_kjt()) and repr(KeyedJaggedTensor.empty()) == "KeyedJaggedTensor()"


@st.composite
def keyed_batch(draw: st.DrawFn) -> tuple[list[str], list[list[list[int]]], bool]:
    """A batch as nested lists: per key, per sample, the ids. Keys may have different batch sizes (VBE)."""
    num_keys = draw(st.integers(0, 4))
    vbe = draw(st.booleans())
    fixed = draw(st.integers(0, 4))
    bags = []
    for _ in range(num_keys):
        batch = draw(st.integers(0, 4)) if vbe else fixed
        bags.append([draw(st.lists(st.integers(0, 99), max_size=4)) for _ in range(batch)])
    return [f"f{i}" for i in range(num_keys)], bags, vbe


def _build(keys: list[str], bags: list[list[list[int]]], vbe: bool) -> KeyedJaggedTensor:
    lengths = [len(bag) for key_bags in bags for bag in key_bags]
    values = [v for key_bags in bags for bag in key_bags for v in bag]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        weights=torch.tensor(values, dtype=torch.float32) / 7,
        lengths=torch.tensor(lengths, dtype=torch.int32),
        stride_per_key_per_rank=[[len(b)] for b in bags] if vbe else None,
        stride=None if vbe else (len(bags[0]) if bags else 0),
    )


@given(keyed_batch(), st.data())
def test_permute_split_to_dict_follow_the_list_model(case: tuple, data: st.DataObject) -> None:
    keys, bags, vbe = case
    kjt = _build(keys, bags, vbe)
    for key, key_bags in zip(keys, bags, strict=True):
        assert [b.tolist() for b in kjt[key].to_dense()] == key_bags
    order = data.draw(st.lists(st.integers(0, max(len(keys) - 1, 0)), max_size=6 if keys else 0))
    permuted = kjt.permute(order)
    assert kjt_is_equal(permuted, _build([keys[i] for i in order], [bags[i] for i in order], vbe))
    cut = data.draw(st.integers(0, len(keys)))
    left, right = kjt.split([cut, len(keys) - cut])
    assert kjt_is_equal(left, _build(keys[:cut], bags[:cut], vbe))
    assert kjt_is_equal(right, _build(keys[cut:], bags[cut:], vbe))
    assert kjt_is_equal(KeyedJaggedTensor.concat([left, right]), kjt)
