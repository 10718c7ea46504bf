"""The backward plan's row fingerprints: CUDA's elementwise form (int32 products summed in int64) keeps the same low
32 bits as CPU's integer matmul, for every bit pattern (negative, extreme, NaN payloads) and odd widths."""

from __future__ import annotations

import pytest
import torch

from tritonrec.kernels.embedding.grad_plan import _column_keys, _halves_elementwise, row_fingerprints


@pytest.mark.parametrize("width", [1, 3, 64, 129])
def test_elementwise_halves_equal_the_matmul_halves(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    bits = torch.randint(-(2**31), 2**31, (37, width), dtype=torch.int64, generator=g).to(torch.int32)
    bits[0] = torch.iinfo(torch.int32).min
    bits[1] = torch.iinfo(torch.int32).max
    bits[2] = -1
    keys = _column_keys(width, bits.device)
    matmul = (keys @ bits.t()).long() & 0xFFFFFFFF
    elementwise = _halves_elementwise(bits, keys) & 0xFFFFFFFF
    assert torch.equal(elementwise, matmul)
    # exact reference: the true products summed in Python integers, reduced modulo 2**32
    exact = [[sum(int(k) * int(b) for k, b in zip(key.tolist(), row.tolist(), strict=True)) % 2**32
              for row in bits] for key in keys]  # fmt: skip
    assert elementwise.tolist() == exact


def test_fingerprints_depend_on_the_row_bits_only() -> None:
    rows = torch.randn(8, 5)
    rows[3] = float("nan")
    again = rows.clone()
    assert torch.equal(row_fingerprints(rows), row_fingerprints(again))
    changed = rows.clone()
    changed[4, 2] = torch.nextafter(changed[4, 2], torch.tensor(float("inf")))
    differs = row_fingerprints(changed) != row_fingerprints(rows)
    assert differs.tolist() == [i == 4 for i in range(8)]
