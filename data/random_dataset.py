"""torchrec's ``RandomRecDataset``: random DLRM batches for examples, smoke tests and benchmarks.

Same arguments, defaults and random stream as ``torchrec.datasets.random.RandomRecDataset`` (1.8): with one
``manual_seed`` both yield the same ids, lengths, dense features and labels, so a script ported from torchrec (its
``dlrm_main`` builds its random data loader this way) trains on the very batches it did. Per batch and feature, the
bag lengths are drawn from ``U[min_ids, ids]`` (int32) and then the ids from ``U[0, hash_size)``; then the dense
features (``randn``) and the labels (0/1, int64). The batches are this project's :class:`~tritonrec.data.batch.Batch`
(``valid_mask`` all True). ``num_generated_batches`` batches are drawn up front and cycled (a negative count draws
each batch on the fly); without ``manual_seed`` the global torch generator draws them.

torchrec's defaults, kept: ``hash_size`` 100, ``ids_per_feature`` 2, and every bag exactly ``ids_per_feature`` long
when only that is given (its ``min_ids_per_feature`` defaults to it); ``U[0, ids]`` when the per-feature list
``ids_per_features`` is given without minimums. Where torchrec reads a 0 as "not given" (``hash_size=0`` or
``ids_per_feature=0`` become 100 and 2), a 0 here is refused (a hash size) or honoured (empty bags).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from tritonrec.data.batch import Batch
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.kernels.checks import check_int, check_optional_int


def _per_key(name: str, values: Sequence[int] | None, one: int | None, default: int, keys: list[str]) -> list[int]:
    """The per-key list ``values``, else ``one`` (or ``default``) for every key; checked: one per key."""
    if values is None:
        single = default if one is None else check_int(one, name.removesuffix("s"), 0)
        return [single] * len(keys)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of ints, one per key, got {values!r}")
    if len(values) != len(keys):
        raise ValueError(f"{name} must have one entry per key ({len(keys)} keys), got {len(values)}: {list(values)}")
    return [check_int(v, f"{name}[{i}]", 0) for i, v in enumerate(values)]


class RandomRecDataset(IterableDataset[Batch]):
    """Random DLRM batches (torchrec's class, see the module docstring).

    Args:
        keys: sparse feature names.
        batch_size: samples per batch ``B``.
        hash_size / hash_sizes: ids are drawn below this (one for all keys / one per key; the list wins).
        ids_per_feature / ids_per_features: the longest bag (one for all keys / per key; the list wins).
        num_dense: dense features per sample.
        manual_seed: seed of the batches' own generator (None: the global one).
        num_batches: batches per iteration (None: endless).
        num_generated_batches: batches drawn up front and cycled (negative: draw every batch on the fly).
        min_ids_per_feature / min_ids_per_features: the shortest bag (see the module docstring for the default).
    """

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_size: int | None = None,
        hash_sizes: list[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: list[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        num_generated_batches: int = 10,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(keys, (list, tuple)) or not keys or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must be a non-empty list of feature names, got {keys!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be distinct, got {list(keys)}")
        self.keys = list(keys)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.hash_sizes = _per_key("hash_sizes", hash_sizes, hash_size, 100, self.keys)
        if any(h < 1 for h in self.hash_sizes):
            raise ValueError(f"hash sizes must be positive, got hash_sizes={self.hash_sizes}")
        self.ids_per_features = _per_key("ids_per_features", ids_per_features, ids_per_feature, 2, self.keys)
        if min_ids_per_features is None and min_ids_per_feature is None:
            min_ids_per_feature = ids_per_feature  # torchrec's default: bags exactly ids_per_feature long
        self.min_ids_per_features = _per_key(
            "min_ids_per_features", min_ids_per_features, min_ids_per_feature, 0, self.keys
        )
        for key, low, high in zip(self.keys, self.min_ids_per_features, self.ids_per_features, strict=True):
            if low > high:
                raise ValueError(f"feature {key!r}: min_ids_per_features {low} is above ids_per_features {high}")
        self.num_dense = check_int(num_dense, "num_dense", 0)
        self.num_batches = check_optional_int(num_batches, "num_batches", 0)
        self.num_generated_batches = check_int(num_generated_batches, "num_generated_batches")
        if self.num_generated_batches == 0:  # nothing to cycle (torchrec divides by zero on the first batch)
            raise ValueError(
                "num_generated_batches must be positive (batches drawn up front and cycled) or negative (drawn on "
                "the fly), got num_generated_batches=0"
            )
        self.generator = None
        if manual_seed is not None:
            self.generator = torch.Generator().manual_seed(check_int(manual_seed, "manual_seed"))
        self._generated = [self._generate() for _ in range(max(self.num_generated_batches, 0))]

    def _generate(self) -> Batch:
        """One batch, drawn in torchrec's order (per key: lengths, then ids; then dense, then labels)."""
        values, lengths = [], []
        for hash_size, low, high in zip(self.hash_sizes, self.min_ids_per_features, self.ids_per_features, strict=True):
            length = torch.randint(low, high + 1, (self.batch_size,), dtype=torch.int32, generator=self.generator)
            values.append(torch.randint(0, hash_size, (int(length.sum()),), generator=self.generator))
            lengths.append(length)
        sparse = KeyedJaggedTensor(keys=self.keys, values=torch.cat(values), lengths=torch.cat(lengths))
        dense = torch.randn(self.batch_size, self.num_dense, generator=self.generator)
        labels = torch.randint(0, 2, (self.batch_size,), generator=self.generator)
        return Batch(dense, sparse, labels, torch.ones(self.batch_size, dtype=torch.bool))

    def _stream(self) -> Iterator[Batch]:
        if self.num_generated_batches > 0:
            return itertools.cycle(self._generated)
        return (self._generate() for _ in itertools.count())

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(self._stream(), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("RandomRecDataset without num_batches is endless: it has no len()")
        return self.num_batches


__all__ = ["RandomRecDataset"]
