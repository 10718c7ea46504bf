"""Rank-side codec cases: every comm op of comm_cases.py through every codec that ``get_qcomm_codecs`` builds, on
"unit" data (magnitudes in [1, 2], random signs), plus the wire sizes computed independently from the protocol.

Error bound of one decoded value (|x| in [1, 2], so every quantization row has its max in [1, 2]):

* fp32: 0. fp16: half an ulp, ``2**-11 * |x| <= 2**-10``. bf16: ``2**-8 * 2 = 2**-7``.
* fp8 rows: the power-of-two row scale keeps every value of a row normal (the row's values are within a factor 2),
  so half an ulp of a 3-bit (E4M3, forward) or 2-bit (E5M2, backward) mantissa: ``2**-4 * 2`` and ``2**-3 * 2``.
* int8 rows: half a step of ``(max - min) / 255`` with ``max - min <= 4``; plus fp32 rounding of scale and bias.
* mx4 groups: the shared exponent ``e`` is the smallest with ``max / 2**e <= 6``, so scaled magnitudes lie in
  (1.5, 6]; half a step of the E2M1 grid there is at most ``1 * 2**e`` for values in [4, 6] (then ``2**e <= |x| / 4
  <= 0.5``) and ``0.5 * 2**e <= 1/3`` below 4: at most 0.5.
* error feedback: its first send of a call site adds a zero residual, so the wrapped format's bound applies.

An output that sums ``k`` decoded pieces (reduce-scatter forward, all-gather backward) may be off by ``k`` bounds;
gradients are then divided by the world size like the values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.comm_cases import build_op_cases, run_case
from tritonrec.dist.comm_ops import alltoall_pooled, variable_batch_alltoall_pooled
from tritonrec.dist.qcomm_codec import CommType
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs

# name -> (config, bound of a forward value, bound of a backward value)
CODECS: dict[str, tuple[QCommsConfig, float, float]] = {
    "fp32": (QCommsConfig(), 0.0, 0.0),
    "fp16": (QCommsConfig(CommType.FP16, CommType.FP16), 2**-10, 2**-10),
    "bf16": (QCommsConfig(CommType.BF16, CommType.BF16), 2**-7, 2**-7),
    "fp8": (QCommsConfig(CommType.FP8, CommType.FP8), 2**-3, 2**-2),
    "int8": (QCommsConfig(CommType.INT8, CommType.INT8), 4 / 510 + 1e-5, 4 / 510 + 1e-5),
    "mx4": (QCommsConfig(CommType.MX4, CommType.MX4), 0.5, 0.5),
    "int8_error_feedback": (
        QCommsConfig(CommType.INT8, CommType.INT8, error_feedback=True),
        4 / 510 + 1e-5,
        4 / 510 + 1e-5,
    ),
}

# The exactness cases that add nothing for codecs (same wire path as another case) are left out to save time.
_SKIPPED = {"alltoall_pooled/no_gradient_division", "reduce_scatter_base_pooled/1d", "alltoallv/per_rank_split_lengths"}


def codec_op_cases(world: int) -> list[Any]:
    return [case for case in build_op_cases(world) if case.name not in _SKIPPED]


def _padded(codec: Any, ctx: Any, widths: list[int]) -> list[int]:
    return [codec.padded_size(torch.empty(1, w), widths, r, ctx)[0] for r, w in enumerate(widths)]


def _wire_checks(rank: int, world: int, config: QCommsConfig) -> dict[str, Any]:
    """Split sizes on the wire, recomputed from the protocol: ``calc_quantized_size(rows * padded width)`` per rank,
    for the pooled all-to-all (widths ``D_r`` not multiples of any row size) and the flat variable-batch one."""
    batch, dims = [3] * world, [5, 3, 7, 1][:world]
    codecs = get_qcomm_codecs(config)
    x = torch.ones(sum(batch), dims[rank], requires_grad=True)
    request = alltoall_pooled(x, batch, dims, codecs=codecs)
    out = request.wait()
    out.backward(torch.ones_like(out))
    fwd, bwd = codecs.forward, codecs.backward
    fwd_ctx, bwd_ctx = fwd.create_context(), bwd.create_context()
    fwd_widths, bwd_widths = _padded(fwd, fwd_ctx, dims), _padded(bwd, bwd_ctx, dims)
    expected_fwd_send = [fwd.calc_quantized_size(b * fwd_widths[rank], fwd_ctx) for b in batch]
    expected_fwd_recv = [fwd.calc_quantized_size(batch[rank] * w, fwd_ctx) for w in fwd_widths]
    expected_bwd_send = [bwd.calc_quantized_size(batch[rank] * w, bwd_ctx) for w in bwd_widths]
    expected_bwd_recv = [bwd.calc_quantized_size(b * bwd_widths[rank], bwd_ctx) for b in batch]
    flat_len = [5, 0, 33, 2][:world]  # per destination; flat chunks are padded one by one
    flat = torch.ones(sum(flat_len))
    vb = variable_batch_alltoall_pooled(
        flat, [[n] for n in flat_len], [flat_len[rank]] * world, [[1]] * world, codecs=codecs
    )
    vb.wait()
    flat_ctx = fwd.create_context()
    expected_flat = [fwd.calc_quantized_size(_padded(fwd, flat_ctx, [n])[0], flat_ctx) for n in flat_len]
    f, b, v = request.forward_traffic, request.backward_traffic, vb.forward_traffic
    return {
        "forward_send": f.send_splits == expected_fwd_send,
        "forward_recv": f.recv_splits == expected_fwd_recv,
        "backward_send": b.send_splits == expected_bwd_send,
        "backward_recv": b.recv_splits == expected_bwd_recv,
        "flat_send": v.send_splits == expected_flat,
        "wire_dtype": f.dtype == fwd.quantized_dtype and b.dtype == bwd.quantized_dtype,
        "bytes": f.send_bytes == sum(expected_fwd_send) * torch.empty(0, dtype=fwd.quantized_dtype).element_size(),
        "padding_used": config.forward_precision not in (CommType.FP8, CommType.INT8, CommType.MX4)
        or fwd_widths != dims,
        "detail": (f.send_splits, expected_fwd_send, b.send_splits, expected_bwd_send, v.send_splits, expected_flat),
    }


def run_codec_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (config, _, _) in CODECS.items():
        per_case = {}
        for case in codec_op_cases(world):
            outcome = run_case(case, rank, world, dist.group.WORLD, "unit", get_qcomm_codecs(config))
            per_case[case.name] = {
                "forward_err": outcome["forward"]["max_err"],
                "grad_err": outcome["grad"]["max_err"],
                "forward_exact": outcome["forward"]["exact"],
                "forward_sums": case.forward_sums,
                "backward_sums": case.backward_sums,
                "division": case.gradient_division,
            }
        per_case["wire"] = _wire_checks(rank, world, config)
        results[name] = per_case
    return results
