"""Fused optimizer update inside the backward: sum each touched row's gradient once, then update the row in place.

Rules (``g`` = the row's summed gradient, plus ``weight_decay * w`` when weight decay is set, i.e. L2 as in torch):

* EXACT_SGD:             ``w -= lr * g``
* EXACT_ROWWISE_ADAGRAD: ``m += mean(g**2 over the row)``; ``w -= lr * g / (sqrt(m) + eps)`` (FBGEMM's rule; one
  fp32 ``m`` per row)
* ADAM:                  ``m1 = b1*m1 + (1-b1)*g``, ``m2 = b2*m2 + (1-b2)*g**2``;
  ``w -= lr * (m1 / (1 - b1**t)) / (sqrt(m2 / (1 - b2**t)) + eps)`` with ``t`` the table's update count
* EXACT_ADAGRAD:         ``m += g**2`` per element; ``w -= (lr * g) / (sqrt(m) + eps)`` (FBGEMM's rule, in its GPU
  kernel's fp32 order; ``torch.optim.Adagrad`` with ``lr_decay=0`` on the aggregated gradient)

Only rows present in the batch are touched (row-sparse, as FBGEMM and ``SparseAdam``): an absent row keeps its
weights and its state. Optimizer state is fp32 and laid out like the weights: per-row state at the row's global
number, per-element state at the weight's own element offset, so a table shard's state is the same slice.
fp16 / bf16 weights are updated in fp32 and rounded back (to nearest, or stochastically) with
:mod:`~tritonrec.kernels.embedding.rounding`.

Triton: one program per unique row walks its sorted run of contributions (``segment_grad``); when the widest table
fits one column block the gradient is summed once, otherwise (rowwise Adagrad on very wide rows) it is re-summed per
block after a first pass computes the row's mean square; the per-block rules are the device functions of
:mod:`~tritonrec.kernels.embedding.fused_update_rules`. With one contribution per step (the ``BLOCK_N = 1`` config)
and one column block, a program updates a block of rows as one tile instead (``update_row_block``).

Torch twin: chunks of unique rows, each summed by ``embedding_bag``
(:func:`~tritonrec.kernels.embedding.row_sums.iter_row_sums`), updated on the compact rows and written back with one
``index_add_`` (fp32 SGD / either Adagrad) or ``index_copy_``.
"""

from __future__ import annotations

import torch

from tritonrec.kernels._triton import tl, triton
from tritonrec.kernels.backend import autotune, grid_programs
from tritonrec.kernels.embedding.fused_update_rules import OPTIM_ROWWISE_ADAGRAD as _OPTIM_ROWWISE_ADAGRAD
from tritonrec.kernels.embedding.fused_update_rules import load_grad_block as _load_grad_block
from tritonrec.kernels.embedding.fused_update_rules import rowwise_multiplier as _rowwise_multiplier
from tritonrec.kernels.embedding.fused_update_rules import update_and_store as _update_and_store
from tritonrec.kernels.embedding.fused_update_rules import update_row_block as _update_row_block
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan
from tritonrec.kernels.embedding.layout import TableBatchedLayout
from tritonrec.kernels.embedding.optim_state import FusedOptimizerState, OptimType, begin_step, optim_code
from tritonrec.kernels.embedding.rounding import WEIGHT_CODES, round_fp32_to_storage_reference
from tritonrec.kernels.embedding.row_sums import compact_offsets, iter_row_sums
from tritonrec.kernels.random_bits import stream_key_args

# Columns per program above which rows are processed in several column blocks.
MAX_ONE_BLOCK_D = 1024
# Gradient sums the torch twin updates per step and per thread: keeps each core's share of the [rows, D] temporaries
# in its L2 instead of DRAM, while the per-step cost of a dozen small torch ops stays small (on a 2-core Xeon with
# 2 MiB of L2 per core, 2 MiB chunks update ~15% faster than 4 MiB ones or one pass over all rows, and ~5% faster
# than 1 MiB ones).
_CHUNK_BYTES_PER_THREAD = 2 << 20
# With several threads every parallel torch op ends at an OpenMP barrier, and on a machine shared with other processes
# a barrier waits for a descheduled thread (milliseconds each): past this many chunks per update, chunks grow instead
# (at FBGEMM's default size on 2 loaded cores, 8 chunks instead of 40 halved the update's wall time).
_MAX_CHUNKS_MULTITHREADED = 8
# With one thread there is no barrier, but every chunk's sums are a fresh allocation: glibc maps a block of at least
# the largest size it has recently unmapped straight from the kernel (page faults on first touch, an munmap on free),
# and 2 MiB chunks of equal size hit that every time (cpu_sized, 1 thread: ~2.3k faults per backward, 17-19 ms vs
# 15.5-16.5 ms with 512 KiB chunks, which the heap serves). Chunks grow again past this many per update, where the
# ~20 us of torch calls per chunk would outweigh it (FBGEMM's default size: 156 MB of sums). Bigger chunks win only
# alone: one process updating a TW rank's 72k rows ran ~25% faster with 8 MiB chunks, but the 2-rank job (two
# processes sharing L3 and memory bandwidth) stepped slower with them (50.2 vs 46.8 ms, alternating in one run).
# On a 2-core AMD EPYC VM (2-rank sharded EBC step, CPU ms per step, 3 alternating runs): one chunk for the whole
# update tied 512 KiB (TW 25.6 vs 26.1, RW 28.9 vs 29.2) and 4 MiB cost more (29.5, 35.8), though alone 2 MiB and
# one chunk ran 13% faster than 512 KiB.
_CHUNK_BYTES_ONE_THREAD = 512 << 10
_MAX_CHUNKS_ONE_THREAD = 64


def _chunk_bytes(total_bytes: int) -> int:
    """Bytes of gradient sums the torch twin updates per chunk, for ``total_bytes`` of sums in all."""
    if torch.get_num_threads() > 1:
        return max(_CHUNK_BYTES_PER_THREAD * torch.get_num_threads(), -(-total_bytes // _MAX_CHUNKS_MULTITHREADED))
    return max(_CHUNK_BYTES_ONE_THREAD, -(-total_bytes // _MAX_CHUNKS_ONE_THREAD))


def _update_configs() -> list:
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((4, 4), (1, 2), (8, 4), (16, 8))]


# The kernel updates weights and state in place, so autotuning restores them after every trial run.
@autotune(
    configs=_update_configs(),
    key=["BLOCK_D", "OPTIM", "WEIGHT_DTYPE", "HAS_SCALE"],
    restore_value=["weights_ptr", "mom1_ptr", "mom2_ptr"],
)
@triton.jit(do_not_specialize=["k1", "k2"])  # the stream keys change every update: one compiled variant for all
def _fused_update_kernel(
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
    ONE_D_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Programs stride over the plan's unique rows (``grid_programs(U)``): unique row ``u`` sums its contributions and
    updates its weights and state. With one contribution per step (``BLOCK_N = 1``) and rows of one column block,
    a program updates ``ROW_BLOCK`` rows at a time instead (``grid_programs(cdiv(U, ROW_BLOCK))``, see
    :func:`_row_block`)."""
    if ONE_D_BLOCK and BLOCK_N == 1 and ROW_BLOCK > 1:
        for u0 in range(tl.program_id(0).to(tl.int64) * ROW_BLOCK, num_unique, tl.num_programs(0) * ROW_BLOCK):
            _update_row_block(
                u0 + tl.arange(0, ROW_BLOCK), weights_ptr, mom1_ptr, mom2_ptr, grad_ptr, goff_ptr, scale_ptr,
                segment_offsets_ptr, unique_tables_ptr, unique_local_rows_ptr, table_weight_offsets_ptr,
                table_row_offsets_ptr, table_dims_ptr, bias1_ptr, bias2_ptr, num_unique, lr, eps, beta1,
                one_minus_beta1, beta2, one_minus_beta2, weight_decay, k1, k2, OPTIM, WEIGHT_DTYPE, STOCHASTIC,
                HAS_SCALE, HAS_DECAY, BLOCK_D, ROW_BLOCK,
            )  # fmt: skip
    else:
        for u in range(tl.program_id(0).to(tl.int64), num_unique, tl.num_programs(0)):
            table = tl.load(unique_tables_ptr + u)
            local_row = tl.load(unique_local_rows_ptr + u)
            dim = tl.load(table_dims_ptr + table).to(tl.int64)
            row_start = tl.load(table_weight_offsets_ptr + table) + local_row * dim
            state_row = tl.load(table_row_offsets_ptr + table) + local_row
            start = tl.load(segment_offsets_ptr + u)
            end = tl.load(segment_offsets_ptr + u + 1)
            bias1 = tl.load(bias1_ptr + table)
            bias2 = tl.load(bias2_ptr + table)
            if ONE_D_BLOCK:
                cols = tl.arange(0, BLOCK_D)
                col_ok = cols < dim
                w, g = _load_grad_block(
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
                    HAS_SCALE,
                    HAS_DECAY,
                    BLOCK_N,
                    BLOCK_D,
                )
                multiplier = 0.0
                if OPTIM == _OPTIM_ROWWISE_ADAGRAD:
                    multiplier = _rowwise_multiplier(mom1_ptr, state_row, tl.sum(g * g, axis=0), dim, lr, eps)
                _update_and_store(
                    w,
                    g,
                    multiplier,
                    weights_ptr,
                    mom1_ptr,
                    mom2_ptr,
                    row_start + cols,
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
                    OPTIM,
                    WEIGHT_DTYPE,
                    STOCHASTIC,
                )
            else:
                multiplier = 0.0
                if OPTIM == _OPTIM_ROWWISE_ADAGRAD:
                    sum_sq = 0.0
                    for d0 in range(0, dim, BLOCK_D):
                        cols = d0 + tl.arange(0, BLOCK_D)
                        w, g = _load_grad_block(
                            weights_ptr,
                            grad_ptr,
                            goff_ptr,
                            scale_ptr,
                            start,
                            end,
                            row_start,
                            cols,
                            cols < dim,
                            weight_decay,
                            HAS_SCALE,
                            HAS_DECAY,
                            BLOCK_N,
                            BLOCK_D,
                        )
                        sum_sq += tl.sum(g * g, axis=0)
                    multiplier = _rowwise_multiplier(mom1_ptr, state_row, sum_sq, dim, lr, eps)
                for d0 in range(0, dim, BLOCK_D):
                    cols = d0 + tl.arange(0, BLOCK_D)
                    col_ok = cols < dim
                    w, g = _load_grad_block(
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
                        HAS_SCALE,
                        HAS_DECAY,
                        BLOCK_N,
                        BLOCK_D,
                    )
                    _update_and_store(
                        w,
                        g,
                        multiplier,
                        weights_ptr,
                        mom1_ptr,
                        mom2_ptr,
                        row_start + cols,
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
                        OPTIM,
                        WEIGHT_DTYPE,
                        STOCHASTIC,
                    )


def fused_update_triton(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    grad_flat: torch.Tensor,
    state: FusedOptimizerState,
    max_one_block_d: int = MAX_ONE_BLOCK_D,
) -> None:
    scalars = begin_step(state)
    if plan.num_unique == 0:
        return
    meta = layout.tensors(weights.device)
    block_d = triton.next_power_of_2(layout.max_dim)
    one_block = block_d <= max_one_block_d
    if not one_block:  # wide rows: walk them in column blocks of the largest one-block width
        block_d = triton.next_power_of_2(max_one_block_d)
    mom1 = weights if state.momentum1 is None else state.momentum1
    mom2 = weights if state.momentum2 is None else state.momentum2
    row_block = _row_block(block_d) if one_block else 1

    def grid(meta: dict) -> tuple[int]:  # the row-block path runs with one contribution per step only
        return (grid_programs(triton.cdiv(plan.num_unique, row_block if meta["BLOCK_N"] == 1 else 1)),)

    _fused_update_kernel[grid](
        weights,
        mom1,
        mom2,
        grad_flat,
        plan.sorted_grad_offsets,
        grad_flat if plan.sorted_scales is None else plan.sorted_scales,
        plan.segment_offsets,
        plan.unique_tables,
        plan.unique_local_rows,
        meta.table_weight_offsets,
        meta.table_row_offsets,
        meta.table_dims,
        scalars.bias1,
        scalars.bias2,
        plan.num_unique,
        scalars.lr,
        scalars.eps,
        scalars.beta1,
        scalars.one_minus_beta1,
        scalars.beta2,
        scalars.one_minus_beta2,
        scalars.weight_decay,
        *stream_key_args(scalars.seed),
        OPTIM=optim_code(state.optim),
        WEIGHT_DTYPE=WEIGHT_CODES[weights.dtype],
        STOCHASTIC=state.stochastic_rounding,
        HAS_SCALE=plan.sorted_scales is not None,
        HAS_DECAY=scalars.weight_decay != 0.0,
        ONE_D_BLOCK=one_block,
        BLOCK_D=block_d,
        ROW_BLOCK=row_block,
    )


def _row_block(block_d: int) -> int:
    """Unique rows a program updates at a time when it adds one contribution per step: enough for ~512 columns a
    tile (4 rows of 128, 8 of 64 or less). One row at a time, the update is bound by each row's chain of dependent
    loads, not by bandwidth: on an H200 at 32 tables of 1M x 128, B=8192 (5.1M rows), the kernel took 3.8 ms one row
    at a time (~2 TB/s) and 2.7 ms four rows at a time."""
    return max(1, min(8, 512 // block_d))


def fused_update_reference(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    plan: RowGradientPlan,
    grad_flat: torch.Tensor,
    state: FusedOptimizerState,
) -> None:
    """The specification (see module docstring): apply the rule in fp32 to the touched rows, round to the storage
    dtype and write rows and state back - over all tables at once when they share a dim, else per table, in
    chunks of gradient sums sized by :func:`_chunk_bytes`.

    Each rule computes ``delta = -update`` and the new weights are ``w + delta``. For fp32 SGD and both Adagrads
    that is written with ``index_add_`` (one read-modify-write per row, much faster on CPU than gathering the rows
    and copying them back). Rowwise Adagrad gathers the touched rows' state once, updates it chunk by chunk and
    writes it back once.
    """
    s = begin_step(state)
    in_place = weights.dtype == torch.float32 and state.optim != OptimType.ADAM
    rowwise = state.optim == OptimType.EXACT_ROWWISE_ADAGRAD
    row_state = state.momentum1.index_select(0, plan.unique_rows) if rowwise else None  # [U], by unique row
    chunk_bytes = _chunk_bytes(4 * compact_offsets(layout, plan)[-1])
    for span, a, b, g in iter_row_sums(layout, plan, grad_flat, chunk_bytes):
        t, dim = span.table, span.dim
        if t is None:  # every table: global rows of the flat buffer viewed as [num_rows, dim]
            rows, table = plan.unique_rows[a:b], weights.view(layout.num_rows, dim)
            element_base = 0
        else:
            rows, table = plan.unique_local_rows[a:b], layout.table_view(weights, t)
            element_base = layout.table_weight_offsets[t]
        w = table.index_select(0, rows).float() if s.weight_decay != 0.0 or not in_place else None
        if s.weight_decay != 0.0:
            g = g + s.weight_decay * w
        # ``delta = -update`` (negating is exact, so ``w + delta`` rounds like ``w - update``); ``g`` is scratch
        # (this chunk's fresh sums), so SGD and both Adagrads scale it in place
        if state.optim == OptimType.EXACT_SGD:
            delta = g.mul_(-s.lr)
        elif state.optim == OptimType.EXACT_ADAGRAD:
            m_table = state.momentum1[element_base : element_base + table.numel()].view(table.shape)
            momentum = m_table.index_select(0, rows).add_(g * g)
            m_table.index_copy_(0, rows, momentum)
            delta = g.mul_(-s.lr).div_(momentum.sqrt_().add_(s.eps))
        elif rowwise:
            # m + mean(g**2), the sum of squares as the squared 2-norm: one fused reduction (fp64 accumulator on CPU)
            # is ~3x faster than squaring and summing over short rows, and as accurate
            momentum = row_state[a:b].add_(torch.linalg.vector_norm(g, dim=1).square_().div_(dim))
            delta = g.mul_(torch.div(-s.lr, momentum.sqrt().add_(s.eps))[:, None])
        else:
            m1_table = state.momentum1[element_base : element_base + table.numel()].view(table.shape)
            m2_table = state.momentum2[element_base : element_base + table.numel()].view(table.shape)
            m1 = s.beta1 * m1_table.index_select(0, rows) + s.one_minus_beta1 * g
            m2 = s.beta2 * m2_table.index_select(0, rows) + s.one_minus_beta2 * (g * g)
            m1_table.index_copy_(0, rows, m1)
            m2_table.index_copy_(0, rows, m2)
            # Adam's bias corrections are per table: one value for a table's chunk, one per row across tables
            if t is None:
                bias1, bias2 = s.bias1[plan.unique_tables[a:b], None], s.bias2[plan.unique_tables[a:b], None]
            else:
                bias1, bias2 = s.bias1[t], s.bias2[t]
            delta = -s.lr * ((m1 / bias1) / ((m2 / bias2).sqrt() + s.eps))
        if in_place:
            table.index_add_(0, rows, delta)
            continue
        new = w + delta
        element = None
        if weights.dtype != torch.float32 and state.stochastic_rounding:
            element = element_base + rows[:, None] * dim + torch.arange(dim, device=rows.device)
        table.index_copy_(
            0, rows, round_fp32_to_storage_reference(new, weights.dtype, state.stochastic_rounding, element, s.seed)
        )
    if row_state is not None:
        state.momentum1.index_copy_(0, plan.unique_rows, row_state)
