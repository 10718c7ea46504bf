"""Embedding-table storage: flat CPU buffers backed by transparent huge pages where the OS allows it.

A lookup or a fused update touches rows scattered over the whole table. With 4 KiB pages every row of a table larger
than the TLB's reach (a few MiB) costs a page walk on top of its cache misses; with 2 MiB pages the same table needs
512x fewer translations. On a 2-core Xeon (Linux THP in ``madvise`` mode), one thread, 72.5k sorted unique rows of a
400k x 64 fp32 table: ``index_add_`` 4.1 -> 3.0 ms and an 80k-id ``embedding_bag`` 1.7-2.2 -> 1.1 ms
(``benchmarks/bench_embedding.py`` measures the whole step).

Only the tables are advised (not every large tensor, as torch's process-wide ``THP_MEM_ALLOC_ENABLE=1`` does), and
only before their pages are first touched, so the kernel backs them with huge pages at the first write instead of
collapsing them later. Set ``TRITONREC_HUGE_PAGES=0`` to opt out; off Linux, on a kernel without THP, or under a
container that forbids ``madvise``, the buffer is an ordinary ``torch.empty`` (nothing else changes: only speed).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

# madvise(2) advice value (linux/mman.h); the same on every Linux architecture
_MADV_HUGEPAGE = 14
_HUGE_PAGE_BYTES = 2 << 20
# Below this a table fits the TLB's reach anyway, and a huge page would mostly hold other allocations' bytes.
MIN_HUGE_PAGE_TABLE_BYTES = 8 << 20

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def huge_pages_enabled() -> bool:
    """Whether table buffers are advised to use huge pages here (Linux, and not opted out)."""
    return sys.platform.startswith("linux") and os.environ.get("TRITONREC_HUGE_PAGES", "1") != "0"


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask the kernel to back the 2 MiB-aligned part of ``buffer``'s bytes with transparent huge pages.

    Returns whether the advice was given (False off CPU, below :data:`MIN_HUGE_PAGE_TABLE_BYTES`, off Linux, opted
    out, or refused by the kernel). Only a hint: pages already touched are collapsed later, if ever, by khugepaged.
    """
    nbytes = buffer.numel() * buffer.element_size()
    if buffer.device.type != "cpu" or nbytes < MIN_HUGE_PAGE_TABLE_BYTES or not huge_pages_enabled():
        return False
    madvise = _libc_madvise()
    if not madvise:
        return False
    begin = buffer.data_ptr()
    first = (begin + _HUGE_PAGE_BYTES - 1) & ~(_HUGE_PAGE_BYTES - 1)
    last = (begin + nbytes) & ~(_HUGE_PAGE_BYTES - 1)
    if last <= first:
        return False
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def empty_table_storage(numel: int, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)`` for a table-batched buffer ``[numel]``, advised to use huge
    pages (:func:`advise_huge_pages`) before anything writes it. Contents are uninitialised, as ``torch.empty``."""
    out = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(out)
    return out


def zeros_table_storage(numel: int, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """:func:`empty_table_storage` filled with zeros (per-element optimizer state laid out like the weights)."""
    return empty_table_storage(numel, dtype, device).zero_()
