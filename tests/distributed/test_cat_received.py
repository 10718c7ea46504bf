"""``cat_received``: the concatenation of received blocks, a view of the receive buffer when they lie end to end
(in-process: no collectives involved)."""

from __future__ import annotations

import torch

from tritonrec.dist.comm_wire import _unpack, cat_received


def test_blocks_of_one_receive_buffer_concatenate_without_a_copy() -> None:
    received = torch.arange(2 * 3 * 4 + 5 * 4, dtype=torch.float32)
    parts = _unpack(received, [(2 * 3, 4), (0, 4), (5, 4)], None, None, torch.float32)
    out = cat_received(parts)
    assert torch.equal(out, torch.cat(parts)) and out.shape == (11, 4)
    assert out.data_ptr() == received.data_ptr() and out.is_contiguous()
    one_row = received[:8].view(2, 4)[1:]  # a 1-row part: its dim-0 stride is not what a view of 2 rows needs
    tail = received[8:16].view(2, 4)
    assert torch.equal(cat_received([one_row, tail]), torch.cat([one_row, tail]))
    flat = cat_received(list(received[:20].split([3, 7, 0, 10])))
    assert flat.data_ptr() == received.data_ptr() and torch.equal(flat, received[:20])


def test_anything_else_is_an_ordinary_cat() -> None:
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    apart = cat_received([a, b])  # two allocations
    assert torch.equal(apart, torch.cat([a, b])) and apart.data_ptr() not in (a.data_ptr(), b.data_ptr())
    buffer = torch.randn(20)
    swapped = cat_received([buffer[8:16].view(2, 4), buffer[:8].view(2, 4)])  # out of order
    assert torch.equal(swapped, torch.cat([buffer[8:16], buffer[:8]]).view(4, 4))
    strided = buffer[:16].view(4, 4)
    columns = cat_received([strided[:2, :2], strided[2:, :2]])  # not contiguous
    assert torch.equal(columns, strided[:, :2])
    assert torch.equal(cat_received([a]), a) and torch.equal(cat_received([a, a[:0]]), a)
