"""Table storage on transparent huge pages: which buffers are advised, that the advice reaches the kernel (the VMA's
``hg`` flag in /proc/self/smaps), the opt-out, and that every table-batched allocation site uses it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tritonrec.kernels.embedding.storage import (
    MIN_HUGE_PAGE_TABLE_BYTES,
    advise_huge_pages,
    empty_table_storage,
    zeros_table_storage,
)
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available on this system",
)


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (Linux /proc/self/smaps)."""
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(x, 16) for x in head.split("-"))
            current = begin <= address < end
        elif current and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@needs_thp
def test_a_large_table_buffer_is_advised_and_keeps_its_values() -> None:
    numel = 3 * MIN_HUGE_PAGE_TABLE_BYTES // 4
    buffer = empty_table_storage(numel, torch.float32, "cpu")
    assert buffer.shape == (numel,) and buffer.dtype == torch.float32 and buffer.is_contiguous()
    aligned = (buffer.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
    assert "hg" in _vma_flags(aligned)
    buffer.copy_(torch.arange(numel, dtype=torch.float32))
    assert torch.equal(buffer, torch.arange(numel, dtype=torch.float32))
    zeros = zeros_table_storage(numel, torch.float32, "cpu")
    assert not zeros.any() and "hg" in _vma_flags(zeros.data_ptr() + (4 << 20))


def test_small_buffers_other_devices_and_the_opt_out_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not advise_huge_pages(torch.empty(1024))
    assert not advise_huge_pages(torch.empty(MIN_HUGE_PAGE_TABLE_BYTES // 4, device="meta"))
    monkeypatch.setenv("TRITONREC_HUGE_PAGES", "0")
    assert not advise_huge_pages(torch.empty(MIN_HUGE_PAGE_TABLE_BYTES // 4))
    small = empty_table_storage(10, torch.float16, "cpu")
    assert small.shape == (10,) and small.dtype == torch.float16


@needs_thp
def test_collection_weights_and_adam_state_are_advised() -> None:
    rows = MIN_HUGE_PAGE_TABLE_BYTES // (4 * 16) + 1
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=16, name="t0", feature_names=["f0"])]
    for optim in ("EXACT_ROWWISE_ADAGRAD", "ADAM"):
        ebc = FusedEmbeddingBagCollection(tables, optim, {"lr": 0.1}, backend="torch")
        weight = ebc.embedding_bags["t0"].weight
        assert "hg" in _vma_flags(weight.data_ptr() + (4 << 20))
    (state,) = ebc._fused_states  # the live Adam moments, laid out like the weights
    for moment in (state.momentum1, state.momentum2):
        assert moment.numel() == rows * 16 and "hg" in _vma_flags(moment.data_ptr() + (4 << 20))
