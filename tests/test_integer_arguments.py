"""Integer arguments across the public entries go through one check (``tritonrec.kernels.checks.check_int``): a Python
int or a numpy integer is taken (``operator.index``, as torchrec and NeMo-RL take them) and stored as a Python int; a
bool, a float or a tensor raises ``NotAnIntError`` (a ``TypeError`` and a ``ValueError``) naming the argument.
Before, several entries refused ``np.int64(3)`` and a few size arguments took ``True`` as 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tritonrec.data import BatchedDataDict, KeyedJaggedTensor, KeyedTensor
from tritonrec.data.packing import get_packer
from tritonrec.dist import table_wise
from tritonrec.dist.planner import ParameterConstraints, Topology
from tritonrec.kernels import (
    block_bucketize_sparse_features,
    dense_to_jagged,
    jagged_to_padded_dense,
    permute_2d_sparse_data,
)
from tritonrec.kernels.checks import NotAnIntError, check_int, check_optional_int
from tritonrec.kernels.embedding.layout import TableSpec
from tritonrec.kernels.packing_plan import make_packing_plan
from tritonrec.modules import EmbeddingBagConfig


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), np.intp(3)])
def test_check_int_takes_ints_and_numpy_integers_as_python_ints(value: Any) -> None:
    got = check_int(value, "size", 1)
    assert got == 3 and type(got) is int
    assert check_optional_int(None, "size", 1) is None
    with pytest.raises(ValueError, match=r"size must be an int in \[0, 4\], got size=np.int64\(5\)$"):
        check_int(np.int64(5), "size", 0, 4)


@pytest.mark.parametrize(
    ("value", "kind"),
    [(True, "a bool"), (np.True_, "a bool"), (3.0, "a float"), (torch.tensor(3), "a Tensor"), ("3", "a str")],
)
def test_check_int_refuses_other_types_naming_the_argument(value: Any, kind: str) -> None:
    with pytest.raises(NotAnIntError, match=rf"size must be a positive int, got size=.* \({kind}\)") as caught:
        check_int(value, "size", 1)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)


def _kjt(**kwargs: Any) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["a", "b"], torch.arange(5), lengths=torch.tensor([2, 1, 0, 2]), **kwargs)


def _bdd() -> BatchedDataDict:
    return BatchedDataDict({"x": torch.arange(8), "y": list(range(8))})


def _lookup_args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(6, dtype=torch.float32).reshape(3, 2), torch.tensor([0, 1, 3])


def _bucketize(num_buckets: Any) -> Any:
    return block_bucketize_sparse_features(
        torch.tensor([2, 1]), torch.tensor([0, 5, 3]), torch.tensor([4]), num_buckets, backend="torch"
    )


def _permute(total: Any) -> Any:
    lengths = torch.tensor([[1, 2], [0, 1]])
    return permute_2d_sparse_data(torch.tensor([1, 0]), lengths, torch.arange(4), None, total, backend="torch")


def _plan(pad_to_multiple: Any) -> Any:
    return make_packing_plan(torch.tensor([1, 0]), torch.tensor([0, 2]), lengths=torch.tensor([2, 3]), padded_len=4,
                             pad_to_multiple=pad_to_multiple)  # fmt: skip


# (entry called with the argument, argument name in the error, a valid value)
ENTRIES: list[tuple[Callable[[Any], Any], str, Any]] = [
    (lambda v: _kjt(stride=v), "stride", 2),
    (lambda v: _kjt(length_per_key=[v, 2]), r"length_per_key\[0\]", 3),
    (lambda v: _kjt(stride_per_key_per_rank=[[v], [2]]), r"stride_per_key_per_rank\[0\]\[0\]", 2),
    (lambda v: KeyedTensor(["a", "b"], [v, 2], torch.zeros(2, 3)), r"length_per_key\[0\]", 1),
    (lambda v: _bdd().shard_by_batch_size(shards=v), "shards", 2),
    (lambda v: _bdd().shard_by_batch_size(shards=2, batch_size=v), "batch_size", 4),
    (lambda v: _bdd().chunk(v, 2), "rank", 1),
    (lambda v: _bdd().slice(0, v), "end", 4),
    (lambda v: get_packer("first_fit_decreasing", bin_capacity=v), "bin_capacity", 16),
    (lambda v: jagged_to_padded_dense(*_lookup_args(), max_len=v, backend="torch"), "max_len", 2),
    (lambda v: dense_to_jagged(torch.zeros(2, 3, 2), torch.tensor([0, 1, 3]), total_len=v), "total_len", 3),
    (_bucketize, "num_buckets", 2),
    (_permute, "permuted_lengths_sum", 4),
    (_plan, "pad_to_multiple", 2),
    (lambda v: TableSpec(num_rows=v, dim=4), "num_rows", 10),
    (lambda v: ParameterConstraints(min_partition=v), "min_partition", 8),
    (lambda v: ParameterConstraints(batch_sizes=[v]), r"batch_sizes\[0\]", 4),
    (lambda v: Topology(world_size=v, compute_device="cpu"), "world_size", 2),
    (
        lambda v: EmbeddingBagConfig(num_embeddings=v, embedding_dim=4, name="t", feature_names=["f"]),
        "num_embeddings",
        10,
    ),
]


@pytest.mark.parametrize(("entry", "name", "value"), ENTRIES, ids=[name.replace("\\", "") for _, name, _ in ENTRIES])
def test_public_entries_take_numpy_integers_and_refuse_bools(entry: Any, name: str, value: int) -> None:
    expected = entry(value)
    got = entry(np.int64(value))
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    elif isinstance(expected, tuple):
        assert all(e is None or torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    with pytest.raises(NotAnIntError, match=rf"{name} must be .*=True \(a bool\)"):
        entry(True)


def test_numpy_integers_are_stored_as_python_ints() -> None:
    constraints = ParameterConstraints(min_partition=np.int64(8), batch_sizes=[np.int64(4)], pooling_factors=[
        np.int64(2)])  # fmt: skip
    assert type(constraints.min_partition) is int and [type(b) for b in constraints.batch_sizes] == [int]
    assert type(_kjt(stride=np.int64(2)).stride()) is int
    assert type(get_packer("first_fit_decreasing", bin_capacity=np.int64(16)).bin_capacity) is int
    assert table_wise(rank=np.int64(1)) is not None
    indices = _bdd().select_indices(np.array([3, 1]))
    assert indices["y"] == [3, 1] and torch.equal(indices["x"], torch.tensor([3, 1]))
