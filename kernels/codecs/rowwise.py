"""Shared plumbing of the row-wise codecs (FP8, INT8, MX4): how an input splits into groups of ``row_dim`` values,
the tile each Triton program loads, the encoded / decoded shapes, and the launchers every codec shares.

Group ``g`` of an input viewed as ``[R, C]`` (a 1-D ``[N]`` input is ``[N / row_dim, row_dim]``) is row
``g // K``, columns ``(g % K) * row_dim ...`` with ``K = ceil(C / row_dim)``; columns past ``C`` read as zeros. Its
values sit at positions ``g * row_dim + j`` of the padded flat tensor, which is also the element index the
stochastic-rounding stream uses. Encoded group ``g`` is bytes ``g * unit_bytes ...`` of the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import pow2_bucket
from tritonrec.kernels.codecs.bits import output_view
from tritonrec.kernels.codecs.formats import rowwise_groups
from tritonrec.kernels.random_bits import stream_key_args


def tile_configs() -> list:
    """``ELEMS`` values per program tile, 16 per thread (32-lane warps) in every config: at 32 per thread FP8 and MX4
    encoding reached 255 registers and spilled on sm_80 / sm_90 (python -m tritonrec.kernels.aot)."""
    return [triton.Config({"ELEMS": e}, num_warps=w) for e, w in ((2048, 4), (1024, 2), (4096, 8))]


def groups_per_program(args: dict) -> int:
    return max(1, args["ELEMS"] // args["ROW_P2"])


def chunk_columns(args: dict) -> int:
    """Columns of a tile: the whole group, or for groups wider than ``ELEMS`` (one group per program) a chunk of
    ``ELEMS`` columns that the kernel walks, so a tile never holds more than ``ELEMS`` values at any row width."""
    return min(args["ROW_P2"], args["ELEMS"])


# BLOCK_G groups per program, COLS columns per tile: BLOCK_G * COLS == ELEMS for every row width (4 to 8192).
TILE_HEURISTICS = {"BLOCK_G": groups_per_program, "COLS": chunk_columns}


@triton.jit
def program_groups(num_groups, BLOCK_G: tl.constexpr):
    """This program's group ids ``[BLOCK_G]`` (int64) and which of them exist."""
    group = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    return group, group < num_groups


@triton.jit
def load_group_tile(x_ptr, group, num_groups, cols, groups_per_row, row_stride, row_dim, first, COLS: tl.constexpr):
    """Columns ``first ... first + COLS - 1`` of groups ``group``: column ids ``[COLS]``, the mask of real group
    members, and the values (zeros outside the input, including the zero padding of the last group of a row)."""
    member = first + tl.arange(0, COLS)
    in_group = (group < num_groups)[:, None] & (member < row_dim)[None, :]
    row = group // groups_per_row
    col = (group % groups_per_row)[:, None] * row_dim + member[None, :]
    x = tl.load(x_ptr + row[:, None] * row_stride + col, mask=in_group & (col < cols), other=0.0)
    return member, in_group, x


@triton.jit
def load_le_word(ptr, mask):
    """Four little-endian bytes at ``ptr`` (uint8 pointers, any alignment) as a uint32."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def pack_bytes_le(codes, BLOCK_G: tl.constexpr, COLS: tl.constexpr):
    """``[BLOCK_G, COLS]`` byte codes (uint32 < 256) -> ``[BLOCK_G, COLS / 4]`` little-endian words (int32)."""
    quads = tl.reshape(codes, [BLOCK_G, COLS // 4, 4])
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    return tl.sum(quads << shifts[None, None, :], axis=2).to(tl.int32, bitcast=True)


def row_p2(row_dim: int) -> int:
    """Tile width: the next power of two of ``row_dim`` rounded up to 4 bytes (whole packed words)."""
    return max(4, triton.next_power_of_2(row_dim))


def launch_geometry(input: torch.Tensor, row_dim: int) -> tuple[torch.Tensor, int, int, int, int]:
    """``(input as [R, C] with unit column stride, R, C, K, number of groups R * K)`` for an encode launch."""
    rows, cols, per_row = rowwise_groups(input, row_dim)
    matrix = input.reshape(rows, cols)
    if matrix.stride(-1) != 1:
        matrix = matrix.contiguous()
    return matrix, rows, cols, per_row, rows * per_row


def padded_groups(input: torch.Tensor, row_dim: int) -> torch.Tensor:
    """The torch twins' view of the input: ``[G, row_dim]`` groups, the last group of each row zero-padded."""
    rows, cols, per_row = rowwise_groups(input, row_dim)
    matrix = input.reshape(rows, cols)
    if per_row * row_dim != cols:
        matrix = F.pad(matrix, (0, per_row * row_dim - cols))
    return matrix.reshape(rows * per_row, row_dim)


def encoded_shape(input: torch.Tensor, row_dim: int, unit_bytes: int) -> tuple[int, ...]:
    """1-D ``[N]`` -> ``[N / row_dim * unit_bytes]``; 2-D ``[R, C]`` -> ``[R, ceil(C / row_dim) * unit_bytes]``."""
    rows, _, per_row = rowwise_groups(input, row_dim)
    if input.dim() == 1:
        return (rows * unit_bytes,)
    return (rows, per_row * unit_bytes)


def decoded_shape(encoded: torch.Tensor, units_per_row: int, row_dim: int) -> tuple[int, ...]:
    """Inverse of :func:`encoded_shape` up to the padding: ``[..., units * row_dim]``."""
    return (*encoded.shape[:-1], units_per_row * row_dim)


def launch_encode(
    kernel, input: torch.Tensor, row_dim: int, unit_bytes: int, stochastic: bool, seed: int, *, as_words: bool,
    extra_args: tuple = (), **constexprs,
) -> torch.Tensor:  # fmt: skip
    """Allocate the encoded bytes and run a row-wise encode ``kernel`` over every group, one launch.

    Every encode kernel takes ``(input [R, C], out, num_groups, C, K, row stride, row_dim, *extra_args, k1, k2,
    G_BUCKET)`` plus its constexprs; ``as_words`` passes ``out`` as int32 words (kernels that store whole packed
    words) instead of bytes.
    """
    matrix, _, cols, per_row, num_groups = launch_geometry(input, row_dim)
    out = torch.empty(encoded_shape(input, row_dim, unit_bytes), dtype=torch.uint8, device=input.device)
    if num_groups:
        kernel[lambda meta: (triton.cdiv(num_groups, meta["BLOCK_G"]),)](
            matrix,
            out.view(torch.int32) if as_words else out,
            num_groups,
            cols,
            per_row,
            matrix.stride(0),
            row_dim,
            *extra_args,
            *stream_key_args(seed),
            pow2_bucket(num_groups),
            STOCHASTIC=stochastic,
            ROW_P2=row_p2(row_dim),
            enable_fp_fusion=False,
            **constexprs,
        )
    return out


def launch_decode(
    kernel, input: torch.Tensor, row_dim: int, units: int, output_dtype: torch.dtype, *, extra_args: tuple = (),
    **constexprs,
) -> torch.Tensor:  # fmt: skip
    """Allocate the decoded values and run a row-wise decode ``kernel``: ``(encoded bytes, out, num_groups, row_dim,
    *extra_args, G_BUCKET)`` plus its constexprs and ``OUT_KIND`` (how ``out``'s dtype is stored)."""
    out = torch.empty(decoded_shape(input, units, row_dim), dtype=output_dtype, device=input.device)
    num_groups = out.numel() // row_dim
    if num_groups:
        out_arg, kind = output_view(out)
        kernel[lambda meta: (triton.cdiv(num_groups, meta["BLOCK_G"]),)](
            input.contiguous(),
            out_arg,
            num_groups,
            row_dim,
            *extra_args,
            pow2_bucket(num_groups),
            OUT_KIND=kind,
            ROW_P2=row_p2(row_dim),
            enable_fp_fusion=False,
            **constexprs,
        )
    return out
