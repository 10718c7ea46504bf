"""Very wide tables: the output column order is built as a tensor (no Python list per column), and widths the
kernels cannot index (int32 column offsets) are refused with an error that names the table and the limit."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from tritonrec.kernels.embedding import TableBatchedLayout, TableSpec
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from tritonrec.modules.table_batched import pooled_column_order


def _python_peak_mib(build) -> float:
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_wide_tables_build_without_per_column_python_lists() -> None:
    wide = 2**24  # 16.8 M columns: a list of column indices alone would take > 600 MiB

    def build() -> None:
        EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(num_embeddings=1, embedding_dim=wide, name="a", feature_names=["fa"]),
                EmbeddingBagConfig(
                    num_embeddings=1, embedding_dim=8, name="b", feature_names=["fb"], data_type=DataType.FP16
                ),
                EmbeddingBagConfig(num_embeddings=1, embedding_dim=wide, name="c", feature_names=["fc"]),
            ],
            device="meta",
        )  # dtype groups (a, c) and (b): the output columns need re-ordering

    assert _python_peak_mib(build) < 16


def test_pooled_column_order_is_a_tensor() -> None:
    assert pooled_column_order([(["x", "y"], [2, 1])], ["x", "y"]) is None  # already in order
    order = pooled_column_order([(["x", "z"], [2, 1]), (["y"], [3])], ["x", "y", "z"])
    assert isinstance(order, torch.Tensor) and order.dtype == torch.int64
    assert order.tolist() == [0, 1, 3, 4, 5, 2]


@pytest.mark.parametrize(
    ("dims", "pattern"),
    [
        ([2**31], r"table 0 \('t0'\) has dim 2147483648"),
        ([2**30, 2**30], r"pooled output would be 2147483648 columns wide"),
    ],
)
def test_widths_past_int32_are_refused(dims: list[int], pattern: str) -> None:
    tables = [TableSpec(1, d, name=f"t{i}") for i, d in enumerate(dims)]
    with pytest.raises(ValueError, match=pattern + r".*int32.*2147483647"):
        TableBatchedLayout(tables, list(range(len(dims))))


def test_modules_refuse_dims_past_int32_on_the_meta_device() -> None:
    with pytest.raises(ValueError, match=r"has dim 2147483648.*int32"):
        EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(num_embeddings=1, embedding_dim=2**31, name="t", feature_names=["f"])],
            device="meta",
        )
    with pytest.raises(ValueError, match=r"has dim 2147483648.*int32"):
        EmbeddingCollection(
            tables=[EmbeddingConfig(num_embeddings=1, embedding_dim=2**31, name="t", feature_names=["f"])],
            device="meta",
        )
