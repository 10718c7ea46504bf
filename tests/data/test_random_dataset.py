"""RandomRecDataset: torchrec's random DLRM batches (arguments, defaults, random stream), as this project's Batch."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from tritonrec.data import Batch, RandomRecDataset


def test_the_stream_is_drawn_in_torchrecs_order() -> None:
    """The first batch re-derived from the seed: per key its lengths (int32) then its ids, then dense, then labels."""
    dataset = RandomRecDataset(["a", "b"], 4, hash_sizes=[10, 1000], ids_per_features=[3, 1], num_dense=2,
                               manual_seed=11, num_generated_batches=1)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    lengths_a = torch.randint(0, 4, (4,), dtype=torch.int32, generator=g)
    ids_a = torch.randint(0, 10, (int(lengths_a.sum()),), generator=g)
    lengths_b = torch.randint(0, 2, (4,), dtype=torch.int32, generator=g)
    ids_b = torch.randint(0, 1000, (int(lengths_b.sum()),), generator=g)
    dense, labels = torch.randn(4, 2, generator=g), torch.randint(0, 2, (4,), generator=g)
    batch = next(iter(dataset))
    assert isinstance(batch, Batch) and batch.sparse_features.keys() == ["a", "b"]
    assert torch.equal(batch.sparse_features.lengths(), torch.cat([lengths_a, lengths_b]))
    assert torch.equal(batch.sparse_features.values(), torch.cat([ids_a, ids_b]))
    assert torch.equal(batch.dense_features, dense) and torch.equal(batch.labels, labels)
    assert batch.valid_mask.all() and batch.valid_mask.shape == (4,)


def test_defaults_and_bag_lengths() -> None:
    fixed = next(iter(RandomRecDataset(["a", "b", "c"], 64, ids_per_feature=3, manual_seed=0)))
    assert (fixed.sparse_features.lengths() == 3).all()  # only ids_per_feature: every bag that long (torchrec)
    assert fixed.dense_features.shape == (64, 50) and int(fixed.sparse_features.values().max()) < 100
    ranged = next(iter(RandomRecDataset(["a"], 512, ids_per_features=[4], min_ids_per_features=[2], manual_seed=0)))
    assert set(ranged.sparse_features.lengths().tolist()) == {2, 3, 4}
    default = next(iter(RandomRecDataset(["a"], 512, manual_seed=0)))
    assert set(default.sparse_features.lengths().tolist()) == {0, 1, 2}  # ids_per_feature 2, no minimum
    assert set(default.labels.tolist()) == {0, 1} and default.labels.dtype == torch.int64
    empty = next(iter(RandomRecDataset(["a"], 8, ids_per_feature=0, manual_seed=0)))
    assert empty.sparse_features.values().numel() == 0  # a 0 is honoured (torchrec reads it as 2)


def test_generated_batches_are_cycled_or_drawn_on_the_fly() -> None:
    cycled = list(RandomRecDataset(["a"], 4, manual_seed=1, num_batches=5, num_generated_batches=2))
    assert len(cycled) == 5 and cycled[0] is cycled[2] is cycled[4] and cycled[0] is not cycled[1]
    fresh = list(RandomRecDataset(["a"], 16, manual_seed=1, num_batches=4, num_generated_batches=-1))
    dense = [b.dense_features for b in fresh]
    assert all(not torch.equal(x, y) for x, y in itertools.combinations(dense, 2))


def test_seeds_repeat_and_num_batches_bounds_the_iteration() -> None:
    first, again = (list(RandomRecDataset(["a"], 8, manual_seed=5, num_batches=3)) for _ in range(2))
    other = list(RandomRecDataset(["a"], 8, manual_seed=6, num_batches=3))
    assert all(torch.equal(x.dense_features, y.dense_features) for x, y in zip(first, again, strict=True))
    assert not torch.equal(first[0].dense_features, other[0].dense_features)
    endless = RandomRecDataset(["a"], 2, manual_seed=0)
    assert len(list(itertools.islice(endless, 25))) == 25
    with pytest.raises(TypeError, match="endless"):
        len(endless)
    assert len(RandomRecDataset(["a"], 2, num_batches=7)) == 7


def test_a_data_loader_passes_the_batches_through() -> None:
    """torchrec's dlrm_main wraps it in ``DataLoader(dataset, batch_size=None)``."""
    dataset = RandomRecDataset(["a", "b"], 6, manual_seed=2, num_batches=3)
    loaded = list(DataLoader(dataset, batch_size=None))
    assert [b.batch_size for b in loaded] == [6, 6, 6]
    assert torch.equal(loaded[1].sparse_features.values(), list(dataset)[1].sparse_features.values())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"keys": []}, TypeError, "keys"),
        ({"keys": ["a", "a"]}, ValueError, "distinct"),
        ({"keys": "ab"}, TypeError, "keys"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": True}, TypeError, "batch_size"),
        ({"hash_size": 0}, ValueError, "hash sizes must be positive"),
        ({"hash_sizes": [5]}, ValueError, r"hash_sizes must have one entry per key \(2 keys\)"),
        ({"ids_per_features": [1, -1]}, ValueError, r"ids_per_features\[1\]"),
        ({"ids_per_feature": 1, "min_ids_per_feature": 2}, ValueError, "feature 'a': min_ids_per_features 2"),
        ({"num_dense": -1}, ValueError, "num_dense"),
        ({"num_batches": -1}, ValueError, "num_batches"),
        ({"manual_seed": 1.5}, TypeError, "manual_seed"),
        ({"num_generated_batches": 0}, ValueError, "num_generated_batches=0"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, error: type, message: str) -> None:
    args = {"keys": ["a", "b"], "batch_size": 4, **kwargs}
    with pytest.raises(error, match=message):
        RandomRecDataset(**args)
