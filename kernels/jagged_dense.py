"""Jagged <-> padded dense conversion, differentiable both ways (FBGEMM's ``jagged_to_padded_dense`` and
``dense_to_jagged`` for one jagged dimension).

Layouts: ``values`` is ``[N]`` or ``[N, D]`` with bag ``b`` at rows ``offsets[b]:offsets[b + 1]``; the dense side is
``[B, max_len]`` or ``[B, max_len, D]``. A bag longer than ``max_len`` keeps its first ``max_len`` rows (``max_len``
is the caller's explicit truncation length, as in FBGEMM and torchrec's ``to_padded_dense``); converting back gives
zeros for the rows that were cut. Rows of ``values`` past ``offsets[-1]`` are never read.

Each op's backward is the other op, so ``jagged_to_padded_dense`` then ``dense_to_jagged`` is the identity on
everything that fits. Both are ``torch.ops.tritonrec`` custom ops (:mod:`tritonrec.kernels.library`).
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, grid_programs, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import check_int, check_offsets, check_optional_int, check_same_device, check_tensor
from tritonrec.kernels.library import custom_op, dynamic_size


def _tile_configs() -> list:
    # BLOCK_D is chosen by the launcher from D; the tile height and warps are what is tuned.
    return [triton.Config({"BLOCK_L": bl}, num_warps=w) for bl, w in ((16, 4), (4, 2), (64, 8), (128, 8))]


def _tile_fits(config: dict, args: dict) -> bool:
    """At most 32 values of a [BLOCK_L, BLOCK_D] tile per thread: the 128-row tile at BLOCK_D 128 (64 per thread)
    reached 255 registers and spilled (python -m tritonrec.kernels.aot)."""
    return config["BLOCK_L"] * args["BLOCK_D"] <= 32 * 32 * config["num_warps"]


@autotune(configs=_tile_configs(), key=["L_BUCKET", "D_BUCKET", "BLOCK_D"], fits=_tile_fits)
@triton.jit
def _jagged_to_padded_dense_kernel(
    values_ptr,
    offsets_ptr,
    out_ptr,
    padding_ptr,
    B,
    max_len,
    D,
    L_BUCKET,
    D_BUCKET,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Programs stride over the [BLOCK_L, BLOCK_D] tiles of the dense output, numbered bag-major then row block then
    column block, so one grid axis covers any size (see ``grid_programs``)."""
    row_blocks = tl.cdiv(max_len, BLOCK_L)
    col_blocks = tl.cdiv(D, BLOCK_D)
    tiles = B.to(tl.int64) * row_blocks * col_blocks
    for tile in range(tl.program_id(0).to(tl.int64), tiles, tl.num_programs(0)):
        bag = tile // (row_blocks * col_blocks)
        rows = (tile // col_blocks) % row_blocks * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tile % col_blocks * BLOCK_D + tl.arange(0, BLOCK_D)
        start = tl.load(offsets_ptr + bag).to(tl.int64)
        length = tl.load(offsets_ptr + bag + 1).to(tl.int64) - start
        col_ok = cols[None, :] < D
        from_values = (rows[:, None] < length) & col_ok
        src = values_ptr + (start + rows[:, None]) * D + cols[None, :]
        tile_values = tl.load(src, mask=from_values, other=0)
        tile_values = tl.where(from_values, tile_values, tl.load(padding_ptr))
        dst = out_ptr + (bag * max_len + rows[:, None]) * D + cols[None, :]
        tl.store(dst, tile_values, mask=(rows[:, None] < max_len) & col_ok)


@autotune(configs=_tile_configs(), key=["S_BUCKET", "D_BUCKET", "BLOCK_D"], fits=_tile_fits)
@triton.jit
def _dense_to_jagged_kernel(
    dense_ptr,
    offsets_ptr,
    out_ptr,
    B,
    S,
    D,
    S_BUCKET,
    D_BUCKET,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Programs stride over (bag, column block) pairs; each walks its bag's rows, rows at or past S (the dense
    length) become zeros."""
    col_blocks = tl.cdiv(D, BLOCK_D)
    for item in range(tl.program_id(0).to(tl.int64), B.to(tl.int64) * col_blocks, tl.num_programs(0)):
        bag = item // col_blocks
        cols = item % col_blocks * BLOCK_D + tl.arange(0, BLOCK_D)
        start = tl.load(offsets_ptr + bag).to(tl.int64)
        length = tl.load(offsets_ptr + bag + 1).to(tl.int64) - start
        col_ok = cols[None, :] < D
        for r0 in range(0, length, BLOCK_L):
            rows = r0 + tl.arange(0, BLOCK_L)
            in_bag = (rows[:, None] < length) & col_ok
            src = dense_ptr + (bag * S + rows[:, None]) * D + cols[None, :]
            tile = tl.load(src, mask=in_bag & (rows[:, None] < S), other=0)
            tl.store(out_ptr + (start + rows[:, None]) * D + cols[None, :], tile, mask=in_bag)


def _row_width(t: torch.Tensor, first_feature_dim: int = 1) -> int:
    """Elements per row once the trailing feature dims are flattened (1 when there are none)."""
    width = 1
    for size in t.shape[first_feature_dim:]:
        width *= size
    return width


def _block_d(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), 128)


def _padding_tensor(padding_value: float, like: torch.Tensor) -> torch.Tensor:
    """The padding value rounded by torch into the values' dtype, passed by pointer: exact for int64 and fp64 too,
    and independent of how the kernel would round a float scalar argument."""
    return torch.full((1,), padding_value, dtype=like.dtype, device=like.device)


def _jagged_to_padded_dense_triton(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float
) -> torch.Tensor:
    batch, d = offsets.numel() - 1, _row_width(values)
    values_2d = values.reshape(values.shape[0], d).contiguous()
    out = torch.empty((batch, max_len, d), dtype=values.dtype, device=values.device)
    if out.numel():
        block_d = _block_d(d)
        tiles = lambda meta: batch * triton.cdiv(max_len, meta["BLOCK_L"]) * triton.cdiv(d, block_d)
        _jagged_to_padded_dense_kernel[lambda meta: (grid_programs(tiles(meta)),)](
            values_2d,
            offsets.contiguous(),
            out,
            _padding_tensor(padding_value, values),
            batch,
            max_len,
            d,
            pow2_bucket(max_len),
            pow2_bucket(d),
            BLOCK_D=block_d,
        )
    return out.reshape(batch, max_len, *values.shape[1:])


def _dense_to_jagged_triton(
    dense: torch.Tensor, offsets: torch.Tensor, total_len: int, zero_tail: bool = False
) -> torch.Tensor:
    """``zero_tail``: ``total_len`` may exceed ``offsets[-1]`` and the rows past it (which no bag writes) are zeros;
    a zero-filled allocation costs less than reading ``offsets[-1]`` back from the device."""
    batch, s = dense.shape[0], dense.shape[1]
    d = _row_width(dense, first_feature_dim=2)
    dense_3d = dense.reshape(batch, s, d).contiguous()
    out = (torch.zeros if zero_tail else torch.empty)((total_len, d), dtype=dense.dtype, device=dense.device)
    if batch and d and total_len:
        block_d = _block_d(d)
        _dense_to_jagged_kernel[(grid_programs(batch * triton.cdiv(d, block_d)),)](
            dense_3d, offsets.contiguous(), out, batch, s, d, pow2_bucket(s), pow2_bucket(d), BLOCK_D=block_d
        )
    return out.reshape(total_len, *dense.shape[2:])


def jagged_to_padded_dense_reference(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0
) -> torch.Tensor:
    """The specification: ``[N, *]`` values + ``[B + 1]`` offsets -> ``[B, max_len, *]``, padded, truncated.

    One gather: every output cell reads its value, or a padding row appended after the values. (index_select is
    torch's only row-wise memcpy gather on CPU; filling the padded cells afterwards with index_fill_/masked_fill_
    or scattering into a pre-filled output runs element by element and costs more than the one extra copy.)
    """
    batch = offsets.numel() - 1
    pad_row = int(offsets[-1].item())
    # src[b, j] = offsets[b] + j, or the padding row once that reaches the next bag: three passes over [B, max_len],
    # kept in the offsets' dtype (index_select takes int32 indices as they are).
    index_dtype = offsets.dtype if pad_row + max_len <= torch.iinfo(offsets.dtype).max else torch.int64
    src = offsets[:-1, None].to(index_dtype) + torch.arange(max_len, device=offsets.device, dtype=index_dtype)
    src.masked_fill_(src >= offsets[1:, None].to(index_dtype), pad_row)
    source = torch.cat([values[:pad_row], values.new_full((1, *values.shape[1:]), padding_value)])
    return source.index_select(0, src.view(-1)).view(batch, max_len, *values.shape[1:])


def dense_to_jagged_reference(dense: torch.Tensor, offsets: torch.Tensor, total_len: int | None = None) -> torch.Tensor:
    """The specification: ``[B, S, *]`` dense + ``[B + 1]`` offsets -> ``[total_len, *]`` jagged values.

    Row ``j`` of bag ``b`` is ``dense[b, j]`` for ``j < S`` and zero past the dense length. One gather.
    """
    total = int(offsets[-1].item()) if total_len is None else total_len
    batch, dense_len = dense.shape[0], dense.shape[1]
    starts = offsets[:-1].to(torch.int64)
    lengths = offsets[1:].to(torch.int64) - starts
    rows = dense.reshape(batch * dense_len, *dense.shape[2:])
    # Value i of bag b reads dense row b * S + (i - offsets[b]): one per-bag shift repeated over the bag, plus i.
    shift = torch.arange(batch, device=dense.device).mul_(dense_len).sub_(starts)
    src = torch.repeat_interleave(shift, lengths, output_size=total)
    src.add_(torch.arange(total, device=dense.device))
    if total and bool((lengths > dense_len).any()):  # bags longer than the dense length: those rows are zeros
        if not rows.shape[0]:
            return dense.new_zeros((total, *dense.shape[2:]))
        bag_end = torch.arange(1, batch + 1, device=dense.device).mul_(dense_len)
        beyond = src >= torch.repeat_interleave(bag_end, lengths, output_size=total)  # position >= S
        out = rows.index_select(0, src.masked_fill_(beyond, 0))
        # index_fill_ on the cut rows: ~5x faster than masked_fill_ with a mask broadcast over the feature dims.
        return out.index_fill_(0, beyond.nonzero().view(-1), 0)
    return rows.index_select(0, src)


# --------------------------------------------------------------------------------------------------- the ops
# Value checks run inside the implementations (real tensors, also in compiled graphs); the public functions only
# check metadata.


@custom_op("jagged_to_padded_dense")
def _jagged_to_padded_dense_op(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float, backend: str
) -> torch.Tensor:
    check_offsets(offsets, "offsets", capacity=values.shape[0])
    run = _jagged_to_padded_dense_triton if backend == "triton" else jagged_to_padded_dense_reference
    return run(values, offsets, max_len, padding_value)


@_jagged_to_padded_dense_op.register_fake
def _(values, offsets, max_len, padding_value, backend):
    return values.new_empty((offsets.shape[0] - 1, max_len, *values.shape[1:]))


@custom_op("jagged_to_padded_dense_backward")
def _jagged_to_padded_dense_backward_op(
    grad_dense: torch.Tensor, offsets: torch.Tensor, num_values: int, backend: str
) -> torch.Tensor:
    """``[B, S, *]`` -> ``[num_values, *]``: the gradient of every values row, zero for rows past ``offsets[-1]``
    (never read by the forward)."""
    grad_dense = grad_dense.contiguous()
    if backend == "triton":
        return _dense_to_jagged_triton(grad_dense, offsets, num_values, zero_tail=True)
    grad = dense_to_jagged_reference(grad_dense, offsets)
    if grad.shape[0] == num_values:
        return grad
    return torch.cat([grad, grad.new_zeros((num_values - grad.shape[0], *grad.shape[1:]))])


@_jagged_to_padded_dense_backward_op.register_fake
def _(grad_dense, offsets, num_values, backend):
    return grad_dense.new_empty((num_values, *grad_dense.shape[2:]))


def _jagged_to_padded_dense_setup(ctx, inputs, output) -> None:
    values, offsets, _, _, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.num_values, ctx.backend = values.shape[0], backend


def _jagged_to_padded_dense_grad(ctx, grad_dense):
    (offsets,) = ctx.saved_tensors
    grad = torch.ops.tritonrec.jagged_to_padded_dense_backward(grad_dense, offsets, ctx.num_values, ctx.backend)
    return grad, None, None, None, None


_jagged_to_padded_dense_op.register_autograd(_jagged_to_padded_dense_grad, setup_context=_jagged_to_padded_dense_setup)


def _backward_setup(ctx, inputs, output) -> None:
    grad_dense, offsets, _, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.dense_len, ctx.backend = grad_dense.shape[1], backend


def _backward_grad(ctx, grad_grad_values):
    """The backward is linear in ``grad_dense``: its own gradient pads back (double backward)."""
    (offsets,) = ctx.saved_tensors
    grad = torch.ops.tritonrec.jagged_to_padded_dense(
        grad_grad_values.contiguous(), offsets, ctx.dense_len, 0.0, ctx.backend
    )
    return grad, None, None, None


_jagged_to_padded_dense_backward_op.register_autograd(_backward_grad, setup_context=_backward_setup)


@custom_op("dense_to_jagged")
def _dense_to_jagged_op(
    dense: torch.Tensor, offsets: torch.Tensor, total_len: int | None, backend: str
) -> torch.Tensor:
    check_offsets(offsets, "offsets", total=total_len)
    total = int(offsets[-1].item()) if total_len is None else total_len
    run = _dense_to_jagged_triton if backend == "triton" else dense_to_jagged_reference
    return run(dense.contiguous(), offsets, total)


@_dense_to_jagged_op.register_fake
def _(dense, offsets, total_len, backend):
    total = dynamic_size() if total_len is None else total_len
    return dense.new_empty((total, *dense.shape[2:]))


def _dense_to_jagged_setup(ctx, inputs, output) -> None:
    dense, offsets, _, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.dense_len, ctx.backend = dense.shape[1], backend


def _dense_to_jagged_grad(ctx, grad_values):
    (offsets,) = ctx.saved_tensors
    grad = torch.ops.tritonrec.jagged_to_padded_dense(
        grad_values.contiguous(), offsets, ctx.dense_len, 0.0, ctx.backend
    )
    return grad, None, None, None


_dense_to_jagged_op.register_autograd(_dense_to_jagged_grad, setup_context=_dense_to_jagged_setup)


def _check_jagged(values: torch.Tensor, offsets: torch.Tensor, values_name: str = "values") -> None:
    check_tensor(values, values_name, ndim=(1, 2))
    check_tensor(offsets, "offsets", ndim=1, integer=True)
    check_same_device(**{values_name: values, "offsets": offsets})
    if offsets.numel() == 0:
        raise ValueError("offsets must have B + 1 >= 1 entries, got an empty tensor")


def jagged_to_padded_dense(
    values: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    padding_value: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``values [N] | [N, D]``, ``offsets [B + 1]`` -> ``[B, max_len] | [B, max_len, D]`` (differentiable in values).

    Bags shorter than ``max_len`` are padded with ``padding_value``; longer bags keep their first ``max_len`` rows.
    The gradient has ``values``' full shape: rows past ``offsets[-1]`` (never read) get zeros.
    """
    _check_jagged(values, offsets)
    max_len = check_int(max_len, "max_len", 0)
    resolved = resolve_backend(backend, values, offsets)
    return _jagged_to_padded_dense_op(values, offsets, max_len, float(padding_value), resolved)


def dense_to_jagged(
    dense: torch.Tensor, offsets: torch.Tensor, total_len: int | None = None, backend: Backend = "auto"
) -> torch.Tensor:
    """``dense [B, S] | [B, S, D]``, ``offsets [B + 1]`` -> jagged ``[total_len] | [total_len, D]`` (differentiable).

    ``total_len`` defaults to ``offsets[-1]`` (passing it avoids a device sync; under ``torch.compile`` the length
    is then an unbacked size). Rows past the dense length ``S`` are zeros.
    """
    check_tensor(dense, "dense", ndim=(2, 3))
    check_tensor(offsets, "offsets", ndim=1, integer=True)
    check_same_device(dense=dense, offsets=offsets)
    if offsets.numel() != dense.shape[0] + 1:
        raise ValueError(
            f"offsets must have B + 1 = {dense.shape[0] + 1} entries for dense of shape "
            f"{tuple(dense.shape)}, got {offsets.numel()}"
        )
    total_len = check_optional_int(total_len, "total_len", 0)
    return _dense_to_jagged_op(dense, offsets, total_len, resolve_backend(backend, dense, offsets))
