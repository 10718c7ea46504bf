"""What the AOT compiler runs to find the launches: every public op, on small CPU inputs, over the dtypes, flags and
size classes that change what its launchers specialise (tile widths from D, row widths, multi-block paths).

Each workload is a function of nothing that calls public ops (and, where a path only opens at sizes too large to
run, the op's own launcher with its documented threshold lowered). :func:`small_workloads` runs under the
interpreter; :func:`production_workloads` runs on ``meta`` tensors with launches skipped, at the sizes real jobs
use, so grids are checked where they could overflow. ``sweep="ci"`` keeps one dtype combination and the size
classes that matter most (a representative subset); ``"full"`` is every combination.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch
from torch._library.custom_ops import CustomOpDef

from tritonrec import kernels as K
from tritonrec.kernels.embedding import OptimType, PoolingMode, TableBatchedLayout, TableSpec
from tritonrec.kernels.embedding import quantized as Q
from tritonrec.kernels.embedding.fused_update import fused_update_triton
from tritonrec.kernels.embedding.grad_plan import RowGradientPlan, ValueGradientInfo
from tritonrec.kernels.embedding.pooled_forward import pooled_forward_triton
from tritonrec.kernels.embedding.row_gradients import per_sample_weight_grad_triton, row_gradient_sums_triton
from tritonrec.kernels.embedding.sequence import sequence_forward_triton
from tritonrec.kernels.lengths_to_offsets import _lengths_to_offsets_triton
from tritonrec.kernels.library import NAMESPACE
from tritonrec.kernels.pack_sequences import _pack_triton, _unpack_triton

Workload = Callable[[], object]
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
T = "triton"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _offsets(lengths: list[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device=device)


def _layout(dims: list[int], rows: int = 6) -> TableBatchedLayout:
    poolings = [PoolingMode.SUM, PoolingMode.MEAN] * len(dims)
    specs = [TableSpec(rows, d, poolings[i], f"t{i}") for i, d in enumerate(dims)]
    return TableBatchedLayout(specs, list(range(len(dims))), [f"f{i}" for i in range(len(dims))])


def _lookup_inputs(dims: list[int], wdt: torch.dtype, idt: torch.dtype, batch: int = 2):
    layout = _layout(dims)
    lengths = [(i * 5) % 4 for i in range(len(dims) * batch)]
    indices = torch.arange(sum(lengths), dtype=idt) % 6
    weights = torch.randn(layout.num_weights).to(wdt)
    return layout, weights, indices, _offsets(lengths, idt), batch


def pooled(dims: list[int], wdt: torch.dtype, idt: torch.dtype) -> None:
    """Forward (weighted and not, with and without divisors) and every backward: dense grad, psw grad, fused."""
    layout, weights, indices, offsets, _ = _lookup_inputs(dims, wdt, idt)
    psw = torch.rand(indices.numel(), requires_grad=True)
    divisors = torch.full((offsets.numel() - 1,), 2.0)
    w = weights.float().clone().requires_grad_()
    K.pooled_embedding_lookup(w, layout, indices, offsets, psw, divisors, backend=T).sum().backward()
    K.pooled_embedding_lookup(w, layout, indices, offsets, backend=T).sum().backward()
    rules = ((OptimType.EXACT_SGD, True), (OptimType.EXACT_ROWWISE_ADAGRAD, False), (OptimType.EXACT_ADAGRAD, True))
    for optim, stochastic in rules:
        state = K.create_fused_optimizer_state(layout, optim, stochastic_rounding=stochastic, lr=0.1)
        K.pooled_embedding_lookup(weights, layout, indices, offsets, fused=state, backend=T).sum().backward()
    state = K.create_fused_optimizer_state(layout, OptimType.ADAM, lr=0.1, weight_decay=0.01)
    K.pooled_embedding_lookup(weights, layout, indices, offsets, psw.detach(), fused=state, backend=T).sum().backward()


def sequence(dims: list[int], wdt: torch.dtype, idt: torch.dtype) -> None:
    layout, weights, indices, offsets, batch = _lookup_inputs(dims, wdt, idt)
    starts = offsets[::batch].tolist()
    w = weights.float().clone().requires_grad_()
    K.sequence_embedding_lookup(w, layout, indices, starts, backend=T).sum().backward()
    state = K.create_fused_optimizer_state(layout, OptimType.EXACT_ROWWISE_ADAGRAD, lr=0.1)
    K.sequence_embedding_lookup(weights, layout, indices, starts, fused=state, backend=T).sum().backward()


def quantized(dims: list[int], bits: int, idt: torch.dtype) -> None:
    layout, weights, indices, offsets, _ = _lookup_inputs(dims, torch.float32, idt)
    tables = [layout.table_view(weights, t) for t in range(layout.num_tables)]
    q = Q.QuantizedTables.from_float(layout, tables, bits)
    K.quantized_pooled_lookup(q, indices, offsets, backend=T)
    K.quantized_pooled_lookup(q, indices, offsets, torch.rand(indices.numel()), backend=T)


def jagged(width: int, vdt: torch.dtype, idt: torch.dtype) -> None:
    offsets = _offsets([2, 0, 3], idt)
    shape = (5,) if width == 0 else (5, width)
    values = torch.randn(shape).to(vdt).requires_grad_(vdt.is_floating_point)
    dense = K.jagged_to_padded_dense(values, offsets, 4, backend=T)
    if values.requires_grad:
        K.dense_to_jagged(dense.detach().requires_grad_(), offsets, 5, backend=T).sum().backward()
        dense.sum().backward()


def sparse(wdt: torch.dtype, idt: torch.dtype, num_buckets: int) -> None:
    """Permutes (2-D and 1-D), lengths_to_offsets (one-row, per-row and multi-block scans), block bucketize (by block
    sizes and by row boundaries)."""
    lengths = torch.tensor([[1, 0, 2], [3, 1, 0]], dtype=idt)
    values = torch.arange(7, dtype=idt)
    weights = torch.rand(7).to(wdt)
    permute = torch.tensor([1, 0, 1], dtype=idt)
    K.permute_2d_sparse_data(permute, lengths, values, weights, backend=T)
    K.permute_2d_sparse_data(permute, lengths, values, backend=T)
    K.lengths_to_offsets(lengths, backend=T)
    _lengths_to_offsets_triton(lengths.reshape(-1), multi_block_threshold=2)
    block_sizes = torch.tensor([3, 4], dtype=idt)
    for flags in ((False, False, False), (True, True, False), (False, True, True)):
        bucketize_pos, sequence_, keep = flags
        K.block_bucketize_sparse_features(
            lengths.reshape(-1), values, block_sizes, num_buckets, weights if bucketize_pos else None,
            bucketize_pos, sequence_, keep, backend=T,
        )  # fmt: skip
    bounds = (torch.arange(num_buckets + 1, dtype=idt) * 2).repeat(2, 1)  # uneven blocks: row boundaries per feature
    K.block_bucketize_sparse_features(
        lengths.reshape(-1), values, block_sizes, num_buckets, weights, True, True, block_bucketize_pos=bounds,
        backend=T,
    )  # fmt: skip


def codecs(row_dim: int, stochastic: bool) -> None:
    x = torch.randn(3, row_dim)
    for out in WEIGHT_DTYPES:
        for fmt in ("fp16", "bf16"):
            codes = K.quantize_half(x, fmt, loss_scale=2.0, stochastic_rounding=stochastic, backend=T)
            K.dequantize_half(codes, loss_scale=2.0, output_dtype=out, backend=T)
        for fmt in ("e4m3", "e5m2"):
            enc = K.quantize_fp8_rowwise(x, row_dim, fmt, stochastic_rounding=stochastic, backend=T)
            K.dequantize_fp8_rowwise(enc, row_dim, fmt, output_dtype=out, backend=T)
        enc = K.quantize_int8_rowwise(x, row_dim, stochastic_rounding=stochastic, backend=T)
        K.dequantize_int8_rowwise(enc, row_dim, output_dtype=out, backend=T)
        if row_dim % 2 == 0:
            enc = K.quantize_mx4(x, row_dim, stochastic_rounding=stochastic, backend=T)
            K.dequantize_mx4(enc, row_dim, output_dtype=out, backend=T)


def packing(width: int, vdt: torch.dtype) -> None:
    order, bin_offsets = K.bin_assignment([[1, 0], [2]])
    lengths = torch.tensor([2, 3, 1])
    feature = () if width == 0 else (width,)
    values = torch.ones(3, 4, *feature, dtype=vdt)
    for capacity in (None, 8):
        plan = K.make_packing_plan(order, bin_offsets, lengths=lengths, padded_len=4, capacity=capacity)
        packed = K.pack_sequences(values, plan, backend=T)
        K.unpack_sequences(packed.tokens, plan, backend=T)
    plan = K.make_packing_plan(order, bin_offsets, offsets=_offsets([2, 3, 1], torch.int64))
    packed = K.pack_sequences(torch.ones(6, *feature, dtype=vdt), plan, backend=T)
    K.unpack_sequences(packed.tokens, plan, backend=T)


def small_workloads(sweep: str = "full") -> dict[str, Workload]:
    """``{name: workload}`` on small CPU inputs (run under ``TRITON_INTERPRET=1``).

    Full: every weight dtype and index dtype at the two main size classes (narrow tiles, and the widest: BLOCK_D 128 for
    lookups and jagged rows, 256 for packing, 8192-wide codec rows), then every other tile-width class once in fp32 /
    int64 (BLOCK_D 1 to 64, the fused update's single 1024-wide block and its multi-block path past 1024, codec rows of
    4 to 4096). CI: one dtype combination at the widest classes."""
    full = sweep == "full"
    f32, i64 = torch.float32, torch.int64
    # every weight dtype with int64 indices, and int32 indices once: each dtype of each argument is compiled
    dtype_pairs = ([(w, i64) for w in WEIGHT_DTYPES] + [(f32, torch.int32)]) if full else [(torch.float16, i64)]
    out: dict[str, Workload] = {}
    for wdt, idt in dtype_pairs:
        tag = f"{_name(wdt)}/{_name(idt)}"
        for dims in ([3, 64], [200, 8]) if full else ([200, 8], [1000]):
            out[f"pooled/{tag}/D={dims}"] = lambda d=dims, w=wdt, i=idt: pooled(d, w, i)
            out[f"sequence/{tag}/D={dims}"] = lambda d=dims, w=wdt, i=idt: sequence(d, w, i)
        out[f"jagged/{tag}/D=200"] = lambda w=wdt, i=idt: jagged(200, w, i)
        out[f"sparse/{tag}"] = lambda w=wdt, i=idt: sparse(w, i, 5)
    for idt in INDEX_DTYPES if full else (i64,):
        for bits in (8, 4, 2):  # FP16 / FP32 tables run the float path's fp16 / fp32 kernels
            out[f"quantized/int{bits}/{_name(idt)}"] = lambda b=bits, i=idt: quantized([3, 130], b, i)
    for row_dim, stochastic in itertools.product((32, 8192) if full else (8192,), (False, True)):
        out[f"codecs/row_dim={row_dim}/stochastic={stochastic}"] = lambda r=row_dim, s=stochastic: codecs(r, s)
    packed_dtypes = (*WEIGHT_DTYPES, torch.int64, torch.bool) if full else (torch.float16,)
    for width, vdt in itertools.product((0, 5, 300) if full else (300,), packed_dtypes):
        out[f"packing/{_name(vdt)}/D={width}"] = lambda n=width, v=vdt: packing(n, v)
    if full:  # the other tile widths, once each
        for dims in ([1], [2], [8], [16], [32], [1000], [1500]):
            out[f"pooled/widths/D={dims}"] = lambda d=dims: pooled(d, f32, i64)
            out[f"sequence/widths/D={dims}"] = lambda d=dims: sequence(d, f32, i64)
        for width in (0, 2, 8, 16, 32, 64):
            out[f"jagged/widths/D={width}"] = lambda n=width: jagged(n, f32, i64)
        for width in (2, 16, 32, 64, 128):
            out[f"packing/widths/D={width}"] = lambda n=width: packing(n, f32)
        for row_dim in (3, 128, 1024, 4096):
            out[f"codecs/widths/row_dim={row_dim}"] = lambda r=row_dim: codecs(r, False)
    return out


# Production sizes for the grid checks (on meta tensors, nothing allocated): a 64K batch over 256 features with 20
# ids per bag (335M ids, as many unique rows in the backward), 2**22 bags or bags of 2**20 rows for the jagged ops,
# 8192 buckets over a 2K x 64 batch, 2**28-value codecs, 2**20 packed sequences or 4K x 4096-wide ones.
BATCH, FEATURES, POOLING = 65536, 256, 20
META = "meta"


def _meta(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _meta_lookup(dim: int) -> tuple[TableBatchedLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    specs = [TableSpec(1 << 20, dim, PoolingMode.SUM, f"t{i}") for i in range(FEATURES)]
    layout = TableBatchedLayout(specs, list(range(FEATURES)), [f"f{i}" for i in range(FEATURES)])
    bags = FEATURES * BATCH
    return layout, _meta(layout.num_weights, dtype=torch.float16), _meta(bags * POOLING), _meta(bags + 1)


def production_lookup(dim: int) -> None:
    """Pooled and sequence forwards through the public ops; the backward launchers with a gradient plan of
    ``N`` unique rows (building a real plan needs the values: a sort and a unique)."""
    layout, weights, indices, offsets = _meta_lookup(dim)
    n = indices.numel()
    pooled_forward_triton(weights, layout, indices, offsets, None, None, BATCH)  # the op reads offsets: bounds
    per_feature = [f * (n // FEATURES) for f in range(FEATURES + 1)]
    sequence_forward_triton(weights, layout, indices, per_feature, _meta(n), _meta(n))
    plan = RowGradientPlan(
        sorted_grad_offsets=_meta(n),
        sorted_scales=_meta(n, dtype=torch.float32),
        segment_offsets=_meta(n + 1),
        unique_rows=_meta(n),
        table_row_offsets=_meta(FEATURES + 1),
        table_unique_offsets=[0] * FEATURES + [n],
        table_contribution_offsets=[0] * FEATURES + [n],
    )
    grad = _meta(n * dim, dtype=torch.float32)
    row_gradient_sums_triton(layout, plan, grad)
    fused_update_triton(weights, layout, plan, grad, K.create_fused_optimizer_state(layout, OptimType.ADAM, META))
    info = ValueGradientInfo(_meta(n), _meta(n), None, None, _meta(n, dtype=torch.float32), value_features=_meta(n))
    per_sample_weight_grad_triton(weights, layout, indices, info, grad)


def production_jagged(bags: int, max_len: int, dim: int) -> None:
    values, offsets = _meta(bags * 4, dim, dtype=torch.float16), _meta(bags + 1)
    dense = K.jagged_to_padded_dense(values, offsets, max_len, backend=T)
    K.dense_to_jagged(dense, offsets, bags * 4, backend=T)


def production_sparse(features: int, batch: int, num_buckets: int) -> None:
    lengths = _meta(features, batch)
    values = _meta(features * batch * POOLING)
    K.lengths_to_offsets(lengths, backend=T)
    K.lengths_to_offsets(lengths.reshape(-1), backend=T)
    K.permute_2d_sparse_data(_meta(features), lengths, values, permuted_lengths_sum=values.numel(), backend=T)
    block_sizes = _meta(features)
    K.block_bucketize_sparse_features(lengths.reshape(-1), values, block_sizes, num_buckets, sequence=True, backend=T)


def production_codecs(row_dim: int) -> None:
    x = _meta(1 << 16, 1 << 12, dtype=torch.float32)
    K.dequantize_half(K.quantize_half(x, backend=T), backend=T)
    K.dequantize_fp8_rowwise(K.quantize_fp8_rowwise(x, row_dim, backend=T), row_dim, backend=T)
    K.dequantize_int8_rowwise(K.quantize_int8_rowwise(x, row_dim, backend=T), row_dim, backend=T)
    K.dequantize_mx4(K.quantize_mx4(x, row_dim, backend=T), row_dim, backend=T)


def production_packing(sequences: int, length: int, width: int) -> None:
    """The pack / unpack launchers on meta values with a real (CPU) plan: planning reads the lengths."""
    order, bin_offsets = torch.arange(sequences), torch.arange(0, sequences + 1, 2)  # two sequences per bin
    plan = K.make_packing_plan(order, bin_offsets, lengths=torch.full((sequences,), length), padded_len=length)
    tokens, _, _ = _pack_triton(_meta(sequences, length, width, dtype=torch.bfloat16), plan, 0.0)
    _unpack_triton(tokens, plan, 0.0)


@contextlib.contextmanager
def ops_call_their_implementations() -> Iterator[None]:
    """A custom op called on ``meta`` tensors dispatches to its fake implementation, which launches nothing. While a
    production workload runs, each ``tritonrec`` op called from Python runs its implementation directly instead
    (forward only: no autograd), so its Triton launcher records the launch; other libraries' ops are untouched."""
    original = CustomOpDef.__call__

    def call(self: CustomOpDef, *args: object, **kwargs: object) -> object:
        if self._namespace == NAMESPACE:
            return self._init_fn(*args, **kwargs)
        return original(self, *args, **kwargs)

    CustomOpDef.__call__ = call
    try:
        yield
    finally:
        CustomOpDef.__call__ = original


def _through_implementations(workload: Workload) -> Workload:
    def run() -> None:
        with ops_call_their_implementations():
            workload()

    return run


def production_workloads() -> dict[str, Workload]:
    """``{name: workload}`` on ``meta`` tensors at production sizes (launches recorded, not run; value checks off)."""
    out: dict[str, Workload] = {}
    for dim in (64, 512):
        out[f"production/lookup/D={dim}"] = lambda d=dim: production_lookup(d)
    for bags, max_len, dim in ((1 << 22, 64, 1), (1 << 22, 64, 256), (64, 1 << 20, 1), (64, 1 << 20, 256)):
        name = f"production/jagged/B={bags}/L={max_len}/D={dim}"
        out[name] = lambda b=bags, m=max_len, d=dim: production_jagged(b, m, d)
    for features, batch, buckets in ((FEATURES, BATCH, 64), (64, 2048, 8192)):
        out[f"production/sparse/T={features}/B={batch}/buckets={buckets}"] = lambda t=features, b=batch, n=buckets: (
            production_sparse(t, b, n)
        )
    for row_dim in (32, 4096):
        out[f"production/codecs/row_dim={row_dim}"] = lambda r=row_dim: production_codecs(r)
    out["production/packing/2**20x16"] = lambda: production_packing(1 << 20, 16, 1)
    out["production/packing/4096x4096"] = lambda: production_packing(4096, 256, 4096)
    return {name: _through_implementations(workload) for name, workload in out.items()}
