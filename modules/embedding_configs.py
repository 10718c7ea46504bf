"""Embedding table configs with torchrec's names, fields and field order (so torchrec code ports unchanged).

``EmbeddingBagConfig(num_embeddings, embedding_dim, name, data_type, feature_names, weight_init_max,
weight_init_min, init_fn, pooling)`` - every field may be passed by keyword, as torchrec's examples do. When no
``init_fn`` is given the weights are drawn from ``U(weight_init_min, weight_init_max)``, defaulting to
``±sqrt(1 / num_embeddings)`` (torchrec's rule).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from tritonrec.kernels.checks import check_int
from tritonrec.kernels.embedding import BoundsCheckMode, PoolingMode


class PoolingType(enum.Enum):
    """How a bag's rows combine (torchrec's values)."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    """Storage type of a table's weights (torchrec's values). INT8 / INT4 / INT2 are inference-only (QuantEBC)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"


FLOAT_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}
# bits per weight of the data types QuantEmbeddingBagCollection stores (torchrec's DATA_TYPE_NUM_BITS for the ones its
# quantized EBC accepts on CPU; BF16 is not among them)
QUANT_BITS: dict[DataType, int] = {
    DataType.FP32: 32,
    DataType.FP16: 16,
    DataType.INT8: 8,
    DataType.INT4: 4,
    DataType.INT2: 2,
}
_POOLING_MODES = {
    PoolingType.SUM: PoolingMode.SUM,
    PoolingType.MEAN: PoolingMode.MEAN,
    PoolingType.NONE: PoolingMode.NONE,
}


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a float table (INT8 / INT4 / INT2 tables store uint8 codes, see
    QuantEmbeddingBagCollection)."""
    if data_type not in FLOAT_DTYPES:
        raise ValueError(f"data_type {data_type} has no float storage dtype; quantized tables are inference-only")
    return FLOAT_DTYPES[data_type]


def pooling_type_to_pooling_mode(pooling: PoolingType) -> PoolingMode:
    return _POOLING_MODES[pooling]


@dataclass
class BaseEmbeddingConfig:
    """One table: ``num_embeddings`` rows of ``embedding_dim`` columns, read by ``feature_names``."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    init_fn: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        label = f"table {self.name!r}" if self.name else "table"
        self.num_embeddings = check_int(self.num_embeddings, "num_embeddings", 1, context=label)
        self.embedding_dim = check_int(self.embedding_dim, "embedding_dim", 1, context=label)
        if not isinstance(self.name, str):
            raise TypeError(f"{label}: name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.data_type, DataType):
            raise TypeError(f"{label}: data_type must be a DataType, got {self.data_type!r}")
        if not isinstance(self.feature_names, (list, tuple)) or not all(isinstance(f, str) for f in self.feature_names):
            raise TypeError(f"{label}: feature_names must be a list of str, got {self.feature_names!r}")
        self.feature_names = list(self.feature_names)
        if self.get_weight_init_min() > self.get_weight_init_max():
            raise ValueError(
                f"{label}: weight_init_min ({self.get_weight_init_min()}) exceeds weight_init_max "
                f"({self.get_weight_init_max()})"
            )
        if self.init_fn is None:
            self.init_fn = partial(torch.nn.init.uniform_, a=self.get_weight_init_min(), b=self.get_weight_init_max())

    def get_weight_init_max(self) -> float:
        return math.sqrt(1 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max

    def get_weight_init_min(self) -> float:
        return -math.sqrt(1 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A table whose lookups are pooled per bag (``pooling`` SUM or MEAN)."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.pooling, PoolingType) or self.pooling == PoolingType.NONE:
            raise ValueError(f"table {self.name!r}: pooling must be PoolingType.SUM or MEAN, got {self.pooling!r}")


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """A table whose lookups return one row per value (sequence embeddings)."""


def get_embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Each table's output (embedding) names, in config order (torchrec's rule): a feature read by several tables
    is ``f"{feature}@{table}"`` in every table that reads it, an unshared feature keeps its own name. Pooled
    outputs are keyed by these names, while the KJT key each one reads stays the plain feature name."""
    readers: dict[str, int] = {}
    for config in tables:
        for feature in config.feature_names:
            readers[feature] = readers.get(feature, 0) + 1
    return [
        [f"{feature}@{config.name}" if readers[feature] > 1 else feature for feature in config.feature_names]
        for config in tables
    ]


def get_embedding_names(tables: Sequence[BaseEmbeddingConfig]) -> list[str]:
    """Every table's embedding names, table after table: the keys of a pooled collection's output."""
    return [name for names in get_embedding_names_by_table(tables) for name in names]


__all__ = [
    "BaseEmbeddingConfig",
    "BoundsCheckMode",
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "PoolingType",
    "data_type_to_dtype",
    "get_embedding_names",
    "get_embedding_names_by_table",
    "pooling_type_to_pooling_mode",
]
