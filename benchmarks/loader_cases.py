"""What ``bench_loader`` times, ours and the train-step bar: the synthetic Criteo TSV day, one whole pass over a loader
(every batch read once as its consumer would), the batch cache filled once and read back as model batches, and the
default DLRM's train steps on the same data. The torchrec anchors are in ``loader_anchors``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loader_anchors import HASH, KEYS

from tritonrec.data.batch import Batch
from tritonrec.data.batch_cache import DataGroup
from tritonrec.data.batcher import kjt_from_id_matrix
from tritonrec.data.cache_layouts import KJTLayout
from tritonrec.data.criteo_npy import CriteoNPYSource, npy_paths
from tritonrec.data.group_loader import GroupLoader
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.data.loader import make_rank_loader
from tritonrec.dist.train.builders import DataSources, build_dense_optimizer, build_model
from tritonrec.dist.train.config import DLRMConfig, OptimConfig
from tritonrec.dist.train.loop import train_step

__all__ = ["cached_group", "cached_pass", "passes", "read_once", "train_steps", "write_tsv"]


def write_tsv(path: Path, rows: int, seed: int = 0) -> None:
    """Criteo-like lines: counts with Criteo's missing rate, 8-digit hex ids, some empty."""
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            counts = rng.integers(-1, 300, (n, 13))
            ids = rng.integers(0, 2**32, (n, 26))
            missing = rng.random((n, 26)) < 0.1
            labels = rng.integers(0, 2, n)
            for i in range(n):
                ints = [str(c) if c >= 0 else "" for c in counts[i]]
                cats = ["" if m else f"{v:08x}" for v, m in zip(ids[i], missing[i], strict=True)]
                handle.write("\t".join([str(labels[i]), *ints, *cats]) + "\n")


def read_once(batch: Any) -> float:
    """What the consumer of a batch does at least: read every dense value, id and bag length once (three sums).

    Every case, anchors included, pays it, so a batch made of views of a memory-mapped cache is charged the reads it
    defers (page faults, cold cache lines) instead of counting as free; ours and torchrec's batches share these
    attribute names."""
    sparse = batch.sparse_features
    return float(batch.dense_features.sum()) + float(sparse.values().sum()) + float(sparse.lengths().sum())


def passes(make_batches: Callable[[], Iterable[Any]]) -> Callable[[], int]:
    """One whole pass; returns the number of samples seen (each batch's size, padding excluded).

    Every implementation's batches are counted alike, by their labels' shape; only a pass's last batch can be
    padded (our batchers pad the short last batch of an epoch), so its padding is subtracted once at the end instead
    of reading every batch's mask (a sum and a sync, ~10 us a batch that the anchors were not charged)."""

    def run() -> int:
        seen, last = 0, None
        for batch in make_batches():
            seen += int(batch.labels.shape[0])
            read_once(batch)
            last = batch
        if isinstance(last, Batch):
            seen -= last.batch_size - last.num_valid()
        return seen

    return run


# ------------------------------------------------------------------------------------------------ the batch cache
def cached_group(
    prefix: Path,
    location: Path,
    batch_size: int,
    tuned: bool = False,
    missing_as_zero: bool = False,
    kjt: bool = False,
    ids_dtype: torch.dtype = torch.int64,
) -> DataGroup:
    """A cache of model-ready arrays (hashed ids, dense, labels), filled once, untimed. A missing id is -1 (an empty
    bag, as our readers give it), or with ``missing_as_zero`` id 0 (torchrec's npy convention: every bag one id).
    ``tuned``: batches read as views (``cache_views``), ids stored key-major (``cache_key_major``); ``kjt``: the
    ids cached as the KJT itself (a ``KJTLayout`` of ``ids_dtype`` ids, empty bags included)."""
    dense, sparse, labels = (np.load(p, mmap_mode="r") for p in npy_paths(prefix))
    ids_layout = KJTLayout(KEYS, max_values_per_item=26, dtype=ids_dtype) if kjt else ((26,), torch.int64)
    layouts = {"dense": ((13,), torch.float32), "ids": ids_layout, "labels": ((), torch.float32)}
    key_major = ["ids"] if tuned and not kjt else []
    group = DataGroup(batch_size, range(len(labels)), {"row": ((), torch.int64)}, layouts, location,
                      cache_key_major=key_major)  # fmt: skip

    def fill(item: int, arrays: dict[str, torch.Tensor], seed: int | None) -> None:
        arrays["row"].fill_(item)

    for batch in GroupLoader(fill, group):
        if batch.uncached:
            rows = batch.get_array("row").numpy()
            ids = torch.from_numpy(np.where(sparse[rows] >= 0, sparse[rows] % HASH, 0 if missing_as_zero else -1))
            batch.cache({"dense": torch.from_numpy(np.ascontiguousarray(dense[rows])),
                         "ids": _kjt_of(ids, ids_dtype) if kjt else ids,
                         "labels": torch.from_numpy(labels[rows].astype(np.float32))})  # fmt: skip
        batch.release()
    if tuned:  # the same files, read as views of the mapping instead of copies
        group = DataGroup(batch_size, range(len(labels)), None, layouts, location, cache_views=True,
                          cache_key_major=key_major)  # fmt: skip
    return group


def _kjt_of(ids: torch.Tensor, dtype: torch.dtype) -> KeyedJaggedTensor:
    """The KJT of an id matrix (a negative id: an empty bag), its ids in ``dtype``."""
    kjt = kjt_from_id_matrix(KEYS, ids)
    if dtype == kjt.values().dtype:
        return kjt
    return KeyedJaggedTensor.from_lengths_sync(KEYS, kjt.values().to(dtype), kjt.lengths(), stride=kjt.stride())


def cached_pass(group: DataGroup) -> Callable[[], Iterable[Batch]]:
    """Later epochs: cached batches -> model batches (the user's part: ids [B, 26] -> a KJT with empty bags, unless
    the cache holds the KJT itself)."""

    def batches() -> Iterable[Batch]:
        for cached in GroupLoader(lambda *_: None, group):
            with cached:
                labels, ids = cached.get_array("labels"), cached.get_array("ids")
                sparse = ids if isinstance(ids, KeyedJaggedTensor) else kjt_from_id_matrix(KEYS, ids)
                yield Batch(cached.get_array("dense"), sparse, labels, torch.ones(labels.shape[0], dtype=torch.bool))

    return batches


# ---------------------------------------------------------------------------------------------------- train step
def train_steps(prefix: Path, batch_size: int, steps: int) -> Callable[[], int]:
    """``steps`` optimizer steps of the default DLRM on distinct batches of the npy data (tables of HASH rows per
    feature); returns the samples they trained on."""
    source = CriteoNPYSource(prefix, HASH)
    sources = DataSources(source, None, source.element_spec, source.num_embeddings)
    model = build_model(DLRMConfig(backend="torch"), sources, OptimConfig())
    optimizer = build_dense_optimizer(model, OptimConfig())
    batches = list(make_rank_loader(source, batch_size, drop_remainder=True))
    position = [0]

    def run() -> int:
        for _ in range(steps):
            train_step(model, optimizer, batches[position[0] % len(batches)])
            position[0] += 1
        return steps * batch_size

    return run
