"""The Triton device functions of :mod:`~tritonrec.kernels.embedding.fused_update`'s kernel, one column block of one
unique row at a time: load the block's weights and summed gradient, rowwise Adagrad's per-row multiplier, and the
update rules themselves (see that module's docstring), rounded to the storage dtype and stored in place.

Kept apart from the kernel so the op module reads kernel, launcher, torch twin; the kernel calls these by their
``_``-prefixed names, imported there.
"""

from __future__ import annotations

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.embedding.rounding import round_fp32_to_storage
from tritonrec.kernels.embedding.row_gradients import segment_grad

# The rules' kernel codes (:func:`~tritonrec.kernels.embedding.optim_state.optim_code`), as ``OPTIM`` compares to them
OPTIM_SGD: tl.constexpr = tl.constexpr(0)
OPTIM_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(1)
OPTIM_ADAM: tl.constexpr = tl.constexpr(2)
OPTIM_ADAGRAD: tl.constexpr = tl.constexpr(3)


@triton.jit
def load_grad_block(
    weights_ptr,
    grad_ptr,
    goff_ptr,
    scale_ptr,
    start,
    end,
    row_start,
    cols,
    col_ok,
    weight_decay,
    HAS_SCALE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One column block of a row: its fp32 weights ``w`` and its summed gradient ``g`` (``[BLOCK_D]`` each), plus
    ``weight_decay * w`` when ``HAS_DECAY``."""
    w = tl.load(weights_ptr + row_start + cols, mask=col_ok, other=0.0).to(tl.float32)
    g = segment_grad(grad_ptr, goff_ptr, scale_ptr, start, end, cols, col_ok, HAS_SCALE, BLOCK_N, BLOCK_D)
    if HAS_DECAY:
        g = g + weight_decay * w
    return w, g


@triton.jit
def update_and_store(
    w,
    g,
    multiplier,
    weights_ptr,
    mom1_ptr,
    mom2_ptr,
    element,
    col_ok,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bias1,
    bias2,
    k1,
    k2,
    OPTIM: tl.constexpr,
    WEIGHT_DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Apply the rule to one column block (rowwise Adagrad uses the row's ``multiplier``), round the new fp32
    weights to storage and store them."""
    if OPTIM == OPTIM_SGD:
        new = w - lr * g
    elif OPTIM == OPTIM_ROWWISE_ADAGRAD:
        new = w - multiplier * g
    elif OPTIM == OPTIM_ADAGRAD:  # FBGEMM's order: m += g*g, then (lr * g) / (sqrt(m) + eps)
        m = tl.load(mom1_ptr + element, mask=col_ok, other=0.0) + g * g
        tl.store(mom1_ptr + element, m, mask=col_ok)
        new = w - tl.div_rn(lr * g, tl.sqrt_rn(m) + eps)
    else:
        m1 = beta1 * tl.load(mom1_ptr + element, mask=col_ok, other=0.0) + one_minus_beta1 * g
        m2 = beta2 * tl.load(mom2_ptr + element, mask=col_ok, other=0.0) + one_minus_beta2 * (g * g)
        tl.store(mom1_ptr + element, m1, mask=col_ok)
        tl.store(mom2_ptr + element, m2, mask=col_ok)
        new = w - lr * tl.div_rn(tl.div_rn(m1, bias1), tl.sqrt_rn(tl.div_rn(m2, bias2)) + eps)
    stored = round_fp32_to_storage(new, element, k1, k2, WEIGHT_DTYPE, STOCHASTIC)
    tl.store(weights_ptr + element, stored, mask=col_ok)


@triton.jit
def rowwise_multiplier(mom1_ptr, state_row, sum_sq, dim, lr, eps):
    """Rowwise Adagrad: accumulate the row's mean square gradient, return ``lr / (sqrt(m) + eps)``."""
    m = tl.load(mom1_ptr + state_row) + tl.div_rn(sum_sq, dim.to(tl.float32))
    tl.store(mom1_ptr + state_row, m)
    return tl.div_rn(lr, tl.sqrt_rn(m) + eps)


@triton.jit
def update_row_block(
    us,
    weights_ptr,
    mom1_ptr,
    mom2_ptr,
    grad_ptr,
    goff_ptr,
    scale_ptr,
    segment_offsets_ptr,
    unique_tables_ptr,
    unique_local_rows_ptr,
    table_weight_offsets_ptr,
    table_row_offsets_ptr,
    table_dims_ptr,
    bias1_ptr,
    bias2_ptr,
    num_unique,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    weight_decay,
    k1,
    k2,
    OPTIM: tl.constexpr,
    WEIGHT_DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Unique rows ``us [ROWS]`` (those ``>= num_unique`` masked off) updated together as one ``[ROWS, BLOCK_D]``
    tile, rows no wider than ``BLOCK_D``. The sums are those of one row at a time with one contribution per step
    (``BLOCK_N = 1``: each run added strictly in order, the same bits) and stochastic rounding draws the same bits
    per element; only rowwise Adagrad's sum of squares is a reduction whose order may differ in its last bit. ROWS
    rows' chains of dependent loads (row -> table -> offsets -> gradient row) are in flight at once, so a program
    keeps ROWS times the bytes in flight."""
    u_ok = us < num_unique
    table = tl.load(unique_tables_ptr + us, mask=u_ok, other=0)
    local_row = tl.load(unique_local_rows_ptr + us, mask=u_ok, other=0)
    dim = tl.load(table_dims_ptr + table).to(tl.int64)
    row_start = tl.load(table_weight_offsets_ptr + table) + local_row * dim
    start = tl.load(segment_offsets_ptr + us, mask=u_ok, other=0)
    count = tl.load(segment_offsets_ptr + us + 1, mask=u_ok, other=0) - start  # 0 for masked rows
    cols = tl.arange(0, BLOCK_D)
    ok = u_ok[:, None] & (cols[None, :] < dim[:, None])
    element = row_start[:, None] + cols[None, :]
    w = tl.load(weights_ptr + element, mask=ok, other=0.0).to(tl.float32)
    g = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for k in range(0, tl.max(count, axis=0)):
        has = k < count
        goff = tl.load(goff_ptr + start + k, mask=has, other=0)
        tile = tl.load(grad_ptr + goff[:, None] + cols[None, :], mask=has[:, None] & ok, other=0.0)
        if HAS_SCALE:
            tile = tile * tl.load(scale_ptr + start + k, mask=has, other=0.0)[:, None]
        g += tile
    if HAS_DECAY:
        g = g + weight_decay * w
    multiplier = tl.zeros((ROWS, 1), dtype=tl.float32)
    if OPTIM == OPTIM_ROWWISE_ADAGRAD:  # rowwise_multiplier per row, masked: a masked lane must not write row 0's state
        state_row = tl.load(table_row_offsets_ptr + table) + local_row
        m = tl.load(mom1_ptr + state_row, mask=u_ok, other=0.0) + tl.div_rn(tl.sum(g * g, axis=1), dim.to(tl.float32))
        tl.store(mom1_ptr + state_row, m, mask=u_ok)
        multiplier = tl.div_rn(lr, tl.sqrt_rn(m) + eps)[:, None]
    bias1 = tl.load(bias1_ptr + table)[:, None]
    bias2 = tl.load(bias2_ptr + table)[:, None]
    update_and_store(
        w, g, multiplier, weights_ptr, mom1_ptr, mom2_ptr, element, ok, lr, eps, beta1, one_minus_beta1, beta2,
        one_minus_beta2, bias1, bias2, k1, k2, OPTIM, WEIGHT_DTYPE, STOCHASTIC,
    )  # fmt: skip


__all__ = [
    "OPTIM_ADAGRAD",
    "OPTIM_ADAM",
    "OPTIM_ROWWISE_ADAGRAD",
    "OPTIM_SGD",
    "load_grad_block",
    "rowwise_multiplier",
    "update_and_store",
    "update_row_block",
]
