"""Input checks shared by the table-batched lookup ops; every message names the argument and the offending value."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tritonrec.kernels.checks import check_offsets, check_same_device, check_tensor, value_checks_enabled
from tritonrec.kernels.embedding.layout import BoundsCheckMode, TableBatchedLayout, feature_value_offsets
from tritonrec.kernels.embedding.optim_state import PER_ELEMENT_MOMENTUM1, FusedOptimizerState

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_layout(layout: object) -> TableBatchedLayout:
    if not isinstance(layout, TableBatchedLayout):
        raise TypeError(f"layout must be a TableBatchedLayout, got {type(layout).__name__}")
    if layout.num_features == 0:
        raise ValueError("layout has no features (feature_tables is empty); there is nothing to look up")
    return layout


def check_weights(weights: object, layout: TableBatchedLayout) -> torch.Tensor:
    check_tensor(weights, "weights", ndim=1, dtypes=WEIGHT_DTYPES)
    if weights.numel() != layout.num_weights:
        raise ValueError(
            f"weights must hold layout.num_weights = {layout.num_weights} elements (sum of rows * dim over the "
            f"tables), got {weights.numel()}"
        )
    if not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous, got stride {weights.stride()}")
    return weights


def check_indices(indices: object) -> torch.Tensor:
    return check_tensor(indices, "indices", ndim=1, integer=True)


def check_pooled_offsets(offsets: object, layout: TableBatchedLayout) -> int:
    """``offsets [F * B + 1]``; returns the batch size B (their values: :func:`check_pooled_values`)."""
    check_tensor(offsets, "offsets", ndim=1, integer=True)
    num_features = layout.num_features
    if offsets.numel() == 0 or (offsets.numel() - 1) % num_features:
        raise ValueError(
            f"offsets must have F * B + 1 entries for F = {num_features} features, got {offsets.numel()} entries"
        )
    return (offsets.numel() - 1) // num_features


def check_per_value(t: torch.Tensor | None, name: str, num_values: int) -> None:
    if t is None:
        return
    check_tensor(t, name, ndim=1, dtypes=_FLOAT_DTYPES)
    if t.numel() != num_values:
        raise ValueError(f"{name} must have one entry per index ({num_values}), got {t.numel()}")


def check_bag_divisors(bag_divisors: torch.Tensor | None, layout: TableBatchedLayout, batch_size: int) -> None:
    if bag_divisors is None:
        return
    check_tensor(bag_divisors, "bag_divisors", ndim=1, dtypes=_FLOAT_DTYPES)
    num_bags = layout.num_features * batch_size
    if bag_divisors.numel() != num_bags:
        raise ValueError(f"bag_divisors must have one entry per bag (F * B = {num_bags}), got {bag_divisors.numel()}")


def check_pooled_values(
    offsets: torch.Tensor, bag_divisors: torch.Tensor | None, num_values: int, read_also: torch.Tensor | None = None
) -> list[int]:
    """Value checks of a pooled lookup's offsets and divisors (read tensor contents: run inside the ops).
    ``read_also`` is read in the offsets' sync and returned (see :func:`~tritonrec.kernels.checks.check_offsets`)."""
    also = check_offsets(offsets, "offsets", total=num_values, read_also=read_also)
    if value_checks_enabled() and bag_divisors is not None and bag_divisors.numel():
        nonempty = (offsets[1:] - offsets[:-1]) > 0
        bad = nonempty & ~(bag_divisors > 0)  # NaN is not positive either
        if bool(bad.any()):
            where = int(bad.nonzero()[0].item())
            raise ValueError(
                f"bag_divisors must be positive for non-empty bags, got bag_divisors[{where}] = "
                f"{bag_divisors[where].item()} for a bag of {int((offsets[where + 1] - offsets[where]).item())} values"
            )
    return also


def checked_feature_starts(
    offsets: torch.Tensor, bag_divisors: torch.Tensor | None, num_values: int, num_features: int, batch_size: int
) -> list[int]:
    """:func:`check_pooled_values`, and each feature's first value (``[F + 1]`` host ints, as
    :func:`~tritonrec.kernels.embedding.layout.feature_value_offsets`) read in the same sync: one host read on an
    accelerator instead of two."""
    if batch_size == 0:
        check_pooled_values(offsets, bag_divisors, num_values)
        return feature_value_offsets(offsets, num_features, batch_size)
    return check_pooled_values(offsets, bag_divisors, num_values, read_also=offsets[::batch_size])


def check_table_weights(
    table_weights: Sequence[torch.Tensor] | None, weights: torch.Tensor, layout: TableBatchedLayout
) -> None:
    """``table_weights[t]`` must be the ``[rows, dim]`` view of table ``t`` inside ``weights`` (same storage)."""
    if table_weights is None:
        return
    if len(table_weights) != layout.num_tables:
        raise ValueError(
            f"table_weights must hold one tensor per table ({layout.num_tables}), got {len(table_weights)}"
        )
    base = 0 if torch.compiler.is_compiling() else weights.data_ptr()
    for t, (tw, spec) in enumerate(zip(table_weights, layout.tables, strict=True)):
        check_tensor(tw, f"table_weights[{t}]", ndim=2, dtypes=(weights.dtype,))
        expected = base + layout.table_weight_offsets[t] * weights.element_size()
        # dynamo cannot read addresses: while tracing only the shapes are checked
        moved = not torch.compiler.is_compiling() and tw.numel() and tw.data_ptr() != expected
        if tuple(tw.shape) != (spec.num_rows, spec.dim) or moved:
            raise ValueError(
                f"table_weights[{t}] must be the [{spec.num_rows}, {spec.dim}] view of {layout.table_label(t)} inside "
                f"weights (the flat buffer), got a tensor of shape {tuple(tw.shape)} at another address"
            )


def check_fused(fused: FusedOptimizerState | None, layout: TableBatchedLayout, weights: torch.Tensor) -> None:
    if fused is None:
        return
    if not isinstance(fused, FusedOptimizerState):
        raise TypeError(f"fused must be a FusedOptimizerState or None, got {type(fused).__name__}")
    sizes = {"momentum1": layout.num_rows, "momentum2": layout.num_weights}
    if fused.optim in PER_ELEMENT_MOMENTUM1:
        sizes["momentum1"] = layout.num_weights
    for name, tensor in fused.state_tensors().items():
        expected = layout.num_tables if name == "step" else sizes[name]
        if tensor.numel() != expected:
            raise ValueError(f"fused.{name} must hold {expected} entries for this layout, got {tensor.numel()}")
        check_same_device(weights=weights, **{f"fused.{name}": tensor})


def check_bounds_mode(mode: object) -> BoundsCheckMode:
    if not isinstance(mode, BoundsCheckMode):
        raise TypeError(f"bounds_check must be a BoundsCheckMode, got bounds_check={mode!r}")
    return mode
