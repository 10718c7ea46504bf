"""Tables for inference as torchrec's quantized EBC stores them: row-wise INT8 / INT4 / INT2 codes, or FP16 / FP32.

Each row is stored as ``ceil(D * bits / 8)`` bytes. Row-wise quantized (``bits`` 8, 4, 2): codes packed ``8 / bits``
to a byte, column ``c`` in bits ``(c % (8 / bits)) * bits`` of byte ``c * bits // 8`` (INT4: the even column in the
low nibble), plus an fp16 ``scale`` and ``bias`` per row; ``value = code * scale + bias`` in fp32. FP16 / FP32
(``bits`` 16, 32): the row's little-endian float bytes (FP16: the float weights rounded to nearest), no scale or
bias. Quantization follows
FBGEMM's row-wise rule: ``bias = fp16(min(row))``, ``scale = fp16((max(row) - bias) / (2**bits - 1))`` (1 when the
row is constant or the scale is not representable), ``code = clamp(round((x - bias) * (1 / scale)), 0,
2**bits - 1)`` with the fp32 reciprocal (as FBGEMM: dividing instead rounds a few ties the other way).

The lookup runs the pooled forward kernel with ``QUANT_BITS`` set (same tiling, same order of sums as the float
path; FP16 / FP32 bytes are read as float storage); the torch twin dequantizes only the gathered rows and pools them
with ``embedding_bag``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonrec.kernels.backend import Backend, resolve_backend
from tritonrec.kernels.checks import check_same_device, check_tensor, value_checks_enabled
from tritonrec.kernels.embedding import op_checks
from tritonrec.kernels.embedding.layout import (
    BoundsCheckMode,
    PoolingMode,
    TableBatchedLayout,
    feature_value_offsets,
    layout_from_op_key,
)
from tritonrec.kernels.embedding.lookup_grads import bounds_checked
from tritonrec.kernels.embedding.pooled_forward import launch_pooled_forward
from tritonrec.kernels.library import custom_op

QUANT_BIT_WIDTHS = (32, 16, 8, 4, 2)
FLOAT_BIT_DTYPES = {32: torch.float32, 16: torch.float16}  # stored as float bytes, no scale / bias


def row_bytes(dim: int, bits: int) -> int:
    """Bytes of codes per row."""
    return (dim * bits + 7) // 8


def _check_bits(bits: object) -> int:
    if bits not in QUANT_BIT_WIDTHS:
        raise ValueError(f"bits must be one of {QUANT_BIT_WIDTHS}, got bits={bits!r}")
    return bits  # type: ignore[return-value]


def has_scale_bias(bits: int) -> bool:
    """Whether tables of ``bits`` carry a per-row fp16 scale and bias (row-wise quantized, not FP16 / FP32)."""
    return bits not in FLOAT_BIT_DTYPES


def float_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """FP16 / FP32 bytes ``[..., D * bits / 8]`` uint8 -> ``[..., D]`` of the float dtype (a view when aligned)."""
    dtype = FLOAT_BIT_DTYPES[bits]
    codes = codes.contiguous()
    if codes.storage_offset() % dtype.itemsize:
        codes = codes.clone()  # a dtype view needs an element-aligned start
    return codes.view(dtype)


def quantize_rowwise(
    table: torch.Tensor, bits: int, *, name: str = "table"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[rows, D]`` float -> (codes ``[rows, row_bytes]`` uint8, scale ``[rows]`` fp16, bias ``[rows]`` fp16);
    FP16 / FP32 (``bits`` 16, 32): the rows' float bytes and empty scale / bias (NaN / inf kept, as torch's cast).

    Row-wise (INT) quantization refuses (value check, ``ValueError`` naming ``name`` and the row) a row holding NaN /
    inf or whose minimum or range / levels overflows fp16: its scale / bias cannot represent it, and FBGEMM's codes
    for such a row are garbage (a NaN ignored by its min / max, an inf turning the whole row into NaN)."""
    check_tensor(table, name, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _check_bits(bits)
    rows, dim = table.shape
    empty = torch.zeros(0, dtype=torch.float16, device=table.device)
    if bits in FLOAT_BIT_DTYPES:
        stored = table.to(FLOAT_BIT_DTYPES[bits]).contiguous()  # round to nearest (torchrec's tensor.half())
        return stored.view(torch.uint8).reshape(rows, row_bytes(dim, bits)).clone(), empty, empty.clone()
    x = table.float()
    levels = (1 << bits) - 1
    if rows == 0:
        return torch.zeros(0, row_bytes(dim, bits), dtype=torch.uint8, device=table.device), empty, empty.clone()
    bias = x.amin(dim=1).half()
    scale = ((x.amax(dim=1) - bias.float()) / levels).half()
    if value_checks_enabled():
        _check_representable(x, scale, bias, name)
    unusable = (scale == 0) | ~torch.isfinite(scale) | ~torch.isfinite(1.0 / scale.float())
    scale = torch.where(unusable, torch.ones_like(scale), scale)
    inverse_scale = 1.0 / scale.float()  # FBGEMM multiplies by the fp32 reciprocal: same codes on ties
    codes = torch.round((x - bias.float()[:, None]) * inverse_scale[:, None]).clamp(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte > 1:
        codes = F.pad(codes, (0, -dim % per_byte))  # the last byte's unused high bits stay 0
        packed = codes[:, 0::per_byte].clone()
        for k in range(1, per_byte):
            packed |= codes[:, k::per_byte] << (k * bits)
        codes = packed
    return codes.contiguous(), scale, bias


def _check_representable(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, name: str) -> None:
    """Every row of ``x`` finite, with a finite fp16 scale and bias (one host read on the happy path)."""
    bad = ~torch.isfinite(x).all(dim=1) | ~torch.isfinite(scale) | ~torch.isfinite(bias)
    if bool(bad.any()):
        row = int(bad.nonzero()[0].item())
        values = x[row]
        what = "holds NaN or inf" if not bool(torch.isfinite(values).all()) else "overflows fp16's scale / bias"
        raise ValueError(
            f"{name}: row {row} {what} (min {values.amin().item()}, max {values.amax().item()}): row-wise quantization "
            "needs finite rows whose minimum and range / levels fit fp16"
        )


def dequantize_rowwise(
    codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dim: int, bits: int
) -> torch.Tensor:
    """The inverse: ``[rows, row_bytes]`` codes + per-row fp16 scale / bias -> ``[rows, dim]`` fp32 (FP16 / FP32:
    the float bytes, ``scale`` / ``bias`` unused)."""
    if bits in FLOAT_BIT_DTYPES:
        return float_rows(codes, bits)[:, :dim].float()
    per_byte = 8 // bits
    if per_byte > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        unpacked = (codes[:, :, None] >> shifts) & ((1 << bits) - 1)
        unpacked = unpacked.reshape(codes.shape[0], codes.shape[1] * per_byte)[:, :dim]
    else:
        unpacked = codes[:, :dim]
    return unpacked.float() * scale.float()[:, None] + bias.float()[:, None]


@dataclass
class QuantizedTables:
    """Quantized tables batched like :class:`TableBatchedLayout`: flat ``codes`` (table ``t`` at
    ``byte_offsets[t]``, ``row_bytes(dim, bits)`` bytes per row) and flat per-row ``scale`` / ``bias`` indexed by
    global row (empty for FP16 / FP32 tables)."""

    layout: TableBatchedLayout
    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        check_tensor(self.codes, "codes", ndim=1, dtypes=(torch.uint8,))
        check_tensor(self.scale, "scale", ndim=1, dtypes=(torch.float16,))
        check_tensor(self.bias, "bias", ndim=1, dtypes=(torch.float16,))
        if self.codes.numel() != self.byte_offsets[-1]:
            raise ValueError(f"codes must hold {self.byte_offsets[-1]} bytes for this layout, got {self.codes.numel()}")
        for name, t in (("scale", self.scale), ("bias", self.bias)):
            if not has_scale_bias(self.bits) and t.numel():
                raise ValueError(f"{name} must be empty for {self.bits}-bit float tables, got {t.numel()} entries")
            if has_scale_bias(self.bits) and t.numel() != self.layout.num_rows:
                raise ValueError(f"{name} must hold one entry per row ({self.layout.num_rows}), got {t.numel()}")

    @property
    def byte_offsets(self) -> list[int]:
        out = [0]
        for spec in self.layout.tables:
            out.append(out[-1] + spec.num_rows * row_bytes(spec.dim, self.bits))
        return out

    @staticmethod
    def from_float(layout: TableBatchedLayout, tables: list[torch.Tensor], bits: int) -> QuantizedTables:
        """Quantize ``tables[t]`` (``[rows_t, dim_t]``) and pack them in layout order."""
        parts = [
            quantize_rowwise(t, bits, name=f"table {spec.name!r}" if spec.name else f"tables[{i}]")
            for i, (t, spec) in enumerate(zip(tables, layout.tables, strict=True))
        ]
        return QuantizedTables(
            layout,
            bits,
            torch.cat([p[0].reshape(-1) for p in parts]),
            torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]),
        )

    def table_codes(self, t: int) -> torch.Tensor:
        spec, start = self.layout.tables[t], self.byte_offsets[t]
        width = row_bytes(spec.dim, self.bits)
        return self.codes[start : start + spec.num_rows * width].view(spec.num_rows, width)

    def table_scale_bias(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``t``'s ``[rows]`` scale and bias (empty for FP16 / FP32)."""
        if not has_scale_bias(self.bits):
            return self.scale, self.bias
        r0, r1 = self.layout.table_row_offsets[t], self.layout.table_row_offsets[t + 1]
        return self.scale[r0:r1], self.bias[r0:r1]

    def dequantized(self, t: int) -> torch.Tensor:
        """Table ``t`` dequantized to ``[rows, dim]`` fp32 (the reference the lookups must match)."""
        return dequantize_rowwise(self.table_codes(t), *self.table_scale_bias(t), self.layout.tables[t].dim, self.bits)

    def to(self, device: torch.device | str) -> QuantizedTables:
        return QuantizedTables(
            self.layout, self.bits, self.codes.to(device), self.scale.to(device), self.bias.to(device)
        )


def _quantized_triton(
    q: QuantizedTables, indices, offsets, per_sample_weights, bag_divisors, batch_size: int
) -> torch.Tensor:
    layout, device = q.layout, q.codes.device
    if q.bits in FLOAT_BIT_DTYPES:  # float bytes: the float path, offsets and strides in elements
        storage, unit, quant = float_rows(q.codes, q.bits), q.bits // 8, None
    else:
        storage, unit, quant = q.codes, 1, (q.scale, q.bias, q.bits)
    storage_offsets = torch.tensor([q.byte_offsets[t] // unit for t in layout.feature_tables], device=device)
    strides = torch.tensor(
        [row_bytes(layout.tables[t].dim, q.bits) // unit for t in layout.feature_tables], device=device
    )
    return launch_pooled_forward(
        storage,
        layout,
        indices,
        offsets,
        per_sample_weights,
        bag_divisors,
        batch_size,
        storage_offsets,
        strides,
        quant=quant,
    )


def quantized_pooled_lookup_reference(
    q: QuantizedTables,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    batch_size: int,
) -> torch.Tensor:
    """The specification: per feature, dequantize the gathered rows (out-of-range rows are zero) and pool them."""
    layout = q.layout
    out = torch.empty((batch_size, layout.total_dim), dtype=torch.float32, device=q.codes.device)
    if out.numel() == 0:
        return out
    starts = feature_value_offsets(offsets, layout.num_features, batch_size)
    for f, t in enumerate(layout.feature_tables):
        spec = layout.tables[t]
        idx = indices[starts[f] : starts[f + 1]].long()
        ok = (idx >= 0) & (idx < spec.num_rows)
        safe = torch.where(ok, idx, 0)
        scale, bias = q.table_scale_bias(t)
        if spec.num_rows:
            if has_scale_bias(q.bits):
                scale, bias = scale[safe], bias[safe]
            rows = dequantize_rowwise(q.table_codes(t)[safe], scale, bias, spec.dim, q.bits)
        else:
            rows = torch.zeros(idx.numel(), spec.dim, device=idx.device)
        psw = ok.float() if per_sample_weights is None else per_sample_weights[starts[f] : starts[f + 1]].float() * ok
        bag_offsets = offsets[f * batch_size : (f + 1) * batch_size + 1] - starts[f]
        pooled = F.embedding_bag(
            torch.arange(idx.numel(), device=idx.device),
            rows if idx.numel() else rows.new_zeros(1, spec.dim),
            bag_offsets.long(),
            mode="sum",
            per_sample_weights=psw,
            include_last_offset=True,
        )
        if spec.pooling == PoolingMode.MEAN:
            lengths = (bag_offsets[1:] - bag_offsets[:-1]).float()
            divisor = lengths if bag_divisors is None else bag_divisors[f * batch_size : (f + 1) * batch_size].float()
            pooled = torch.where(divisor[:, None] > 0, pooled / divisor.clamp(min=1e-30)[:, None], 0.0)
        col = layout.feature_out_offsets[f]
        out[:, col : col + spec.dim] = pooled
    return out


def quantized_pooled_lookup(
    q: QuantizedTables,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    bag_divisors: torch.Tensor | None = None,
    *,
    bounds_check: BoundsCheckMode = BoundsCheckMode.FATAL,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Pooled lookup on row-wise quantized tables: ``[B, layout.total_dim]`` fp32 (inference only, no autograd).

    Arguments as in :func:`~tritonrec.kernels.embedding.pooled.pooled_embedding_lookup`.
    """
    if not isinstance(q, QuantizedTables):
        raise TypeError(f"q must be QuantizedTables, got {type(q).__name__}")
    layout = op_checks.check_layout(q.layout)
    op_checks.check_indices(indices)
    batch_size = op_checks.check_pooled_offsets(offsets, layout)
    op_checks.check_per_value(per_sample_weights, "per_sample_weights", indices.numel())
    op_checks.check_bag_divisors(bag_divisors, layout, batch_size)
    check_same_device(
        codes=q.codes,
        indices=indices,
        offsets=offsets,
        per_sample_weights=per_sample_weights,
        bag_divisors=bag_divisors,
    )
    op_checks.check_bounds_mode(bounds_check)
    resolved = resolve_backend(backend, q.codes, indices)
    with torch.no_grad():  # inference only: the op has no autograd formula
        return _quantized_lookup_op(
            q.codes,
            q.scale,
            q.bias,
            indices,
            offsets,
            per_sample_weights,
            bag_divisors,
            layout.op_key,
            q.bits,
            bounds_check.value,
            resolved,
        )


@custom_op("quantized_pooled_lookup")
def _quantized_lookup_op(
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bag_divisors: torch.Tensor | None,
    layout: str,
    bits: int,
    bounds_check: str,
    backend: str,
) -> torch.Tensor:
    q = QuantizedTables(layout_from_op_key(layout), bits, codes, scale, bias)
    batch_size = (offsets.numel() - 1) // q.layout.num_features
    starts = op_checks.checked_feature_starts(offsets, bag_divisors, indices.numel(), q.layout.num_features, batch_size)
    bounds_checked(q.layout, indices, starts, bounds_check)
    if backend == "triton":
        return _quantized_triton(q, indices, offsets, per_sample_weights, bag_divisors, batch_size)
    return quantized_pooled_lookup_reference(q, indices, offsets, per_sample_weights, bag_divisors, batch_size)


@_quantized_lookup_op.register_fake
def _(codes, scale, bias, indices, offsets, per_sample_weights, bag_divisors, layout, bits, bounds_check, backend):
    lay = layout_from_op_key(layout)
    return codes.new_empty(((offsets.shape[0] - 1) // lay.num_features, lay.total_dim), dtype=torch.float32)
