"""Synthetic recsys stream: seeded, endless (or of fixed length), learnable, and generated in seekable chunks.

Each sample has ``num_dense`` standard-normal dense features and one bag per sparse feature. A bag's length follows
the chosen pooling-factor distribution; its ids follow a bounded Zipf law over ``[0, num_embeddings)`` (rank ``r`` has
probability proportional to ``(r + 1) ** -zipf_alpha``), with ranks scattered over the table by a fixed permutation so
the hot rows are not all at the front (as with hashed ids).

Labels come from a hidden logistic model: ``logit = bias + dense @ v + sum_f mean_{id in bag f} w_f[id]``, label ~
Bernoulli(sigmoid(logit)). The weights are drawn once from ``seed`` and scaled so the logit's standard deviation is
about ``signal_std`` (split between dense and sparse by ``dense_share``); a model that learns the hot ids' weights
reaches an AUROC well above 0.5. ``stream`` picks an independent sample sequence under the same hidden model, so
stream 0 trains and stream 1 evaluates.

Samples are generated in chunks of ``chunk_size``; chunk ``c`` is drawn from its own generator seeded by
``(seed, stream, c)``, so ``iter_from(position)`` starts anywhere without replaying earlier samples and yields exactly
the samples an uninterrupted pass would.

Across ranks (``rank``, ``world_size``; see :mod:`tritonrec.data.sharding`): a stream of ``num_samples`` is cut into
contiguous row ranges, an endless one by chunks (rank ``r`` of ``W`` draws chunks ``r, r + W, ...``), so the ranks
together draw every sample of the single-process stream once. ``shuffle_buffer > 1`` permutes each rank's samples
within blocks of that many, differently every epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import numpy as np

from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec, RecElement, check_position
from tritonrec.data.sharding import Shard, block_shuffled, check_seed, check_shuffle_buffer, elements_of
from tritonrec.kernels.checks import check_int, check_optional_int

POOLING_DISTRIBUTIONS = ("fixed", "poisson", "uniform")
_HIDDEN_MODEL_STREAM = 2**31 - 1  # generator stream of the hidden weights, disjoint from any sample stream


def _per_feature(value: float | Sequence[float], num_features: int, name: str) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_features
    if len(values) != num_features:
        raise ValueError(f"{name} must be one number or one per sparse feature ({num_features}), got {value!r}")
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v < 0:
            raise ValueError(f"{name} entries must be non-negative finite numbers, got {name}={value!r}")
    return [float(v) for v in values]


class SyntheticRecSource:
    """Seeded synthetic samples with Zipf ids and labels from a hidden logistic model (see module docstring).

    Args:
        num_embeddings: id range of each sparse feature (one table row per id); its length is the number of features.
        num_dense: dense features per sample (``Dd``).
        keys: sparse feature names; ``cat_0, cat_1, ...`` by default (Criteo's names).
        zipf_alpha: Zipf exponent of the id distribution (> 0; larger is more skewed).
        pooling: ``"fixed"`` (every bag has ``pooling_factor`` ids), ``"poisson"`` (Poisson with mean
            ``pooling_factor``, truncated to ``[min_pooling, max_pooling]``) or ``"uniform"`` (uniform on
            ``[min_pooling, max_pooling]``).
        pooling_factor: mean bag length, one value or one per feature (an integer for ``"fixed"``).
        min_pooling, max_pooling: bag length bounds of ``"poisson"`` and ``"uniform"`` (0 allows empty bags).
        num_samples: length of the stream; ``None`` streams forever.
        seed: fixes the hidden model and, with ``stream``, the samples.
        stream: independent sample sequence under the same hidden model (e.g. 0 train, 1 eval).
        signal_std: standard deviation of the hidden logit (larger is easier to learn).
        dense_share: fraction of the logit's variance carried by the dense features.
        bias: constant of the hidden logit (sets the positive rate; -1 gives about 30% positives).
        chunk_size: samples generated per vectorised draw.
        rank, world_size: this process's shard of the stream (see module docstring).
        shuffle_buffer: shuffle each epoch within blocks of this many samples (0 or 1: stream order).
        shuffle_seed: seeds the shuffle (with the epoch and the shard); ``seed`` fixes the samples themselves.
    """

    def __init__(
        self,
        num_embeddings: Sequence[int],
        num_dense: int = 13,
        keys: Sequence[str] | None = None,
        zipf_alpha: float = 1.1,
        pooling: str = "poisson",
        pooling_factor: float | Sequence[float] = 1.0,
        min_pooling: int = 0,
        max_pooling: int = 8,
        num_samples: int | None = None,
        seed: int = 0,
        stream: int = 0,
        signal_std: float = 2.0,
        dense_share: float = 0.25,
        bias: float = -1.0,
        chunk_size: int = 4096,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        shuffle_seed: int = 0,
    ) -> None:
        if not isinstance(num_embeddings, (list, tuple)) or not num_embeddings:
            raise ValueError(f"num_embeddings must be a non-empty list of positive ints, got {num_embeddings!r}")
        self._num_rows = [check_int(n, "num_embeddings[i]", 1) for n in num_embeddings]
        num_features = len(self._num_rows)
        keys = [f"cat_{i}" for i in range(num_features)] if keys is None else list(keys)
        if len(keys) != num_features:
            raise ValueError(f"keys must name the {num_features} sparse features, got keys={keys!r}")
        num_dense = check_int(num_dense, "num_dense", 0)
        self.element_spec = ElementSpec(num_dense, tuple(keys))
        for name, value in (("zipf_alpha", zipf_alpha), ("signal_std", signal_std)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {name}={value!r}")
        if not isinstance(dense_share, (int, float)) or not 0 <= dense_share <= 1:
            raise ValueError(f"dense_share must be in [0, 1], got dense_share={dense_share!r}")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise TypeError(f"bias must be a number, got bias={bias!r}")
        self._pooling_factors = _per_feature(pooling_factor, num_features, "pooling_factor")
        min_pooling, max_pooling = check_int(min_pooling, "min_pooling", 0), check_int(max_pooling, "max_pooling", 0)
        self._check_pooling(pooling, min_pooling, max_pooling)
        self.pooling, self.min_pooling, self.max_pooling = pooling, min_pooling, max_pooling
        self.num_samples = check_optional_int(num_samples, "num_samples", 0)
        self.seed, self.stream = check_int(seed, "seed", 0), check_int(stream, "stream", 0)
        self.chunk_size = check_int(chunk_size, "chunk_size", 1)
        self.shuffle_buffer = check_shuffle_buffer(shuffle_buffer)
        self.shuffle_seed = check_seed(shuffle_seed, "shuffle_seed")
        self._set_shard(Shard.of(rank, world_size))
        self._build_hidden_model(float(zipf_alpha), float(signal_std), float(dense_share), float(bias))

    def _set_shard(self, shard: Shard) -> None:
        self.shard = shard
        self.rank, self.world_size = shard.rank, shard.world_size
        self._rows = shard.range_of(0, self.num_samples) if self.num_samples is not None else None

    def sub_shard(self, index: int, count: int) -> SyntheticRecSource:
        """This source's part ``index`` of ``count`` (a loader worker's share of the rank's samples)."""
        part = copy.copy(self)
        part._set_shard(self.shard.split(index, count))
        return part

    def _check_pooling(self, pooling: object, min_pooling: int, max_pooling: int) -> None:
        if pooling not in POOLING_DISTRIBUTIONS:
            raise ValueError(f"pooling must be one of {POOLING_DISTRIBUTIONS}, got pooling={pooling!r}")
        if max_pooling < min_pooling:
            raise ValueError(f"max_pooling ({max_pooling}) must be >= min_pooling ({min_pooling})")
        if pooling == "fixed" and any(p != int(p) for p in self._pooling_factors):
            raise ValueError(f"pooling='fixed' needs integer pooling_factor, got {self._pooling_factors}")

    def _build_hidden_model(self, zipf_alpha: float, signal_std: float, dense_share: float, bias: float) -> None:
        rng = np.random.default_rng([self.seed, _HIDDEN_MODEL_STREAM])
        num_features, num_dense = len(self._num_rows), self.element_spec.dense_dim
        self._cdfs, self._rank_to_id, self._id_weights = [], [], []
        sparse_std = signal_std * np.sqrt((1.0 - dense_share) / num_features)
        for rows in self._num_rows:
            probs = np.arange(1, rows + 1, dtype=np.float64) ** -zipf_alpha
            cdf = np.cumsum(probs)
            self._cdfs.append(cdf / cdf[-1])
            self._rank_to_id.append(rng.permutation(rows))
            self._id_weights.append(rng.normal(0.0, sparse_std, rows).astype(np.float32))
        dense_std = signal_std * np.sqrt(dense_share / max(num_dense, 1))
        self._dense_weights = rng.normal(0.0, dense_std, num_dense).astype(np.float32)
        self._bias = bias

    # --------------------------------------------------------------------------------------------------- protocol
    @property
    def num_embeddings(self) -> dict[str, int]:
        return dict(zip(self.element_spec.sparse_keys, self._num_rows, strict=True))

    def __len__(self) -> int:
        """Samples of this shard in one pass."""
        if self._rows is None:
            raise TypeError("this SyntheticRecSource streams forever (num_samples=None) and has no length")
        return self._rows[1] - self._rows[0]

    def __iter__(self) -> Iterator[RecElement]:
        return self.iter_from(0)

    def iter_from(self, position: int = 0, epoch: int = 0) -> Iterator[RecElement]:
        """Samples of this shard from ``position`` on (``epoch`` only changes the order when shuffling)."""
        return elements_of(self.iter_chunks(position, epoch))

    def iter_chunks(self, position: int = 0, epoch: int = 0) -> Iterator[ElementChunk]:
        """The samples of :meth:`iter_from` as chunks."""
        check_position(position, epoch)
        if self._rows is not None and position > len(self):
            raise ValueError(f"position={position} is past the end of the stream ({len(self)} samples)")
        if self.shuffle_buffer > 1:
            return block_shuffled(
                self._stream_chunks, position, self.shuffle_buffer, self.shuffle_seed, epoch, self.shard
            )
        return self._stream_chunks(position)

    def _stream_chunks(self, position: int) -> Iterator[ElementChunk]:
        """This shard's samples in stream order from ``position``: a row range of a finite stream, every
        ``step``-th chunk of an endless one."""
        size = self.chunk_size
        if self._rows is not None:
            index, stop = self._rows[0] + position, self._rows[1]
            while index < stop:
                chunk_index, start = divmod(index, size)
                first = chunk_index * size
                chunk = self._chunk(chunk_index, min(size, self.num_samples - first))  # type: ignore[operator]
                end = min(stop - first, len(chunk))
                yield chunk.slice(start, end)
                index = first + end
            return
        offset, step = self.shard.stride()
        local_chunk, skip = divmod(position, size)
        while True:
            chunk = self._chunk(offset + local_chunk * step, size)
            yield chunk.slice(skip, size) if skip else chunk
            local_chunk, skip = local_chunk + 1, 0

    def _chunk(self, chunk_index: int, count: int) -> ElementChunk:
        dense, ids, lengths, _, labels = self.generate_chunk(chunk_index, count)
        return ElementChunk(dense, ids, lengths, labels)

    # ------------------------------------------------------------------------------------------------- generation
    def generate_chunk(
        self, chunk_index: int, count: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The first ``count`` samples of chunk ``chunk_index``, sample-major: ``dense [C, Dd]``, ``ids [N]``,
        ``lengths [C, F]``, ``offsets [C + 1]`` (sample ``i``'s ids are ``ids[offsets[i]:offsets[i + 1]]``) and
        ``labels [C]`` (0.0 / 1.0)."""
        rng = np.random.default_rng([self.seed, self.stream, chunk_index])
        size = self.chunk_size  # always draw a full chunk, so a short last chunk matches the full one's prefix
        dense = rng.standard_normal((size, self.element_spec.dense_dim), dtype=np.float32)
        logit = self._bias + dense @ self._dense_weights
        lengths = np.empty((size, len(self._num_rows)), dtype=np.int64)
        feature_ids = []
        for f, rows in enumerate(self._num_rows):
            bag_lengths = self._draw_lengths(rng, f, size)
            ranks = np.searchsorted(self._cdfs[f], rng.random(int(bag_lengths.sum())), side="right")
            ids = self._rank_to_id[f][np.minimum(ranks, rows - 1)]  # u == 1.0 exactly would land one past the end
            bag = np.repeat(np.arange(size), bag_lengths)
            sums = np.bincount(bag, weights=self._id_weights[f][ids], minlength=size)
            logit += sums / np.maximum(bag_lengths, 1)
            lengths[:, f] = bag_lengths
            feature_ids.append(ids)
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        ids, offsets = _feature_major_to_sample_major(feature_ids, lengths)
        return dense[:count], ids[: offsets[count]], lengths[:count], offsets[: count + 1], labels[:count]

    def _draw_lengths(self, rng: np.random.Generator, feature: int, size: int) -> np.ndarray:
        mean = self._pooling_factors[feature]
        if self.pooling == "fixed":
            return np.full(size, int(mean), dtype=np.int64)
        if self.pooling == "uniform":
            return rng.integers(self.min_pooling, self.max_pooling + 1, size)
        # Truncating the Poisson to the configured bounds is the distribution's definition here, not a data fix-up.
        return np.clip(rng.poisson(mean, size), self.min_pooling, self.max_pooling)


def _feature_major_to_sample_major(feature_ids: list[np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature id arrays (bags in sample order) and ``lengths [C, F]`` -> sample-major flat ids and ``[C + 1]``
    sample offsets. Bag ``(i, f)`` moves from its feature-major start to its sample-major start in one gather."""
    size, num_features = lengths.shape
    flat_feature_major = np.concatenate(feature_ids)
    lengths_fm = lengths.T.reshape(-1)  # bag order (f, i)
    starts_fm = (np.cumsum(lengths_fm) - lengths_fm).reshape(num_features, size).T.reshape(-1)  # in (i, f) order
    lengths_sm = lengths.reshape(-1)
    starts_sm = np.cumsum(lengths_sm) - lengths_sm
    gather = np.repeat(starts_fm - starts_sm, lengths_sm) + np.arange(flat_feature_major.shape[0])
    offsets = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(lengths.sum(1), out=offsets[1:])
    return flat_feature_major[gather], offsets
