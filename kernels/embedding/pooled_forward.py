"""Table-batched pooled forward: every feature's bags, one launch, one ``[B, sum(D)]`` output.

Inputs are a KJT's flat tensors: ``indices [N]`` key-major, ``offsets [F * B + 1]`` (bag ``f * B + b`` holds
``indices[offsets[f * B + b]:offsets[f * B + b + 1]]``), optional ``per_sample_weights [N]``. Feature ``f`` reads
table ``layout.feature_tables[f]`` and writes columns ``layout.feature_out_offsets[f]:... + D_f`` of the output.

Pooling is SUM (optionally weighted) plus, for MEAN tables, a division by a per-bag divisor: the local bag length
by default, or ``bag_divisors [F * B]`` supplied by the caller (a row-wise shard passes the global bag length).
A bag whose divisor is 0 pools to zero. Rows are read in the weights' dtype and accumulated in fp32; the output is
fp32. Any ``D >= 1`` works (columns are masked, no multiple-of-4 rule).

Triton: grid ``(cdiv(B, BAGS), F, cdiv(max D, BLOCK_D))``; a program pools ``BAGS`` bags of one feature at once,
walking their positions ``BLOCK_L`` at a time as a ``[BAGS, BLOCK_L, BLOCK_D]`` tile, so short bags share a
program instead of each paying a launch slot (autotune picks the split between bags and positions). The same
kernel reads row-wise INT8 / INT4 / INT2 storage (``QUANT_BITS``, see
:mod:`~tritonrec.kernels.embedding.quantized`), so quantized lookups pool in exactly the float path's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import autotune, pow2_bucket
from tritonrec.kernels.embedding.layout import PoolingMode, TableBatchedLayout, feature_value_offsets


def _pooled_forward_configs() -> list:
    # (BAGS, BLOCK_L): many short bags per program first, one long bag per program last; each with 4 and 8 warps,
    # of which _pooled_forward_fits keeps the one its tile needs.
    shapes = ((4, 8), (8, 4), (16, 2), (32, 1), (2, 16), (1, 32), (8, 8))
    return [triton.Config({"BAGS": b, "BLOCK_L": ll}, num_warps=w) for w in (4, 8) for b, ll in shapes]


def _pooled_forward_fits(config: dict, args: dict) -> bool:
    """Keep the warps (4 or 8, the fewest that do) that hold the [BAGS, BLOCK_L, BLOCK_D] tile plus the [BAGS,
    BLOCK_D] accumulator at 20 values per thread; beyond that, ptxas reached 255 registers and spilled at BLOCK_D
    128 on sm_80 / sm_90 (python -m tritonrec.kernels.aot), so wider shapes do not fit."""
    values = config["BAGS"] * (config["BLOCK_L"] + 1) * args["BLOCK_D"]
    needed = next((w for w in (4, 8) if values <= 20 * 32 * w), None)
    return config["num_warps"] == needed


@triton.jit
def load_rows(storage_ptr, scale_ptr, bias_ptr, row_start, global_row, row_ok, cols, mask, QUANT_BITS: tl.constexpr):
    """``[BAGS, BLOCK_L, BLOCK_D]`` fp32 tile of rows (``row_start``, ``global_row`` and ``row_ok`` are
    ``[BAGS, BLOCK_L]``). Float storage: element ``row_start + col``. Row-wise quantized storage (8, 4 or 2 bits):
    byte ``row_start + col * bits // 8`` holds the code in bits ``(col % (8 / bits)) * bits`` (low bits first) and the
    row's fp16 scale and bias dequantize it as ``code * scale + bias`` (the product is exact in fp32, so only the add
    rounds)."""
    if QUANT_BITS == 0:
        return tl.load(storage_ptr + row_start[:, :, None] + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        if QUANT_BITS == 8:
            code = tl.load(storage_ptr + row_start[:, :, None] + cols, mask=mask, other=0).to(tl.int32)
        else:
            # 8 / QUANT_BITS codes a byte, the lowest bits first
            packed = tl.load(storage_ptr + row_start[:, :, None] + cols // (8 // QUANT_BITS), mask=mask, other=0)
            code = (packed.to(tl.int32) >> ((cols % (8 // QUANT_BITS)) * QUANT_BITS)) & ((1 << QUANT_BITS) - 1)
        scale = tl.load(scale_ptr + global_row, mask=row_ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + global_row, mask=row_ok, other=0.0).to(tl.float32)
        return tl.where(mask, code.to(tl.float32) * scale[:, :, None] + bias[:, :, None], 0.0)


@autotune(
    configs=_pooled_forward_configs(),
    key=["B_BUCKET", "L_BUCKET", "BLOCK_D", "HAS_WEIGHTS", "QUANT_BITS"],
    fits=_pooled_forward_fits,
)
@triton.jit
def _pooled_forward_kernel(
    storage_ptr,
    scale_ptr,
    bias_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    divisors_ptr,
    out_ptr,
    feature_storage_offsets_ptr,
    feature_row_strides_ptr,
    feature_row_offsets_ptr,
    feature_rows_ptr,
    feature_dims_ptr,
    feature_out_offsets_ptr,
    feature_mean_ptr,
    B,
    out_stride,
    B_BUCKET,
    L_BUCKET,
    HAS_WEIGHTS: tl.constexpr,
    HAS_DIVISORS: tl.constexpr,
    QUANT_BITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    feature = tl.program_id(1).to(tl.int64)
    dim = tl.load(feature_dims_ptr + feature).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    if tl.program_id(2) * BLOCK_D < dim:  # features narrower than the widest table skip the extra column blocks
        samples = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
        sample_ok = samples < B
        bags = feature * B + samples
        starts = tl.load(offsets_ptr + bags, mask=sample_ok, other=0).to(tl.int64)
        lengths = tl.load(offsets_ptr + bags + 1, mask=sample_ok, other=0).to(tl.int64) - starts
        table_start = tl.load(feature_storage_offsets_ptr + feature)
        row_stride = tl.load(feature_row_strides_ptr + feature)
        first_row = tl.load(feature_row_offsets_ptr + feature)
        num_rows = tl.load(feature_rows_ptr + feature)
        col_ok = cols < dim
        acc = tl.zeros((BAGS, BLOCK_D), dtype=tl.float32)
        for pos0 in range(0, tl.max(lengths, axis=0), BLOCK_L):
            pos = pos0 + tl.arange(0, BLOCK_L)
            in_bag = pos[None, :] < lengths[:, None]
            value = starts[:, None] + pos[None, :]
            idx = tl.load(indices_ptr + value, mask=in_bag, other=0).to(tl.int64)
            # out-of-range rows (bounds modes WARNING / IGNORE) count as zero rows and are never read
            row_ok = in_bag & (idx >= 0) & (idx < num_rows)
            tile = load_rows(
                storage_ptr,
                scale_ptr,
                bias_ptr,
                table_start + idx * row_stride,
                first_row + idx,
                row_ok,
                cols[None, None, :],
                row_ok[:, :, None] & col_ok[None, None, :],
                QUANT_BITS,
            )
            if HAS_WEIGHTS:
                w = tl.load(psw_ptr + value, mask=row_ok, other=0.0).to(tl.float32)
                tile = tile * w[:, :, None]
            acc += tl.sum(tile, axis=1)
        if tl.load(feature_mean_ptr + feature) != 0:
            if HAS_DIVISORS:
                divisor = tl.load(divisors_ptr + bags, mask=sample_ok, other=0.0).to(tl.float32)
            else:
                divisor = lengths.to(tl.float32)
            acc = tl.where(divisor[:, None] > 0, tl.div_rn(acc, tl.maximum(divisor, 1e-30)[:, None]), 0.0)
        out_col = tl.load(feature_out_offsets_ptr + feature).to(tl.int64) + cols
        tl.store(
            out_ptr + samples[:, None] * out_stride + out_col[None, :],
            acc,
            mask=sample_ok[:, None] & col_ok[None, :],
        )


def block_d_for(max_dim: int) -> int:
    """Column tile: the whole row up to 128 columns, then 128-wide blocks (one grid column each)."""
    return min(triton.next_power_of_2(max(max_dim, 1)), 128)


def launch_pooled_forward(
    storage: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    batch_size: int,
    feature_storage_offsets: torch.Tensor,
    feature_row_strides: torch.Tensor,
    quant: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Launch the pooled kernel on float storage (``quant=None``) or row-wise quantized storage
    (``quant=(scale, bias, bits)``); strides and offsets are in storage units (elements or bytes)."""
    meta = layout.tensors(storage.device)
    out = torch.empty((batch_size, layout.total_dim), dtype=torch.float32, device=storage.device)
    if out.numel() == 0:
        return out
    # the kernel reads these as flat arrays: strided views (a KJT's sliced values) must be made dense first
    indices, offsets = indices.contiguous(), offsets.contiguous()
    per_sample_weights = None if per_sample_weights is None else per_sample_weights.contiguous()
    bag_divisors = None if bag_divisors is None else bag_divisors.contiguous()
    storage = storage.contiguous()
    if quant is not None:
        quant = (quant[0].contiguous(), quant[1].contiguous(), quant[2])
    block_d = block_d_for(layout.max_dim)
    avg_len = indices.numel() // max(batch_size * layout.num_features, 1)
    grid = lambda cfg: (triton.cdiv(batch_size, cfg["BAGS"]), layout.num_features, triton.cdiv(layout.max_dim, block_d))
    scale, bias, bits = quant if quant is not None else (storage, storage, 0)
    _pooled_forward_kernel[grid](
        storage,
        scale,
        bias,
        indices,
        offsets,
        indices if per_sample_weights is None else per_sample_weights,
        offsets if bag_divisors is None else bag_divisors,
        out,
        feature_storage_offsets,
        feature_row_strides,
        meta.feature_row_offsets,
        meta.feature_rows,
        meta.feature_dims,
        meta.feature_out_offsets,
        meta.feature_mean,
        batch_size,
        out.stride(0),
        pow2_bucket(batch_size),
        pow2_bucket(avg_len),
        HAS_WEIGHTS=per_sample_weights is not None,
        HAS_DIVISORS=bag_divisors is not None,
        QUANT_BITS=bits,
        BLOCK_D=block_d,
    )
    return out


def pooled_forward_triton(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    batch_size: int,
) -> torch.Tensor:
    meta = layout.tensors(weights.device)
    return launch_pooled_forward(
        weights,
        layout,
        indices,
        offsets,
        per_sample_weights,
        bag_divisors,
        batch_size,
        meta.feature_weight_offsets,
        meta.feature_dims.long(),
    )


def _sum_bags(
    table: torch.Tensor, rows: torch.Tensor, bag_offsets: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """``[num_bags, D]`` fp32 sums of ``table`` rows (``bag_offsets`` has ``num_bags + 1`` entries)."""
    if table.dtype != torch.float32:  # gather the rows first: converting the whole table would cost a full copy
        table, rows = table.index_select(0, rows).float(), torch.arange(rows.numel(), device=rows.device)
    if table.shape[0] == 0:  # every index was out of range (weights are 0): pool zero rows
        table, rows = table.new_zeros(1, table.shape[1]), torch.zeros_like(rows)
    return F.embedding_bag(
        rows, table, bag_offsets.to(rows.dtype), mode="sum", per_sample_weights=weights, include_last_offset=True
    )


def _bag_divisors(
    layout: TableBatchedLayout, offsets: torch.Tensor, bag_divisors: torch.Tensor | None, batch_size: int
) -> torch.Tensor:
    """``[F * B]`` divisor of every bag: its MEAN divisor (local length or the caller's), 1 for SUM features."""
    divisor = (offsets[1:] - offsets[:-1]).float() if bag_divisors is None else bag_divisors.float()
    is_mean = torch.tensor(
        [layout.tables[t].pooling == PoolingMode.MEAN for t in layout.feature_tables], device=offsets.device
    )
    return torch.where(is_mean.repeat_interleave(batch_size), divisor, 1.0)


def pooled_forward_reference(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    batch_size: int,
    all_rows_valid: bool = False,
) -> torch.Tensor:
    """The specification (see the module docstring): ``[B, layout.total_dim]`` fp32.

    Bags are summed by ``embedding_bag`` (mode sum, fp32); when all tables share one dim this is a single call on
    the flat buffer viewed as ``[num_rows, D]`` with global row numbers, else one call per feature. Out-of-range
    indices pool as zero rows (weight 0) unless ``all_rows_valid`` says they were already checked.
    """
    out = torch.empty((batch_size, layout.total_dim), dtype=torch.float32, device=weights.device)
    if out.numel() == 0:
        return out
    starts = feature_value_offsets(offsets, layout.num_features, batch_size)
    psw = None if per_sample_weights is None else per_sample_weights.float()
    rows = indices.long()
    valid = None
    if not all_rows_valid:
        bounds = torch.tensor([layout.tables[t].num_rows for t in layout.feature_tables], device=indices.device)
        valid = (rows >= 0) & (rows < bounds.repeat_interleave(torch.tensor(starts).diff().to(indices.device)))
        if bool(valid.all()):
            valid = None
        else:
            rows = torch.where(valid, rows, 0)
            psw = valid.float() if psw is None else psw * valid
    has_mean = any(layout.tables[t].pooling == PoolingMode.MEAN for t in layout.feature_tables)
    divisors = _bag_divisors(layout, offsets, bag_divisors, batch_size) if has_mean else None
    dims = {spec.dim for spec in layout.tables}
    if len(dims) == 1:
        dim = dims.pop()
        global_rows = torch.empty_like(rows)
        for f, table in enumerate(layout.feature_tables):  # written in place: no copy of all rows first
            span = slice(starts[f], starts[f + 1])
            torch.add(rows[span], layout.table_row_offsets[table], out=global_rows[span])
        pooled = _sum_bags(weights.view(layout.num_rows, dim), global_rows, offsets, psw)
        if divisors is not None:
            pooled = torch.where(divisors[:, None] > 0, pooled / divisors.clamp(min=1e-30)[:, None], 0.0)
        out.view(batch_size, layout.num_features, dim).copy_(
            pooled.view(layout.num_features, batch_size, dim).transpose(0, 1)
        )
        return out
    for f, table in enumerate(layout.feature_tables):
        bags = slice(f * batch_size, (f + 1) * batch_size)
        span = slice(starts[f], starts[f + 1])
        pooled = _sum_bags(
            layout.table_view(weights, table),
            rows[span],
            offsets[f * batch_size : (f + 1) * batch_size + 1] - starts[f],
            None if psw is None else psw[span],
        )
        if divisors is not None:
            pooled = torch.where(divisors[bags, None] > 0, pooled / divisors[bags].clamp(min=1e-30)[:, None], 0.0)
        col = layout.feature_out_offsets[f]
        out[:, col : col + layout.feature_dims[f]] = pooled
    return out
