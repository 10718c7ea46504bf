"""FP16 / BF16 comm encoding: fp32 -> 16-bit floats with an optional loss scale, and back.

Byte layout: the encoded tensor has the input's shape and dtype ``torch.float16`` or ``torch.bfloat16``; each element
is the IEEE binary16 / bfloat16 pattern (little-endian, 2 bytes) of ``input * loss_scale`` rounded to nearest even
(or stochastically). Decode returns ``float(code) / loss_scale``.

Non-finite policy (both formats hold NaN and Inf, so values propagate): NaN -> the canonical quiet NaN (0x7E00 /
0x7FC0), +-Inf -> +-Inf, and a finite value whose scaled magnitude passes the format's max (65504 / 3.39e38) is
clamped to +-max instead of becoming Inf. ``nonfinite="raise"`` rejects NaN/Inf inputs instead.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import check_tensor
from tritonrec.kernels.codecs import bits_reference as ref
from tritonrec.kernels.codecs.bits import minifloat_code, minifloat_value, output_view, split_magnitude
from tritonrec.kernels.codecs.bits import store_output as _store_output
from tritonrec.kernels.codecs.formats import (
    HALF_DTYPES,
    HALF_FORMATS,
    MiniFloat,
    NonFinitePolicy,
    check_float32_input,
    check_format,
    check_nonfinite_policy,
    check_output_dtype,
    check_seed,
    raise_if_nonfinite,
)
from tritonrec.kernels.library import custom_op, seed_arg, seed_from_arg
from tritonrec.kernels.random_bits import random_bits, random_bits_range_int32, stream_key_args


def _elementwise_configs() -> list:
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((2048, 8), (1024, 4), (4096, 8))]


@autotune(configs=_elementwise_configs(), key=["N_BUCKET", "MBITS", "STOCHASTIC", "HAS_SCALE"])
@triton.jit(do_not_specialize=["k1", "k2"])
def _half_encode_kernel(
    x_ptr,
    out_ptr,
    n,
    loss_scale,
    k1,
    k2,
    N_BUCKET,
    HAS_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    INF_CODE: tl.constexpr,
    NAN_CODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[i] = 16-bit code of x[i] * loss_scale; out is the int16 view of the fp16/bf16 output."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x_mag = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    is_inf = x_mag == 0x7F800000
    is_nan = x_mag > 0x7F800000
    if HAS_SCALE:
        x = x * loss_scale
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    # Clamp on the magnitude bits (monotone for finite floats): a finite input that the loss scale pushed past the
    # format's max, or to Inf, saturates instead of turning into Inf.
    mag = tl.minimum(bits & 0x7FFFFFFF, MAX_BITS)
    mag = tl.where(is_inf | is_nan, tl.zeros_like(mag), mag)
    sig, e = split_magnitude(mag)
    if STOCHASTIC:
        rand = random_bits(offsets, k1, k2)
    else:
        rand = mag
    code = minifloat_code(sig, e, rand, MBITS, BIAS, INF_CODE, STOCHASTIC)
    code = tl.where(is_inf, tl.full(code.shape, INF_CODE, tl.uint32), code) | (sign << 15)
    code = tl.where(is_nan, tl.full(code.shape, NAN_CODE, tl.uint32), code)
    tl.store(out_ptr + offsets, code.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@autotune(configs=_elementwise_configs(), key=["N_BUCKET", "IS_BF16", "OUT_KIND", "HAS_SCALE"])
@triton.jit
def _half_decode_kernel(
    q_ptr,
    out_ptr,
    n,
    loss_scale,
    N_BUCKET,
    IS_BF16: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    OUT_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[i] = float(q[i]) / loss_scale; q is the int16 view of the fp16/bf16 codes."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    code = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    if IS_BF16:
        value = (code << 16).to(tl.float32, bitcast=True)
    else:
        mag = code & 0x7FFF
        finite = minifloat_value(mag, 10, 15).to(tl.uint32, bitcast=True)
        special = tl.where(mag == 0x7C00, 0x7F800000, 0x7FC00000).to(tl.uint32)
        value = (tl.where(mag >= 0x7C00, special, finite) | ((code >> 15) << 31)).to(tl.float32, bitcast=True)
    if HAS_SCALE:
        # IEEE division (Triton's default fp32 '/' is approximate on GPUs).
        value = tl.math.div_rn(value, loss_scale)
    _store_output(out_ptr, offsets, mask, value, OUT_KIND)


def check_loss_scale(loss_scale: object) -> float | None:
    """``None`` or a finite positive number, returned rounded to fp32 (what both implementations multiply by)."""
    if loss_scale is None:
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(f"loss_scale must be a float or None, got {type(loss_scale).__name__}")
    scale32 = float(torch.tensor(float(loss_scale), dtype=torch.float32))
    if not (0.0 < scale32 < float("inf")):
        raise ValueError(f"loss_scale must be finite and > 0 in fp32, got loss_scale={loss_scale!r}")
    return scale32


def _quantize_half_triton(
    input: torch.Tensor, fmt: str, loss_scale: float | None, stochastic_rounding: bool, seed: int
) -> torch.Tensor:
    spec = HALF_FORMATS[fmt]
    flat = input.contiguous().reshape(-1)
    out = torch.empty(input.shape, dtype=HALF_DTYPES[fmt], device=input.device)
    n = flat.numel()
    if n:
        k1, k2 = stream_key_args(seed)
        _half_encode_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
            flat,
            out.view(torch.int16).reshape(-1),
            n,
            1.0 if loss_scale is None else loss_scale,
            k1,
            k2,
            pow2_bucket(n),
            HAS_SCALE=loss_scale is not None,
            STOCHASTIC=stochastic_rounding,
            MBITS=spec.mbits,
            BIAS=spec.bias,
            MAX_BITS=spec.max_value_bits,
            INF_CODE=spec.inf_code,
            NAN_CODE=spec.nan_code,
            enable_fp_fusion=False,
        )
    return out


def _dequantize_half_triton(input: torch.Tensor, loss_scale: float | None, output_dtype: torch.dtype) -> torch.Tensor:
    flat = input.contiguous().view(torch.int16).reshape(-1)
    out = torch.empty(input.shape, dtype=output_dtype, device=input.device)
    n = flat.numel()
    if n:
        out_arg, kind = output_view(out)
        _half_decode_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
            flat,
            out_arg.reshape(-1),
            n,
            1.0 if loss_scale is None else loss_scale,
            pow2_bucket(n),
            IS_BF16=input.dtype == torch.bfloat16,
            HAS_SCALE=loss_scale is not None,
            OUT_KIND=kind,
            enable_fp_fusion=False,
        )
    return out


def quantize_half_reference(
    input: torch.Tensor,
    fmt: str = "fp16",
    loss_scale: float | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """The specification of :func:`quantize_half` (``loss_scale`` already rounded to fp32)."""
    spec, dtype = HALF_FORMATS[fmt], HALF_DTYPES[fmt]
    scaled = input if loss_scale is None else input * loss_scale
    if not stochastic_rounding:
        # torch's fp32 -> fp16/bf16 cast is IEEE nearest-even; clamping first keeps finite inputs finite. Tests check
        # this path against the integer one below bit for bit.
        clamped = scaled.clamp(-spec.max_value, spec.max_value)
        if not ref.all_finite(input):
            clamped = torch.where(torch.isinf(input), scaled, clamped)
        return ref.cast_with_canonical_nan(clamped, dtype)
    return _stochastic_half(input, scaled, spec, random_bits_range_int32(input.numel(), seed, input.device))


def _stochastic_half(input: torch.Tensor, scaled: torch.Tensor, spec: MiniFloat, rand: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of :func:`_quantize_half_bits`, computed on the fp32 bits in a few in-place int32 passes.

    For a normal fp32 magnitude ``mag`` whose value is normal in the target too, the integer algorithm reduces to
    ``(mag - rebias + (rand & low_mask)) >> shift`` with constant ``shift = 23 - mbits`` (the carry of the added
    bits runs into the exponent field by itself), and zeros give 0 after a clamp at 0. The rest, fp32 subnormals,
    values below the target's normal range and NaN/Inf inputs, is rare in practice and re-run through the full
    algorithm, on those elements only.
    """
    flat_in = input.reshape(-1)
    # Clamping in fp32 is the integer clamp of the magnitude bits (monotone for finite values), sign kept.
    bits = scaled.reshape(-1).clamp(-spec.max_value, spec.max_value).view(torch.int32)
    mag = bits & 0x7FFFFFFF
    shift = 23 - spec.mbits
    min_normal = (spec.emin + 127) << 23  # magnitude bits of the target's smallest normal
    # Unsigned compare of mag - 1: zero (handled by the fast path) wraps to the top and does not count as rare.
    rare = (mag - 1).bitwise_and_(0x7FFFFFFF) < min_normal - 1
    if not ref.all_finite(flat_in):
        rare |= ~torch.isfinite(flat_in)
    index = rare.nonzero().squeeze(1)  # one scan and one sync, like an any() would cost
    index = index if index.numel() else None
    rand = rand.reshape(-1)
    rand_rare = None if index is None else rand.index_select(0, index)
    code = mag.add_(rand.bitwise_and_((1 << shift) - 1)).sub_((127 - spec.bias) << 23)
    code = torch.bitwise_right_shift(code, shift, out=code).clamp_(min=0)
    # Sign: the arithmetic shift of the fp32 bits gives 0xFFFF8... for negatives; keep bits 15 and up, so that the
    # signed codes land in int16's range and the cast is exact.
    code |= torch.bitwise_right_shift(bits, 16, out=bits).bitwise_and_(-0x8000)
    out = code.to(torch.int16)
    if index is not None:
        fixed = _quantize_half_bits(
            flat_in.index_select(0, index), scaled.reshape(-1).index_select(0, index), spec, rand_rare
        )
        out.index_copy_(0, index, fixed.view(torch.int16))
    return out.view(HALF_DTYPES[spec.name]).view(input.shape)


def _quantize_half_bits(
    input: torch.Tensor, scaled: torch.Tensor, spec: MiniFloat, rand: torch.Tensor | None
) -> torch.Tensor:
    """The integer algorithm of the kernel (stochastic when ``rand`` is given): codes as fp16/bf16 tensors."""
    is_nan = torch.isnan(input)
    is_inf = torch.isinf(input)
    mag, sign = ref.magnitude_bits(scaled.contiguous())
    mag = mag.clamp(max=spec.max_value_bits).masked_fill(is_nan | is_inf, 0)
    sig, e = ref.split_magnitude(mag)
    code = ref.minifloat_code(sig, e, None if rand is None else rand.view(input.shape), spec)
    code = torch.where(is_inf, spec.inf_code, code) | (sign << 15)
    code = torch.where(is_nan, spec.nan_code, code)
    # int32 codes in [0, 2**16) -> the same bits as int16 without relying on out-of-range casts
    return (code - ((code & 0x8000) << 1)).to(torch.int16).view(HALF_DTYPES[spec.name])


def dequantize_half_reference(
    input: torch.Tensor, loss_scale: float | None = None, output_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The specification of :func:`dequantize_half`: exact widening, then IEEE division by the loss scale."""
    value = input.to(torch.float32)
    if loss_scale is not None:
        # Divide by a device tensor, not a Python scalar: CUDA torch turns scalar division into a reciprocal multiply.
        value = value / value.new_tensor(loss_scale)
    return ref.to_output(value, output_dtype)


def quantize_half(
    input: torch.Tensor,
    fmt: str = "fp16",
    *,
    loss_scale: float | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    nonfinite: NonFinitePolicy = "propagate",
    backend: Backend = "auto",
) -> torch.Tensor:
    """fp32 ``input`` (any shape) -> same-shape ``torch.float16`` (``fmt="fp16"``) or ``torch.bfloat16`` codes of
    ``input * loss_scale``. See the module docstring for rounding and the non-finite policy."""
    check_float32_input(input)
    check_format(fmt, HALF_FORMATS)
    scale32 = check_loss_scale(loss_scale)
    check_seed(seed)
    policy = check_nonfinite_policy(nonfinite)
    resolved = resolve_backend(backend, input)
    return _quantize_half_op(input, str(fmt), scale32, bool(stochastic_rounding), seed_arg(seed), policy, resolved)


def dequantize_half(
    input: torch.Tensor,
    *,
    loss_scale: float | None = None,
    output_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``torch.float16`` / ``torch.bfloat16`` codes -> same-shape ``output_dtype`` values divided by ``loss_scale``."""
    check_tensor(input, "input", dtypes=(torch.float16, torch.bfloat16))
    scale32 = check_loss_scale(loss_scale)
    check_output_dtype(output_dtype)
    return _dequantize_half_op(input, scale32, output_dtype, resolve_backend(backend, input))


# --------------------------------------------------------------------------------------------------- the ops
# Gradients are straight-through, as for torch's dtype casts: rounding counts as the identity, so encode passes
# ``grad * loss_scale`` back in fp32 and decode ``grad / loss_scale`` in the codes' dtype.
@custom_op("quantize_half")
def _quantize_half_op(
    input: torch.Tensor,
    fmt: str,
    loss_scale: float | None,
    stochastic_rounding: bool,
    seed: int,
    nonfinite: str,
    backend: str,
) -> torch.Tensor:
    if nonfinite == "raise":
        raise_if_nonfinite(input)
    seed = seed_from_arg(seed)
    if backend == "triton":
        return _quantize_half_triton(input, fmt, loss_scale, stochastic_rounding, seed)
    return quantize_half_reference(input, fmt, loss_scale, stochastic_rounding, seed)


@_quantize_half_op.register_fake
def _(input, fmt, loss_scale, stochastic_rounding, seed, nonfinite, backend):
    return torch.empty_like(input, dtype=HALF_DTYPES[fmt])


def _quantize_half_setup(ctx, inputs, output) -> None:
    ctx.loss_scale = inputs[2]


def _quantize_half_grad(ctx, grad):
    grad = grad.float() if ctx.loss_scale is None else grad.float() * ctx.loss_scale
    return grad, None, None, None, None, None, None


_quantize_half_op.register_autograd(_quantize_half_grad, setup_context=_quantize_half_setup)


@custom_op("dequantize_half")
def _dequantize_half_op(
    input: torch.Tensor, loss_scale: float | None, output_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    if backend == "triton":
        return _dequantize_half_triton(input, loss_scale, output_dtype)
    return dequantize_half_reference(input, loss_scale, output_dtype)


@_dequantize_half_op.register_fake
def _(input, loss_scale, output_dtype, backend):
    return torch.empty_like(input, dtype=output_dtype)


def _dequantize_half_setup(ctx, inputs, output) -> None:
    ctx.loss_scale, ctx.code_dtype = inputs[1], inputs[0].dtype


def _dequantize_half_grad(ctx, grad):
    grad = grad.float() if ctx.loss_scale is None else grad.float() / ctx.loss_scale
    return grad.to(ctx.code_dtype), None, None, None


_dequantize_half_op.register_autograd(_dequantize_half_grad, setup_context=_dequantize_half_setup)
