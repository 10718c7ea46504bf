"""Every bad input of the table-batched ops raises: ValueError for values and shapes, TypeError for types and
dtypes, with a message naming the argument and the offending value."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import make_case, make_layout

from tritonrec.kernels.embedding import (
    OptimType,
    PoolingMode,
    TableBatchedLayout,
    TableSpec,
    create_fused_optimizer_state,
    pooled_embedding_lookup,
    quantized_pooled_lookup,
    sequence_embedding_lookup,
)


@pytest.fixture
def case():
    layout = make_layout([3, 4], rows=[5, 7], poolings=[PoolingMode.SUM, PoolingMode.MEAN])
    return make_case(layout, [2, 1, 3, 2], batch_size=2, weighted=True, seed=0)


def _pooled(case, **overrides):
    args = {
        "weights": case.weights,
        "layout": case.layout,
        "indices": case.indices,
        "offsets": case.offsets,
        "per_sample_weights": case.per_sample_weights,
    }
    args.update(overrides)
    return pooled_embedding_lookup(**args)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"weights": [1.0]}, TypeError, "weights must be a torch.Tensor, got list"),
        ({"weights": torch.zeros(43, dtype=torch.int64)}, TypeError, r"weights must have dtype in .*got torch.int64"),
        ({"weights": torch.zeros(42)}, ValueError, r"weights must hold layout.num_weights = 43 elements .*got 42"),
        ({"weights": torch.zeros(43, 1)}, ValueError, r"weights must have 1 dimension\(s\), got shape \(43, 1\)"),
        ({"weights": torch.zeros(86)[::2]}, ValueError, r"weights must be contiguous, got stride \(2,\)"),
        ({"layout": {"tables": []}}, TypeError, "layout must be a TableBatchedLayout, got dict"),
        ({"indices": torch.zeros(8)}, TypeError, "indices must be int32 or int64, got dtype torch.float32"),
        (
            {"offsets": torch.tensor([0, 2, 3, 8])},
            ValueError,
            r"offsets must have F \* B \+ 1 entries for F = 2 .*got 4 entries",
        ),
        ({"offsets": torch.tensor([0, 2, 3, 6, 9])}, ValueError, r"offsets must end at 8 .*got offsets\[-1\] = 9"),
        (
            {"offsets": torch.tensor([0, 2, 1, 6, 8])},
            ValueError,
            r"offsets must be non-decreasing, got offsets\[1\] = 2",
        ),
        (
            {"per_sample_weights": torch.ones(7)},
            ValueError,
            r"per_sample_weights must have one entry per index \(8\), got 7",
        ),
        ({"per_sample_weights": torch.ones(8, dtype=torch.int32)}, TypeError, r"per_sample_weights must have dtype"),
        (
            {"bag_divisors": torch.ones(3)},
            ValueError,
            r"bag_divisors must have one entry per bag \(F \* B = 4\), got 3",
        ),
        (
            {"bag_divisors": torch.tensor([1.0, 1.0, 0.0, 1.0])},
            ValueError,
            r"bag_divisors must be positive for non-empty bags, got bag_divisors\[2\] = 0.0 for a bag of 3 values",
        ),
        (  # NaN is not positive either: it used to pass the check and zero the bag silently
            {"bag_divisors": torch.tensor([1.0, float("nan"), 1.0, 1.0])},
            ValueError,
            r"bag_divisors must be positive for non-empty bags, got bag_divisors\[1\] = nan for a bag of 1 values",
        ),
        ({"backend": "cuda"}, ValueError, r"backend must be one of .*got backend='cuda'"),
        ({"sparse_grad": True}, ValueError, "sparse_grad=True needs table_weights"),
        (
            {"per_sample_weights": torch.ones(8, device="meta")},
            ValueError,
            "tensors must be on one device, got .*per_sample_weights on meta",
        ),
    ],
)
def test_pooled_lookup_rejects(case, overrides, error, message):
    with pytest.raises(error, match=message):
        _pooled(case, **overrides)


def test_table_weights_must_be_views_of_the_flat_buffer(case):
    views = [case.layout.table_view(case.weights, t) for t in range(2)]
    with pytest.raises(ValueError, match=r"table_weights must hold one tensor per table \(2\), got 1"):
        _pooled(case, table_weights=views[:1])
    with pytest.raises(ValueError, match=r"table_weights\[1\] must be the \[7, 4\] view of table 1 \('t1'\) inside"):
        _pooled(case, table_weights=[views[0], views[1].clone()])
    with pytest.raises(TypeError, match=r"table_weights\[0\] must have dtype in \[torch.float32\], got torch.float16"):
        _pooled(case, table_weights=[views[0].half(), views[1]])


def test_fused_state_must_fit_the_layout(case):
    state = create_fused_optimizer_state(case.layout, OptimType.EXACT_ROWWISE_ADAGRAD)
    with pytest.raises(TypeError, match="fused must be a FusedOptimizerState or None, got dict"):
        _pooled(case, fused={"lr": 0.1})
    with pytest.raises(ValueError, match="fused updates weights in place .*weights.requires_grad=True"):
        _pooled(case, weights=case.weights.clone().requires_grad_(), fused=state)
    other = create_fused_optimizer_state(make_layout([3]), OptimType.EXACT_ROWWISE_ADAGRAD)
    with pytest.raises(ValueError, match="fused.momentum1 must hold 12 entries for this layout, got 7"):
        _pooled(case, fused=other)


def test_sequence_lookup_rejects_bad_value_offsets(case):
    run = lambda starts: sequence_embedding_lookup(case.weights, case.layout, case.indices, starts)
    with pytest.raises(ValueError, match=r"feature_value_offsets must have F \+ 1 = 3 entries, got 2"):
        run([0, 8])
    with pytest.raises(ValueError, match=r"must rise from 0 to the number of indices \(8\), got \[0, 9, 8\]"):
        run([0, 9, 8])
    with pytest.raises(TypeError, match="feature_value_offsets must be a list of ints, got 3"):
        run(3)
    with pytest.raises(TypeError, match="indices must be int32 or int64, got dtype torch.float32"):
        sequence_embedding_lookup(case.weights, case.layout, case.indices.float(), [0, 3, 8])


def test_quantized_lookup_rejects_float_tables(case):
    with pytest.raises(TypeError, match="q must be QuantizedTables, got Tensor"):
        quantized_pooled_lookup(case.weights, case.indices, case.offsets)


def test_layout_and_table_specs_reject_bad_values():
    with pytest.raises(ValueError, match=r"table 'a': num_rows must be a non-negative int, got num_rows=-1"):
        TableSpec(-1, 3, name="a")
    with pytest.raises(ValueError, match=r"table 'a': dim must be a positive int, got dim=0"):
        TableSpec(4, 0, name="a")
    with pytest.raises(TypeError, match=r"pooling must be a PoolingMode, got pooling='sum'"):
        TableSpec(4, 3, pooling="sum")
    with pytest.raises(ValueError, match="tables must hold at least one TableSpec, got an empty list"):
        TableBatchedLayout([], [])
    with pytest.raises(ValueError, match=r"feature_tables\[1\] must be a table index in \[0, 1\), got .*=2"):
        TableBatchedLayout([TableSpec(4, 3)], [0, 2])
    with pytest.raises(ValueError, match=r"feature_names has 1 names for 2 features"):
        TableBatchedLayout([TableSpec(4, 3)], [0, 0], ["a"])
    with pytest.raises(TypeError, match=r"tables\[0\] must be a TableSpec, got tuple"):
        TableBatchedLayout([(4, 3)], [0])
    with pytest.raises(ValueError, match="layout has no features"):
        pooled_embedding_lookup(
            torch.zeros(12),
            TableBatchedLayout([TableSpec(4, 3)], []),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
        )
