"""torchrec 1.8's Criteo readers as ``bench_loader`` runs them (the anchors): its TSV datapipe plus the row-to-KJT
step it leaves to the user, its npy pipe in-process, per DataLoader worker, and on files hashed when written."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tritonrec.data.criteo_npy import npy_paths

HASH = 50_000  # rows per table: ids are folded into these by modulo
KEYS = [f"cat_{i}" for i in range(26)]


def torchrec_rows_to_batch(rows: list[dict[str, Any]]) -> Any:
    """The user's part of torchrec's TSV path: dict rows -> dense + KJT (hashed, empty ids as empty bags)."""
    from torchrec.datasets.utils import Batch as TorchrecBatch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

    dense = torch.tensor([[row[f"int_{i}"] for i in range(13)] for row in rows], dtype=torch.float32)
    values, lengths = [], []
    for key in KEYS:
        for row in rows:
            text = row[key]
            lengths.append(1 if text else 0)
            if text:
                values.append(int(text, 16) % HASH)
    sparse = TorchrecKJT.from_lengths_sync(KEYS, torch.tensor(values), torch.tensor(lengths, dtype=torch.int32))
    labels = torch.tensor([row["label"] for row in rows], dtype=torch.float32)
    return TorchrecBatch(torch.sign(dense) * torch.log1p(dense.abs()), sparse, labels)


class TorchrecTSVBatches(torch.utils.data.IterableDataset):
    """torchrec's TSV pipe (``CriteoIterDataPipe``, which gives each DataLoader worker whole files) batched and turned
    into torchrec Batches, in whichever process iterates it."""

    def __init__(self, paths: list[Path], batch_size: int) -> None:
        self.paths, self.batch_size = [str(p) for p in paths], batch_size

    def __iter__(self) -> Iterator[Any]:
        import torch.utils.data.datapipes as dp
        from torchrec.datasets.criteo import CriteoIterDataPipe

        for rows in dp.iter.Batcher(CriteoIterDataPipe(self.paths), self.batch_size):
            yield torchrec_rows_to_batch(rows)


def torchrec_tsv_pass(paths: list[Path], batch_size: int, workers: int = 0) -> Callable[[], Iterable[Any]]:
    """In-process (``workers == 0``) or in a DataLoader with ``workers`` workers, one file each."""
    batches = TorchrecTSVBatches(paths, batch_size)
    if workers == 0:
        return lambda: iter(batches)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=workers, persistent_workers=True)
    return lambda: loader


def split_tsv(path: Path, parts: int) -> list[Path]:
    """``path``'s lines as ``parts`` files of consecutive lines (torchrec's TSV pipe parallelises by file)."""
    lines = path.read_text().splitlines(keepends=True)
    size = -(-len(lines) // parts)
    out = []
    for part in range(parts):
        out.append(path.with_suffix(f".part{part}of{parts}.tsv"))
        out[-1].write_text("".join(lines[part * size : (part + 1) * size]))
    return out


def torchrec_npy_pass(
    prefix: Path, batch_size: int, mmap_mode: bool, data_loader: bool = False, hashed_files: bool = False
) -> Callable[[], Iterable[Any]]:
    """In memory (the default): files loaded and ids hashed in the constructor, untimed; ``mmap_mode``: read and
    hashed per batch. ``hashed_files``: the files hold ids hashed when written (``hashes=None``: no modulo per
    batch), the same work as our key-major reader. ``data_loader``: wrapped as the reference DLRM script wraps it."""
    from torch.utils.data import DataLoader
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    dense, sparse, labels = (str(p) for p in npy_paths(prefix))
    pipe = InMemoryBinaryCriteoIterDataPipe(
        "train", [dense], [sparse], [labels], batch_size, rank=0, world_size=1,
        hashes=None if hashed_files else [HASH] * 26, mmap_mode=mmap_mode,
    )  # fmt: skip
    if data_loader:
        loader = DataLoader(pipe, batch_size=None, collate_fn=_identity)
        return lambda: loader
    return lambda: iter(pipe)


def _identity(batch: Any) -> Any:
    return batch


class TorchrecNpyPerWorker(torch.utils.data.IterableDataset):
    """torchrec's mmap npy pipe built inside each DataLoader worker with ``rank, world_size`` = the worker's id and
    count, so the workers read disjoint row ranges (the pipe has no per-worker sharding of its own)."""

    def __init__(self, prefix: Path, batch_size: int) -> None:
        self.prefix, self.batch_size = prefix, batch_size

    def __iter__(self) -> Iterator[Any]:
        from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

        info = torch.utils.data.get_worker_info()
        rank, world = (0, 1) if info is None else (info.id, info.num_workers)
        dense, sparse, labels = (str(p) for p in npy_paths(self.prefix))
        yield from InMemoryBinaryCriteoIterDataPipe(
            "train", [dense], [sparse], [labels], self.batch_size, rank=rank, world_size=world,
            hashes=[HASH] * 26, mmap_mode=True,
        )  # fmt: skip


def torchrec_npy_workers_pass(prefix: Path, batch_size: int, workers: int) -> Callable[[], Iterable[Any]]:
    loader = torch.utils.data.DataLoader(
        TorchrecNpyPerWorker(prefix, batch_size), batch_size=None, num_workers=workers, collate_fn=_identity,
        persistent_workers=True,
    )  # fmt: skip
    return lambda: loader


def torchrec_npy_files(ours: Path, theirs: Path, hashed: bool = False) -> None:
    """torchrec's npy layout: a missing id is 0 (ours: -1), labels ``[N, 1]``; ``hashed``: ids already folded into
    the HASH rows (what our key-major files hold), for the same-work anchor."""
    dense, sparse, labels = (np.load(p) for p in npy_paths(ours))
    ids = np.maximum(sparse, 0)
    if hashed:
        ids = ids % HASH
    for array, path in zip((dense, ids, labels.reshape(-1, 1)), npy_paths(theirs), strict=True):
        np.save(path, array)
