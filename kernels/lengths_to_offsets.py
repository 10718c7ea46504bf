"""``lengths_to_offsets``: complete cumulative sum, ``[N] -> [N + 1]`` starting at 0 (FBGEMM's
``asynchronous_complete_cumsum``). A 2-D ``[T, B]`` input gives one complete cumsum per row, ``[T, B + 1]``.

Triton path: one program per row scans its row chunk by chunk, carrying the running total. Rows longer than
``_MULTI_BLOCK_THRESHOLD`` use three launches instead (block totals, a scan of the totals, block-local scans plus
their prefix) so a single long row is not serialised on one SM.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, resolve_backend
from tritonrec.kernels.checks import check_nonnegative, check_tensor, host_ints, value_checks_enabled
from tritonrec.kernels.library import custom_op

# A row with more than this many entries takes the three-launch path (launchers accept an override for tests).
_MULTI_BLOCK_THRESHOLD = 1 << 16
_INT32_MAX = 2**31 - 1


def _scan_configs() -> list:
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (256, 2), (4096, 8))]


@autotune(configs=_scan_configs(), key=["N_BUCKET"])
@triton.jit
def _row_scan_kernel(lengths_ptr, offsets_ptr, N, in_row_stride, out_row_stride, N_BUCKET, BLOCK: tl.constexpr):
    """offsets[row, 0] = 0; offsets[row, i + 1] = sum(lengths[row, :i + 1]). One program per row."""
    row = tl.program_id(0).to(tl.int64)
    src = lengths_ptr + row * in_row_stride
    dst = offsets_ptr + row * out_row_stride
    carry = tl.zeros((), dtype=offsets_ptr.dtype.element_ty)
    tl.store(dst, carry)
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < N
        chunk = tl.load(src + idx, mask=mask, other=0).to(offsets_ptr.dtype.element_ty)
        scanned = tl.cumsum(chunk, axis=0) + carry
        tl.store(dst + 1 + idx, scanned, mask=mask)
        carry += tl.sum(chunk, axis=0)


@triton.jit
def _block_totals_kernel(lengths_ptr, totals_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    chunk = tl.load(lengths_ptr + idx, mask=idx < N, other=0).to(totals_ptr.dtype.element_ty)
    tl.store(totals_ptr + pid, tl.sum(chunk, axis=0))


@triton.jit
def _block_scan_kernel(lengths_ptr, block_offsets_ptr, offsets_ptr, N, BLOCK: tl.constexpr):
    """Scan one block locally and add the complete cumsum of the block totals before it."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    chunk = tl.load(lengths_ptr + idx, mask=mask, other=0).to(offsets_ptr.dtype.element_ty)
    prefix = tl.load(block_offsets_ptr + pid)
    tl.store(offsets_ptr + 1 + idx, tl.cumsum(chunk, axis=0) + prefix, mask=mask)


def _launch_row_scan(lengths_2d: torch.Tensor, offsets_2d: torch.Tensor) -> None:
    rows, n = lengths_2d.shape
    if rows == 0:
        return
    _row_scan_kernel[(rows,)](
        lengths_2d, offsets_2d, n, lengths_2d.stride(0), offsets_2d.stride(0), triton.next_power_of_2(max(n, 1))
    )


def _lengths_to_offsets_triton(
    lengths: torch.Tensor, multi_block_threshold: int = _MULTI_BLOCK_THRESHOLD
) -> torch.Tensor:
    lengths_2d = lengths.reshape(1, -1) if lengths.dim() == 1 else lengths
    lengths_2d = lengths_2d.contiguous()
    rows, n = lengths_2d.shape
    offsets = torch.empty((rows, n + 1), dtype=lengths.dtype, device=lengths.device)
    if rows == 1 and n > multi_block_threshold:
        block = 1024
        num_blocks = triton.cdiv(n, block)
        totals = torch.empty((1, num_blocks), dtype=lengths.dtype, device=lengths.device)
        _block_totals_kernel[(num_blocks,)](lengths_2d, totals, n, BLOCK=block)
        block_offsets = torch.empty((1, num_blocks + 1), dtype=lengths.dtype, device=lengths.device)
        _launch_row_scan(totals, block_offsets)
        offsets[0, 0] = 0
        _block_scan_kernel[(num_blocks,)](lengths_2d, block_offsets, offsets, n, BLOCK=block)
    else:
        _launch_row_scan(lengths_2d, offsets)
    return offsets.reshape(-1) if lengths.dim() == 1 else offsets


def lengths_to_offsets_reference(lengths: torch.Tensor) -> torch.Tensor:
    """The specification: ``[..., N] -> [..., N + 1]``, ``out[..., 0] = 0``, same integer dtype as ``lengths``."""
    offsets = torch.zeros((*lengths.shape[:-1], lengths.shape[-1] + 1), dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, dim=-1, dtype=lengths.dtype, out=offsets[..., 1:])
    return offsets


def _check_lengths_values(lengths: torch.Tensor) -> None:
    """Value checks: no negative length, and int32 row totals that int32 offsets can hold (a cumsum past 2**31 - 1
    would wrap negative). One min/max reduction; the row sums are only taken when the max could overflow."""
    if not value_checks_enabled() or lengths.numel() == 0:
        return
    low, high = host_ints(*torch.aminmax(lengths))
    if low < 0:
        check_nonnegative(lengths, "lengths")  # finds and names the first negative entry
    if lengths.dtype == torch.int32 and high * lengths.shape[-1] > _INT32_MAX:
        totals = lengths.sum(dim=-1, dtype=torch.int64).reshape(-1)
        row = int(totals.argmax())
        if int(totals[row]) > _INT32_MAX:
            raise ValueError(
                f"int32 lengths sum to {int(totals[row])} in row {row}, past the int32 maximum {_INT32_MAX} that int32 "
                "offsets can hold: pass int64 lengths"
            )


def lengths_to_offsets(lengths: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """Complete cumsum of int32/int64 ``lengths`` of shape ``[N]`` (-> ``[N + 1]``) or ``[T, B]`` (-> ``[T, B + 1]``).

    Negative lengths and int32 totals past ``2**31 - 1`` raise ``ValueError`` (value checks, see
    :func:`~tritonrec.kernels.checks.set_value_checks`); the offsets keep the dtype of ``lengths``.
    """
    check_tensor(lengths, "lengths", ndim=(1, 2), integer=True)
    return _lengths_to_offsets_op(lengths, resolve_backend(backend, lengths))


@custom_op("lengths_to_offsets")
def _lengths_to_offsets_op(lengths: torch.Tensor, backend: str) -> torch.Tensor:
    """Integer in, integer out: no autograd formula (nothing to differentiate). The value checks run here, inside
    the op, so compiled graphs reject bad lengths too."""
    _check_lengths_values(lengths)
    if backend == "triton":
        return _lengths_to_offsets_triton(lengths)
    return lengths_to_offsets_reference(lengths)


@_lengths_to_offsets_op.register_fake
def _(lengths, backend):
    return lengths.new_empty((*lengths.shape[:-1], lengths.shape[-1] + 1))


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`lengths_to_offsets` along the last dim: ``[..., N + 1] -> [..., N]``. Offsets need not
    start at 0 but may not decrease (a value check)."""
    check_tensor(offsets, "offsets", ndim=(1, 2), integer=True)
    if offsets.shape[-1] == 0:
        raise ValueError("offsets must hold at least one entry (the leading 0), got an empty tensor")
    lengths = offsets[..., 1:] - offsets[..., :-1]
    if value_checks_enabled() and lengths.numel() and int(lengths.min()) < 0:
        where = [int(i) for i in (lengths < 0).nonzero()[0]]
        at = "".join(f"[{i}]" for i in where[:-1])
        before, after = offsets[(*where[:-1], where[-1])], offsets[(*where[:-1], where[-1] + 1)]
        raise ValueError(
            f"offsets must be non-decreasing, got offsets{at}[{where[-1]}] = {int(before)} > "
            f"offsets{at}[{where[-1] + 1}] = {int(after)}"
        )
    return lengths
