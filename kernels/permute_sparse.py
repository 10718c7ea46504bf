"""Permute keyed sparse data: FBGEMM's ``permute_2D_sparse_data`` / ``permute_1D_sparse_data``.

``lengths [T, B]`` holds bag lengths per (key, sample); ``values [N, *]`` (and optional ``weights [N, *]``) hold the
bags key-major, so all of key ``t`` is one contiguous span. ``permute [T']`` lists input keys in output order and may
repeat or drop keys. Outputs: ``lengths[permute]`` and the key spans of values/weights concatenated in that order.

Because a key's bags are contiguous on both sides, the copy is per key span, not per bag: the Triton path gives every
output key ``SPLITS`` programs that stride over its span, and the torch twin builds one gather index for all spans.
"""

from __future__ import annotations

import torch

from tritonrec.kernels import checks
from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import Backend, autotune, pow2_bucket, resolve_backend
from tritonrec.kernels.checks import (
    check_index_range,
    check_nonnegative,
    check_optional_int,
    check_same_device,
    check_tensor,
    host_ints,
    value_checks_enabled,
)
from tritonrec.kernels.lengths_to_offsets import _lengths_to_offsets_triton
from tritonrec.kernels.library import custom_op, dynamic_size


@triton.jit
def _key_lengths_kernel(
    lengths_ptr, permute_ptr, out_lengths_ptr, in_key_len_ptr, out_key_len_ptr, T, T_OUT, B, BLOCK: tl.constexpr
):
    """Program i: total of input key i (if i < T); copy row permute[i] to output row i and total it (if i < T_OUT)."""
    i = tl.program_id(0).to(tl.int64)
    if i < T:
        acc = tl.zeros((BLOCK,), dtype=tl.int64)
        for b0 in range(0, B, BLOCK):
            cols = b0 + tl.arange(0, BLOCK)
            acc += tl.load(lengths_ptr + i * B + cols, mask=cols < B, other=0).to(tl.int64)
        tl.store(in_key_len_ptr + i, tl.sum(acc, axis=0))
    if i < T_OUT:
        src_key = tl.load(permute_ptr + i).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.int64)
        for b0 in range(0, B, BLOCK):
            cols = b0 + tl.arange(0, BLOCK)
            row = tl.load(lengths_ptr + src_key * B + cols, mask=cols < B, other=0)
            tl.store(out_lengths_ptr + i * B + cols, row, mask=cols < B)
            acc += row.to(tl.int64)
        tl.store(out_key_len_ptr + i, tl.sum(acc, axis=0))


def _copy_configs() -> list:
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (256, 2), (4096, 8))]


@autotune(configs=_copy_configs(), key=["SPAN_BUCKET", "HAS_WEIGHTS"])
@triton.jit
def _copy_key_spans_kernel(
    values_ptr,
    weights_ptr,
    out_values_ptr,
    out_weights_ptr,
    permute_ptr,
    in_key_offsets_ptr,
    out_key_offsets_ptr,
    out_rows,
    values_width,
    weights_width,
    SPLITS,
    SPAN_BUCKET,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T', SPLITS): program (k, s) copies chunks s, s + SPLITS, ... of output key k's span. Rows at or past
    ``out_rows`` (the output's size) are never written, even when a caller's size was wrong and unchecked."""
    key = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    src_key = tl.load(permute_ptr + key).to(tl.int64)
    src_row = tl.load(in_key_offsets_ptr + src_key)
    dst_row = tl.load(out_key_offsets_ptr + key)
    rows = tl.maximum(tl.minimum(tl.load(out_key_offsets_ptr + key + 1), out_rows) - dst_row, 0)
    n = rows * values_width
    for e0 in range(split * BLOCK, n, SPLITS * BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        chunk = tl.load(values_ptr + src_row * values_width + e, mask=e < n)
        tl.store(out_values_ptr + dst_row * values_width + e, chunk, mask=e < n)
    if HAS_WEIGHTS:
        n_w = rows * weights_width
        for e0 in range(split * BLOCK, n_w, SPLITS * BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            chunk = tl.load(weights_ptr + src_row * weights_width + e, mask=e < n_w)
            tl.store(out_weights_ptr + dst_row * weights_width + e, chunk, mask=e < n_w)


def _width(t: torch.Tensor) -> int:
    """Elements per row of a ``[N, *]`` tensor."""
    return int(torch.Size(t.shape[1:]).numel())


def _permute_2d_triton(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    permuted_lengths_sum: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    (num_keys, batch), num_out = lengths.shape, permute.numel()
    device = lengths.device
    lengths, permute = lengths.contiguous(), permute.contiguous()
    out_lengths = torch.empty((num_out, batch), dtype=lengths.dtype, device=device)
    in_key_len = torch.empty(num_keys, dtype=torch.int64, device=device)
    out_key_len = torch.empty(num_out, dtype=torch.int64, device=device)
    if max(num_keys, num_out):
        block = min(triton.next_power_of_2(max(batch, 1)), 1024)
        _key_lengths_kernel[(max(num_keys, num_out),)](
            lengths, permute, out_lengths, in_key_len, out_key_len, num_keys, num_out, batch, BLOCK=block
        )
    # the key totals are sums of checked lengths: scan them without the public op's value checks (host syncs)
    in_key_offsets = _lengths_to_offsets_triton(in_key_len)
    out_key_offsets = _lengths_to_offsets_triton(out_key_len)
    total = int(out_key_offsets[-1].item()) if permuted_lengths_sum is None else permuted_lengths_sum
    out_values = values.new_empty((total, *values.shape[1:]))
    out_weights = None if weights is None else weights.new_empty((total, *weights.shape[1:]))
    if num_out and total:
        values_c = values.contiguous()
        weights_c = values_c if weights is None else weights.contiguous()
        v_width = _width(values)
        w_width = v_width if weights is None else _width(weights)
        # Enough programs per key to cover its average span with ~4 chunks of 1024 elements each.
        splits = max(1, min(1024, triton.cdiv(total * v_width, num_out * 4096)))
        _copy_key_spans_kernel[(num_out, splits)](
            values_c,
            weights_c,
            out_values,
            out_values if out_weights is None else out_weights,
            permute,
            in_key_offsets,
            out_key_offsets,
            total,
            v_width,
            w_width,
            splits,
            pow2_bucket(total * v_width // num_out),
            HAS_WEIGHTS=weights is not None,
        )
    return out_lengths, out_values, out_weights


def permute_2d_sparse_data_reference(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The specification (see module docstring): ``lengths[permute]`` and the permuted key spans concatenated.

    Each key's values are one contiguous span, so the copy is one ``torch.cat`` of per-key views (memcpy speed on
    CPU; the list has one entry per output key, never per bag). Reads ``T`` per-key totals on the host.
    ``permuted_lengths_sum`` is accepted for FBGEMM compatibility and checked against the result.
    """
    permute_list = permute.tolist()
    out_lengths = lengths.index_select(0, permute.to(device=lengths.device))  # int32 indices are taken as they are
    key_sizes = lengths.sum(dim=1).tolist() if lengths.numel() else [0] * lengths.shape[0]
    used = sum(key_sizes)  # values may carry a slack tail past the last bag
    value_spans = values[:used].split(key_sizes)
    out_values = _cat_spans(value_spans, permute_list, values)
    out_weights = None if weights is None else _cat_spans(weights[:used].split(key_sizes), permute_list, weights)
    if permuted_lengths_sum is not None and permuted_lengths_sum != out_values.shape[0]:
        raise ValueError(
            f"permuted_lengths_sum = {permuted_lengths_sum} but the permuted keys hold {out_values.shape[0]} values"
        )
    return out_lengths, out_values, out_weights


def _cat_spans(spans: tuple[torch.Tensor, ...], order: list[int], like: torch.Tensor) -> torch.Tensor:
    if not order:
        return like.new_empty((0, *like.shape[1:]))
    return torch.cat([spans[k] for k in order])


def _check_permute_inputs(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    permuted_lengths_sum: int | None,
) -> int | None:
    """Raises on a bad argument; returns ``permuted_lengths_sum`` as a Python int (the op's schema takes no numpy
    int)."""
    check_tensor(permute, "permute", ndim=1, integer=True)
    check_tensor(lengths, "lengths", ndim=2, integer=True)
    check_tensor(values, "values", ndim=(1, 2, 3))
    if weights is not None:
        check_tensor(weights, "weights", ndim=(1, 2, 3))
        if weights.shape[0] != values.shape[0]:
            raise ValueError(
                f"weights must have one row per value ({values.shape[0]}), got shape {tuple(weights.shape)}"
            )
    check_same_device(permute=permute, lengths=lengths, values=values, weights=weights)
    return check_optional_int(permuted_lengths_sum, "permuted_lengths_sum", 0)


def _check_permuted_sum(permuted_lengths_sum: int | None, permuted: int) -> None:
    """A caller's ``permuted_lengths_sum`` must be the number of values the permuted keys hold."""
    if permuted_lengths_sum is not None and permuted_lengths_sum != permuted:
        raise ValueError(f"permuted_lengths_sum = {permuted_lengths_sum} but the permuted keys hold {permuted} values")


def _check_permute_values(
    permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, permuted_lengths_sum: int | None = None
) -> int | None:
    """Value checks (read tensor contents): run inside the op, at run time. On an accelerator everything they need is
    read in one host sync, which also reads the number of permuted values (returned; None on the CPU, when the
    checks are off or a side is empty): the Triton path needs that size and would otherwise sync once more for it.
    A given ``permuted_lengths_sum`` is checked against that number (the Triton path sizes its output by it)."""
    if not value_checks_enabled():
        return None
    num_keys = lengths.shape[0]
    if permute.numel() == 0 or lengths.numel() == 0 or checks.reads_are_free(lengths):
        # on the CPU reads are free: the plain checks, without the extra reductions that batch them into one read
        check_index_range(permute, "permute", num_keys, what="number of keys T")
        check_nonnegative(lengths, "lengths")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total > values.shape[0]:
            raise ValueError(f"values has {values.shape[0]} rows but sum(lengths) = {total}")
        if permuted_lengths_sum is not None:
            empty = permute.numel() == 0 or lengths.numel() == 0
            key_sizes = None if empty else lengths.sum(dim=1, dtype=torch.int64)
            _check_permuted_sum(permuted_lengths_sum, 0 if empty else int(key_sizes.index_select(0, permute).sum()))
        return None
    key_sizes = lengths.sum(dim=1, dtype=torch.int64)
    p_low, p_high = torch.aminmax(permute)
    picked = key_sizes.index_select(0, permute.long().clamp(0, num_keys - 1))  # clamped: read before the range check
    p_low, p_high, l_low, total, permuted = host_ints(p_low, p_high, lengths.min(), key_sizes.sum(), picked.sum())
    if p_low < 0 or p_high >= num_keys:
        check_index_range(permute, "permute", num_keys, what="number of keys T")  # names the first bad entry
    if l_low < 0:
        check_nonnegative(lengths, "lengths")
    if total > values.shape[0]:
        raise ValueError(f"values has {values.shape[0]} rows but sum(lengths) = {total}")
    _check_permuted_sum(permuted_lengths_sum, permuted)
    return permuted


def permute_2d_sparse_data(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``permute [T']``, ``lengths [T, B]``, ``values [N, *]``, ``weights [N, *]`` ->
    ``(lengths [T', B], values [N', *], weights [N', *] | None)``; keys may repeat or be dropped.

    Differentiable in floating ``values`` and ``weights`` (the gradient of a repeated key adds up, a dropped key's
    is zero). ``N'`` is ``permuted_lengths_sum`` when given, else read from ``lengths`` (an unbacked size under
    ``torch.compile``).
    """
    permuted_lengths_sum = _check_permute_inputs(permute, lengths, values, weights, permuted_lengths_sum)
    resolved = resolve_backend(backend, lengths, values)
    out = _permute_2d_op(permute, lengths, values, weights, permuted_lengths_sum, resolved)
    return out[0], out[1], out[2] if weights is not None else None


def permute_1d_sparse_data(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Segment permute: ``lengths [S]`` are segment lengths and ``permute [S']`` picks segments. Used for
    variable-batch KJTs, where each key is one segment of ``length_per_key`` values."""
    check_tensor(lengths, "lengths", ndim=1, integer=True)
    out_lengths, out_values, out_weights = permute_2d_sparse_data(
        permute, lengths.reshape(-1, 1), values, weights, permuted_lengths_sum, backend
    )
    return out_lengths.reshape(-1), out_values, out_weights


# --------------------------------------------------------------------------------------------------- the ops
@custom_op("permute_2d_sparse_data")
def _permute_2d_op(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    permuted_lengths_sum: int | None,
    backend: str,
) -> list[torch.Tensor]:
    """``[lengths, values]`` plus ``weights`` when given (an op returns no ``None`` inside a list)."""
    permuted = _check_permute_values(permute, lengths, values, permuted_lengths_sum)
    if backend == "triton":
        size = permuted_lengths_sum if permuted_lengths_sum is not None else permuted
        out_lengths, out_values, out_weights = _permute_2d_triton(permute, lengths, values, weights, size)
    else:
        out_lengths, out_values, out_weights = permute_2d_sparse_data_reference(
            permute, lengths, values, weights, permuted_lengths_sum
        )
    return [out_lengths, out_values] + ([] if out_weights is None else [out_weights])


@_permute_2d_op.register_fake
def _(permute, lengths, values, weights, permuted_lengths_sum, backend):
    total = dynamic_size() if permuted_lengths_sum is None else permuted_lengths_sum
    out = [lengths.new_empty((permute.shape[0], lengths.shape[1])), values.new_empty((total, *values.shape[1:]))]
    return out + ([] if weights is None else [weights.new_empty((total, *weights.shape[1:]))])


@custom_op("permute_2d_sparse_data_backward")
def _permute_2d_backward_op(
    permute: torch.Tensor, lengths: torch.Tensor, grad: torch.Tensor, num_values: int
) -> torch.Tensor:
    """Gradient of the permuted rows ``grad [N', *]`` -> ``[num_values, *]``: every output row adds into the input
    row it was copied from (torch ops on any device: a scatter-add, no kernel of its own)."""
    key_sizes = lengths.sum(dim=1, dtype=torch.int64) if lengths.numel() else lengths.new_zeros(lengths.shape[0])
    in_starts = torch.cumsum(key_sizes, 0).sub_(key_sizes)
    permute = permute.to(device=lengths.device, dtype=torch.int64)
    out_sizes = key_sizes.index_select(0, permute)
    # Output row j of output key k came from input row in_starts[permute[k]] + (j - out_starts[k]).
    shift = in_starts.index_select(0, permute) - (torch.cumsum(out_sizes, 0) - out_sizes)
    source = torch.repeat_interleave(shift, out_sizes, output_size=grad.shape[0])
    source += torch.arange(grad.shape[0], device=grad.device)
    return grad.new_zeros((num_values, *grad.shape[1:])).index_add_(0, source, grad)


@_permute_2d_backward_op.register_fake
def _(permute, lengths, grad, num_values):
    return grad.new_empty((num_values, *grad.shape[1:]))


def _permute_2d_setup(ctx, inputs, output) -> None:
    permute, lengths, values, weights, _, _ = inputs
    ctx.save_for_backward(permute, lengths)
    ctx.num_values = values.shape[0]
    ctx.values_need = values.requires_grad
    ctx.weights_need = weights is not None and weights.requires_grad


def _permute_2d_grad(ctx, grads):
    permute, lengths = ctx.saved_tensors
    back = lambda g: (
        None
        if g is None
        else torch.ops.tritonrec.permute_2d_sparse_data_backward(permute, lengths, g.contiguous(), ctx.num_values)
    )
    grad_values = back(grads[1]) if ctx.values_need else None
    grad_weights = back(grads[2]) if ctx.weights_need else None
    return None, None, grad_values, grad_weights, None, None


_permute_2d_op.register_autograd(_permute_2d_grad, setup_context=_permute_2d_setup)
