"""Every bad-input case of the sparse types raises a clear error that names the argument."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor, UnknownKeyError
from tritonrec.kernels import set_value_checks

VALUES = torch.arange(8.0)
LENGTHS = torch.tensor([2, 0, 1, 1, 1, 3])


def _kjt(**overrides: object) -> KeyedJaggedTensor:
    kwargs = {"keys": ["a", "b"], "values": VALUES, "lengths": LENGTHS, **overrides}
    return KeyedJaggedTensor(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        (
            {"lengths": torch.tensor([2, 0, -1, 2, 1, 3])},
            ValueError,
            r"lengths must be non-negative, got -1 at position 2",
        ),
        ({"values": VALUES[:6]}, ValueError, r"sum\(lengths\) = 8 exceeds the number of values \(6\)"),
        ({"weights": torch.rand(5)}, ValueError, r"weights must have one entry per value \(8\)"),
        ({"lengths": torch.tensor([2, 0, 1, 1, 1])}, ValueError, "lengths has 5 entries, not divisible by the 2 keys"),
        ({"stride": 2}, ValueError, r"lengths has 6 entries but stride 2 x 2 keys = 4"),
        ({"stride": -1}, ValueError, "stride must be a non-negative int"),
        ({"lengths": None}, ValueError, r"lengths or offsets must be given for keys \['a', 'b'\]"),
        ({"lengths": torch.tensor([2.0, 0.0, 1.0, 1.0, 1.0, 3.0])}, TypeError, "lengths must be int32 or int64"),
        ({"offsets": torch.tensor([0, 2, 2, 3, 4, 5, 7])}, ValueError, r"lengths and offsets disagree at bag 5"),
        ({"offsets": torch.tensor([0, 2, 3])}, ValueError, "offsets must have len\\(lengths\\) \\+ 1 = 7 entries"),
        ({"stride_per_key_per_rank": [[3]]}, ValueError, "stride_per_key_per_rank must have one row per key"),
        ({"stride_per_key_per_rank": [[3], [2]]}, ValueError, "lengths has 6 entries but stride_per_key_per_rank"),
        ({"stride_per_key_per_rank": [[3], [-3]]}, ValueError, r"stride_per_key_per_rank\[1\]\[0\] must be"),
        ({"keys": "ab"}, TypeError, "keys must be a list of str"),
        (
            {"length_per_key": [3, 3]},
            ValueError,
            r"length_per_key = \[3, 3\] disagrees with the lengths' per-key totals",
        ),
    ],
)
def test_kjt_constructor_errors(overrides: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _kjt(**overrides)


def test_kjt_offsets_errors() -> None:
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        KeyedJaggedTensor(["a"], torch.arange(3.0), offsets=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        KeyedJaggedTensor(["a"], torch.arange(3.0), offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 4 exceeds the number of values \(3\)"):
        KeyedJaggedTensor(["a"], torch.arange(3.0), offsets=torch.tensor([0, 2, 4]))


def test_kjt_method_errors() -> None:
    kjt = _kjt()
    with pytest.raises(UnknownKeyError, match=r"key 'c' is not one of this KeyedJaggedTensor's keys \['a', 'b'\]"):
        kjt["c"]
    with pytest.raises(ValueError, match=r"indices\[1\] must be a key index in \[0, 2\), got indices\[1\]=2"):
        kjt.permute([0, 2])
    with pytest.raises(ValueError, match=r"indices\[0\] must be a key index in \[0, 2\), got indices\[0\]=-1"):
        kjt.permute([-1])
    with pytest.raises(ValueError, match=r"segments must sum to the number of keys \(2\), got \[1, 2\]"):
        kjt.split([1, 2])
    with pytest.raises(ValueError, match=r"segments\[0\] must be a non-negative int, got segments\[0\]=-1"):
        kjt.split([-1, 3])
    with pytest.raises(ValueError, match="has no weights"):
        kjt.weights()
    with pytest.raises(ValueError, match="kjt_list must hold at least one"):
        KeyedJaggedTensor.concat([])
    with pytest.raises(ValueError, match="mixes weighted and unweighted"):
        KeyedJaggedTensor.concat([kjt, _kjt(weights=torch.rand(8))])
    with pytest.raises(ValueError, match=r"must share one stride, got strides \[2, 3\]"):
        KeyedJaggedTensor.concat([kjt, KeyedJaggedTensor(["c"], torch.arange(2.0), lengths=torch.tensor([1, 1]))])


def test_jagged_tensor_errors() -> None:
    with pytest.raises(ValueError, match="lengths or offsets must be given"):
        JaggedTensor(VALUES)
    with pytest.raises(ValueError, match=r"sum\(lengths\) = 9 exceeds the number of values \(8\)"):
        JaggedTensor(VALUES, lengths=torch.tensor([4, 5]))
    with pytest.raises(ValueError, match=r"weights must have one entry per value \(8\)"):
        JaggedTensor(VALUES, weights=torch.rand(3), lengths=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="desired_length must be a non-negative int"):
        JaggedTensor(VALUES, lengths=torch.tensor([4, 4])).to_padded_dense(desired_length=-1)
    with pytest.raises(ValueError, match="lengths may not exceed the padded length 2"):
        JaggedTensor.from_dense_lengths(torch.zeros(2, 2), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"weights must have one tensor per bag \(1\)"):
        JaggedTensor.from_dense([torch.zeros(1)], weights=[])


def test_value_checks_can_be_switched_off() -> None:
    """Production GPU jobs may skip the syncing value checks; metadata checks still run."""
    set_value_checks(False)
    try:
        kjt = _kjt(values=VALUES[:6])  # would fail the sum(lengths) check
        assert kjt.keys() == ["a", "b"]
        with pytest.raises(ValueError, match="not divisible by the 2 keys"):
            _kjt(lengths=torch.tensor([1, 1, 1]))
    finally:
        set_value_checks(None)
