"""Every ``torch.ops.tritonrec`` op passes ``torch.library.opcheck`` (schema and declared mutations, fake
implementation against the real one, autograd registration, AOT tracing with dynamic shapes), checked on the calls
that the public functions really make, forward and backward; no op is left without such a call.

The calls are recorded by a dispatch mode while small scenarios run through the public API (torch twins; the Triton
launchers sit behind the same ops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tritonrec.kernels import (
    block_bucketize_sparse_features,
    dense_to_jagged,
    dequantize_fp8_rowwise,
    dequantize_half,
    dequantize_int8_rowwise,
    dequantize_mx4,
    jagged_to_padded_dense,
    lengths_to_offsets,
    pack_sequences,
    permute_2d_sparse_data,
    quantize_fp8_rowwise,
    quantize_half,
    quantize_int8_rowwise,
    quantize_mx4,
    unpack_sequences,
)
from tritonrec.kernels.embedding import (
    OptimType,
    PoolingMode,
    QuantizedTables,
    TableBatchedLayout,
    TableSpec,
    create_fused_optimizer_state,
    pooled_embedding_lookup,
    quantized_pooled_lookup,
    sequence_embedding_lookup,
)
from tritonrec.kernels.packing_plan import bin_assignment, make_packing_plan


class _RecordOps(TorchDispatchMode):
    """Remembers the first call of every ``tritonrec`` op (arguments cloned, so later in-place updates do not
    change them; ``requires_grad`` kept only where grad mode was on, as it is for the backward ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, tuple[Any, tuple]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.name()
        if name.startswith("tritonrec::") and name not in self.calls:
            grad = torch.is_grad_enabled()
            clone = lambda a: a.detach().clone().requires_grad_(grad and a.requires_grad) if torch.is_tensor(a) else a
            self.calls[name] = (func, tuple(torch.utils._pytree.tree_map(clone, list(args))))
        return func(*args, **(kwargs or {}))


def _jagged() -> None:
    values = torch.randn(7, 2, requires_grad=True)  # one row past offsets[-1]
    offsets = torch.tensor([0, 2, 2, 6])
    jagged_to_padded_dense(values, offsets, 3, padding_value=-1.0, backend="torch").sum().backward()
    dense = torch.randn(3, 4, 2, requires_grad=True)
    dense_to_jagged(dense, offsets, backend="torch").sum().backward()  # total length read from offsets
    lengths_to_offsets(torch.tensor([[1, 0, 3], [2, 2, 0]]), backend="torch")


def _sparse() -> None:
    lengths = torch.tensor([[1, 2], [0, 3], [2, 0]])
    weights = torch.rand(8, requires_grad=True)
    _, _, out_weights = permute_2d_sparse_data(torch.tensor([2, 0]), lengths, torch.arange(8), weights, backend="torch")
    out_weights.sum().backward()
    _, _, new_weights, _, _ = block_bucketize_sparse_features(
        torch.tensor([2, 1, 0, 3]),
        torch.tensor([0, 5, 3, 7, 1, 2]),
        torch.tensor([4, 3]),
        2,
        weights=torch.rand(6, requires_grad=True),
        bucketize_pos=True,
        sequence=True,
        backend="torch",
    )
    new_weights.sum().backward()


def _packing() -> None:
    order, bin_offsets = bin_assignment([[1], [0, 2]])
    plan = make_packing_plan(order, bin_offsets, offsets=torch.tensor([0, 2, 2, 5]), pad_to_multiple=2)
    values = torch.randn(6, 3, requires_grad=True)
    packed = pack_sequences(values, plan, backend="torch")
    packed.tokens.sum().backward()
    unpack_sequences(packed.tokens.detach().requires_grad_(), plan, backend="torch").sum().backward()


def _codecs() -> None:
    x = torch.randn(3, 40)
    dequantize_fp8_rowwise(quantize_fp8_rowwise(x, 16, backend="torch"), 16, backend="torch")
    dequantize_int8_rowwise(quantize_int8_rowwise(x, 16, stochastic_rounding=True, seed=2**64 - 1, backend="torch"), 16)
    dequantize_mx4(quantize_mx4(x, 8, backend="torch"), 8, backend="torch")
    x.requires_grad_()
    codes = quantize_half(x, "bf16", loss_scale=4.0, backend="torch")
    dequantize_half(codes, loss_scale=4.0, backend="torch").sum().backward()


def _layout(pooling: PoolingMode) -> TableBatchedLayout:
    return TableBatchedLayout([TableSpec(5, 3, pooling, "a"), TableSpec(4, 2, pooling, "b")], [0, 1, 0])


def _pooled() -> None:
    layout = _layout(PoolingMode.MEAN)
    weights = torch.randn(layout.num_weights)
    indices, offsets = torch.tensor([0, 4, 4, 1, 3, 2, 0]), torch.tensor([0, 2, 3, 5, 5, 6, 7])
    tables = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    psw = torch.rand(7, requires_grad=True)
    out = pooled_embedding_lookup(weights, layout, indices, offsets, psw, table_weights=tables, backend="torch")
    out.sum().backward()
    flat = weights.clone().requires_grad_()
    pooled_embedding_lookup(flat, layout, indices, offsets, backend="torch").sum().backward()
    state = create_fused_optimizer_state(layout, OptimType.ADAM, lr=0.1)
    pooled_embedding_lookup(weights, layout, indices, offsets, fused=state, backend="torch").sum().backward()
    quantized = QuantizedTables.from_float(layout, [layout.table_view(weights, t) for t in range(2)], 4)
    quantized_pooled_lookup(quantized, indices, offsets, psw.detach(), backend="torch")


def _sequence() -> None:
    layout = _layout(PoolingMode.NONE)
    weights = torch.randn(layout.num_weights)
    indices, starts = torch.tensor([0, 4, 3, 1, 3, 2, 0]), [0, 2, 5, 7]
    tables = [torch.nn.Parameter(layout.table_view(weights, t)) for t in range(2)]
    sequence_embedding_lookup(weights, layout, indices, starts, table_weights=tables, backend="torch").sum().backward()
    state = create_fused_optimizer_state(layout, OptimType.EXACT_ROWWISE_ADAGRAD, lr=0.1)
    sequence_embedding_lookup(weights, layout, indices, starts, fused=state, backend="torch").sum().backward()


SCENARIOS: dict[str, Callable[[], None]] = {
    "jagged": _jagged,
    "sparse": _sparse,
    "packing": _packing,
    "codecs": _codecs,
    "pooled": _pooled,
    "sequence": _sequence,
}


@pytest.fixture(scope="module")
def recorded() -> dict[str, tuple[Any, tuple]]:
    recorder = _RecordOps()
    with recorder:
        for scenario in SCENARIOS.values():
            scenario()
    return recorder.calls


def _registered_ops() -> set[str]:
    return {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("tritonrec::")}


def test_every_op_is_exercised(recorded: dict[str, tuple[Any, tuple]]) -> None:
    assert _registered_ops() - set(recorded) == set(), "ops that no scenario calls: add them to SCENARIOS"


@pytest.mark.parametrize("op_name", sorted(_registered_ops()))
def test_opcheck(recorded: dict[str, tuple[Any, tuple]], op_name: str) -> None:
    if op_name not in recorded:
        pytest.fail(f"{op_name} is not called by any scenario")
    op, args = recorded[op_name]
    # the fused states whose keys the update ops carry must stay alive: the scenarios' states are gone, so make
    # the update ops find a fresh one of the same rule and shapes
    args = _with_live_fused_state(op_name, args)
    torch.library.opcheck(op, args)


_LIVE: list[Any] = []


def _with_live_fused_state(op_name: str, args: tuple) -> tuple:
    if not op_name.endswith("_fused_update"):
        return args
    weights, optimizer_state = args[0], args[1]
    optim = OptimType.ADAM if len(optimizer_state) == 3 else OptimType.EXACT_ROWWISE_ADAGRAD
    layout = _layout(PoolingMode.MEAN if op_name.startswith("pooled") else PoolingMode.NONE)
    state = create_fused_optimizer_state(layout, optim, lr=0.1)
    _LIVE.append(state)
    assert weights.numel() == layout.num_weights
    return (*args[:-2], state.op_key, args[-1])
