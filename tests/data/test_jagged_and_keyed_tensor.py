"""JaggedTensor and KeyedTensor: torchrec's documented examples, conversions, regrouping with autograd."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import JaggedTensor, KeyedTensor, jt_is_equal

VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
WEIGHTS = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
OFFSETS = torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)


def test_jagged_tensor_conversions() -> None:
    jt = JaggedTensor(values=VALUES, weights=WEIGHTS, offsets=OFFSETS)
    assert jt.lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert [t.tolist() for t in jt.to_dense()] == [[1.0, 2.0], [], [3.0], [4.0], [5.0], [6.0, 7.0, 8.0]]
    dense_weights = jt.to_dense_weights()
    assert [t.numel() for t in dense_weights] == [2, 0, 1, 1, 1, 3]
    assert torch.equal(torch.cat(dense_weights), WEIGHTS)
    assert jt.to_padded_dense(desired_length=2, padding_value=10.0).tolist() == [
        [1.0, 2.0], [10.0, 10.0], [3.0, 10.0], [4.0, 10.0], [5.0, 10.0], [6.0, 7.0],
    ]  # fmt: skip
    padded_weights = jt.to_padded_dense_weights(desired_length=2, padding_value=1.0)
    assert torch.equal(padded_weights, torch.tensor([[0.1, 0.2], [1, 1], [0.3, 1], [0.4, 1], [0.5, 1], [0.6, 0.7]]))
    assert jt.to_padded_dense().shape == (6, 3)  # longest bag by default
    assert JaggedTensor(values=VALUES, offsets=OFFSETS).to_padded_dense_weights() is None


def test_jagged_tensor_constructors() -> None:
    jt = JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([]), torch.tensor([7.0, 8.0])])
    assert jt.lengths().tolist() == [1, 0, 2] and jt.values().tolist() == [1.0, 7.0, 8.0]
    assert jt.offsets().tolist() == [0, 1, 1, 3]
    dense = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    jt2 = JaggedTensor.from_dense_lengths(dense, torch.tensor([2, 1]))
    assert jt2.values().tolist() == [1.0, 2.0, 3.0]
    assert jt_is_equal(jt2, JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 1])))
    empty = JaggedTensor.empty(is_weighted=True)
    assert empty.lengths().numel() == 0 and empty.weights().numel() == 0 and empty.to_dense() == []
    both = JaggedTensor(VALUES, lengths=OFFSETS[1:] - OFFSETS[:-1], offsets=OFFSETS)
    assert both.values() is VALUES
    moved = jt.to("cpu")
    assert jt_is_equal(moved, jt) and repr(jt) == "JaggedTensor([[1.0], [], [7.0, 8.0]])"


def test_jagged_tensor_2d_values_pad() -> None:
    rows = torch.arange(12.0).reshape(4, 3)
    jt = JaggedTensor(rows, lengths=torch.tensor([1, 0, 3]))
    padded = jt.to_padded_dense(2, padding_value=-1.0)
    assert padded.shape == (3, 2, 3)
    assert padded[2].tolist() == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]] and padded[1].eq(-1).all()


def test_keyed_tensor_torchrec_example() -> None:
    tensors = [torch.tensor([[1, 1]] * 3), torch.tensor([[2, 1, 2]] * 3), torch.tensor([[3, 1, 2, 3]] * 3)]
    kt = KeyedTensor.from_tensor_list(["Embedding A", "Embedding B", "Embedding C"], tensors)
    assert kt.values().tolist() == [[1, 1, 2, 1, 2, 3, 1, 2, 3]] * 3
    assert kt["Embedding B"].tolist() == [[2, 1, 2]] * 3
    assert kt.length_per_key() == [2, 3, 4] and kt.offset_per_key() == [0, 2, 5, 9]
    assert {k: v.shape[1] for k, v in kt.to_dict().items()} == {"Embedding A": 2, "Embedding B": 3, "Embedding C": 4}


def test_keyed_tensor_regroup_with_gradients() -> None:
    a = torch.randn(2, 5, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    kt_a = KeyedTensor(["x", "y"], [2, 3], a)
    kt_b = KeyedTensor(["z"], [4], b)
    left, right = KeyedTensor.regroup([kt_a, kt_b], [["z", "x"], ["y", "x"]])
    assert torch.equal(left, torch.cat([b, a[:, :2]], dim=1))
    assert torch.equal(right, torch.cat([a[:, 2:], a[:, :2]], dim=1))
    (left.sum() + 2 * right.sum()).backward()
    assert a.grad.tolist() == [[3.0, 3.0, 2.0, 2.0, 2.0]] * 2 and b.grad.eq(1).all()
    as_dict = KeyedTensor.regroup_as_dict([kt_a, kt_b], [["y"], ["z"]], ["first", "second"])
    assert list(as_dict) == ["first", "second"] and as_dict["second"].shape == (2, 4)


def test_keyed_tensor_key_dim_zero() -> None:
    kt = KeyedTensor(["p", "q"], [1, 2], torch.arange(6.0).reshape(3, 2), key_dim=0)
    assert kt["q"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert "KeyedTensor" in repr(kt)


def test_keyed_tensor_bad_input() -> None:
    with pytest.raises(ValueError, match=r"values has size 5 along key_dim=1 but sum\(length_per_key\) = 4"):
        KeyedTensor(["a", "b"], [2, 2], torch.zeros(3, 5))
    with pytest.raises(ValueError, match="length_per_key must have one entry per key"):
        KeyedTensor(["a", "b"], [5], torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"key_dim must be a dim of values with shape \(3, 5\), got key_dim=2"):
        KeyedTensor(["a"], [5], torch.zeros(3, 5), key_dim=2)
    kt = KeyedTensor(["a"], [5], torch.zeros(3, 5))
    with pytest.raises(KeyError, match="key 'nope' is not one of"):
        kt["nope"]
    with pytest.raises(ValueError, match=r"groups\[1\] names key 'nope'"):
        KeyedTensor.regroup([kt], [["a"], ["nope"]])
    with pytest.raises(ValueError, match="keys must name each group"):
        KeyedTensor.regroup_as_dict([kt], [["a"]], ["x", "y"])
    with pytest.raises(TypeError, match="keys must be a list of str"):
        KeyedTensor([1], [5], torch.zeros(3, 5))  # type: ignore[list-item]


def test_sparse_types_are_pytree_nodes() -> None:
    """tree_map moves whole batches (tensors inside KJT/JT/KT are leaves; absent weights are not)."""
    import torch.utils._pytree as pytree

    from tritonrec.data import KeyedJaggedTensor, kjt_is_equal

    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(8), lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    batch = {
        "sparse": kjt,
        "jt": JaggedTensor(VALUES, WEIGHTS, offsets=OFFSETS),
        "kt": KeyedTensor(["x"], [2], torch.ones(3, 2)),
    }
    leaves, spec = pytree.tree_flatten(batch)
    assert len(leaves) == 2 + 3 + 1  # kjt: values, lengths; jt: values, weights, offsets; kt: values
    doubled = pytree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, batch)
    assert kjt_is_equal(doubled["sparse"].permute([1, 0]), kjt.permute([1, 0]))
    assert torch.equal(doubled["jt"].weights(), 2 * WEIGHTS) and doubled["jt"].lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert doubled["kt"]["x"].eq(2).all()
    assert kjt_is_equal(pytree.tree_unflatten(leaves, spec)["sparse"], kjt)
