"""Shared builders and torch references for the table-batched embedding tests (small shapes: the Triton path runs
under the interpreter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from tritonrec.kernels.embedding import PoolingMode, TableBatchedLayout, TableSpec

BACKENDS = ("triton", "torch")


@dataclass
class PooledCase:
    """A table-batched pooled lookup input: ``indices`` key-major, ``offsets [F * B + 1]``."""

    layout: TableBatchedLayout
    weights: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None
    batch_size: int

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def feature_value_offsets(self) -> list[int]:
        return self.offsets[:: self.batch_size].tolist()


def make_layout(
    dims: Sequence[int],
    rows: Sequence[int] | None = None,
    poolings: Sequence[PoolingMode] | None = None,
    feature_tables: Sequence[int] | None = None,
) -> TableBatchedLayout:
    rows = rows or [7] * len(dims)
    poolings = poolings or [PoolingMode.SUM] * len(dims)
    specs = [TableSpec(r, d, p, f"t{i}") for i, (r, d, p) in enumerate(zip(rows, dims, poolings, strict=True))]
    feature_tables = list(range(len(dims))) if feature_tables is None else list(feature_tables)
    return TableBatchedLayout(specs, feature_tables, [f"f{i}" for i in range(len(feature_tables))])


def make_case(
    layout: TableBatchedLayout,
    lengths: Sequence[int] | torch.Tensor,
    batch_size: int,
    weighted: bool = False,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
    weight_dtype: torch.dtype = torch.float32,
) -> PooledCase:
    """Random weights and in-range indices for bag ``lengths [F * B]`` (key-major)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=index_dtype)
    offsets[1:] = lengths.cumsum(0)
    parts = []
    for f, t in enumerate(layout.feature_tables):
        count = int(lengths[f * batch_size : (f + 1) * batch_size].sum())
        parts.append(torch.randint(0, max(layout.tables[t].num_rows, 1), (count,), generator=gen))
    indices = torch.cat(parts).to(index_dtype) if parts else torch.zeros(0, dtype=index_dtype)
    weights = torch.randn(layout.num_weights, generator=gen).to(weight_dtype)
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return PooledCase(layout, weights, indices, offsets, psw, batch_size)


def pooled_reference(case: PooledCase, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-table ``torch.nn.EmbeddingBag`` semantics in fp32 through its functional form (differentiable in the
    weights and per-sample weights); weighted MEAN = weighted sum / bag length."""
    layout, batch = case.layout, case.batch_size
    weights = case.weights if weights is None else weights
    starts = case.feature_value_offsets()
    outs = []
    for f, t in enumerate(layout.feature_tables):
        spec = layout.tables[t]
        table = layout.table_view(weights, t).float()
        bag_offsets = case.offsets[f * batch : (f + 1) * batch + 1].long() - starts[f]
        idx = case.indices[starts[f] : starts[f + 1]].long()
        psw = None if case.per_sample_weights is None else case.per_sample_weights[starts[f] : starts[f + 1]]
        mean = spec.pooling == PoolingMode.MEAN
        pooled = F.embedding_bag(
            idx,
            table,
            bag_offsets,
            mode="mean" if mean and psw is None else "sum",
            per_sample_weights=psw,
            include_last_offset=True,
        )
        if mean and psw is not None:
            pooled = pooled / (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1)[:, None]
        outs.append(pooled)
    return torch.cat(outs, dim=1)


def sequence_reference(layout: TableBatchedLayout, weights: torch.Tensor, indices: torch.Tensor, starts: list[int]):
    """Per-value ``F.embedding`` per feature, flattened and concatenated."""
    return torch.cat(
        [
            F.embedding(indices[starts[f] : starts[f + 1]].long(), layout.table_view(weights, t).float()).reshape(-1)
            for f, t in enumerate(layout.feature_tables)
        ]
    )


@st.composite
def pooled_cases(draw: st.DrawFn, max_tables: int = 3, max_dim: int = 9, max_len: int = 4) -> PooledCase:
    """Small random table-batched inputs: mixed dims and poolings, shared tables, empty bags, repeated ids."""
    num_tables = draw(st.integers(1, max_tables))
    dims = draw(st.lists(st.integers(1, max_dim), min_size=num_tables, max_size=num_tables))
    rows = draw(st.lists(st.integers(1, 6), min_size=num_tables, max_size=num_tables))
    poolings = draw(
        st.lists(st.sampled_from([PoolingMode.SUM, PoolingMode.MEAN]), min_size=num_tables, max_size=num_tables)
    )
    feature_tables = draw(st.lists(st.integers(0, num_tables - 1), min_size=1, max_size=4))
    batch = draw(st.integers(1, 3))
    lengths = draw(
        st.lists(st.integers(0, max_len), min_size=len(feature_tables) * batch, max_size=len(feature_tables) * batch)
    )
    layout = make_layout(dims, rows, poolings, feature_tables)
    return make_case(
        layout,
        lengths,
        batch,
        weighted=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )
