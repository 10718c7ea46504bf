"""lengths_to_offsets / offsets_to_lengths refuse what they cannot represent: negative lengths, int32 totals past
2**31 - 1 (which would wrap negative) and decreasing offsets, with errors naming the argument and the position.
The value checks follow ``TRITONREC_VALUE_CHECKS`` like every other op."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels import lengths_to_offsets, offsets_to_lengths, set_value_checks

BACKENDS = ("torch", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_to_offsets_refuses_negative_lengths(backend: str) -> None:
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got -2 at position 1"):
        lengths_to_offsets(torch.tensor([1, -2, 3]), backend=backend)
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got -1 at position 4"):
        lengths_to_offsets(torch.tensor([[1, 2, 3], [0, -1, 2]], dtype=torch.int32), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_to_offsets_refuses_int32_overflow(backend: str) -> None:
    lengths = torch.tensor([2**30, 2**30, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"int32 lengths sum to 2147483653 in row 0, past the int32 maximum"):
        lengths_to_offsets(lengths, backend=backend)
    rows = torch.tensor([[1, 2], [2**31 - 1, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sum to 2147483648 in row 1.*pass int64 lengths"):
        lengths_to_offsets(rows, backend=backend)
    # the same values as int64 are fine, and an int32 total of exactly 2**31 - 1 still fits
    assert lengths_to_offsets(lengths.long(), backend=backend)[-1].item() == 2**31 + 5
    fits = torch.tensor([2**31 - 2, 1, 0], dtype=torch.int32)
    assert lengths_to_offsets(fits, backend=backend).tolist() == [0, 2**31 - 2, 2**31 - 1, 2**31 - 1]


def test_offsets_to_lengths_refuses_decreasing_offsets() -> None:
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, got offsets\[1\] = 3 > offsets\[2\] = 2"):
        offsets_to_lengths(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"offsets\[1\]\[0\] = 5 > offsets\[1\]\[1\] = 4"):
        offsets_to_lengths(torch.tensor([[0, 1, 1], [5, 4, 6]]))
    assert offsets_to_lengths(torch.tensor([2, 2, 7])).tolist() == [0, 5]  # offsets need not start at 0


def test_value_checks_off_skips_the_content_checks() -> None:
    set_value_checks(False)
    try:
        assert lengths_to_offsets(torch.tensor([1, -2, 3]), backend="torch").tolist() == [0, 1, -1, 2]
        assert offsets_to_lengths(torch.tensor([0, 3, 2])).tolist() == [3, -1]
    finally:
        set_value_checks(None)
