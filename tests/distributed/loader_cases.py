"""Rank-side cases of the data-across-ranks tests (test_multihost_loader.py reads their results): every source's
epoch split over the ranks, ranks with uneven data ending together, pad_shapes (and its refusal of batch sizes that
differ, on every rank), and exact resume through
MultiHostDataLoadIterator with 0 and 2 loader workers. Functions return plain Python values.

Each rank writes the same small Criteo files (seeded) into its own temporary directory, so no rank waits on another
to create them.

``run_ranks`` starts the ranks as daemonic processes (so they die with pytest), and Python forbids a daemonic process
to start children, which DataLoader workers are: the cases clear the rank's daemon flag while they run
(:func:`_workers_allowed`). The workers still cannot outlive their rank: the DataLoader's watchdog ends them when it
goes.
"""

from __future__ import annotations

import contextlib
import gzip
import multiprocessing
import tempfile
from collections import Counter, defaultdict, namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.data.criteo import CriteoTSVSource
from tritonrec.data.criteo_npy import CriteoNPYSource, npy_paths
from tritonrec.data.loader import make_rank_loader
from tritonrec.data.multihost import MultiHostDataLoadIterator
from tritonrec.data.synthetic import SyntheticRecSource

HASH = 10**6
BATCH = 8
_FORK = "fork"  # a spawned rank defaults to spawning its workers, each importing torch again (seconds, not ms)
Pair = namedtuple("Pair", "x y")


def _write_files(root: Path) -> None:
    rng = np.random.default_rng(3)
    lines = []
    for i in range(70):
        ints = [str(i), *(str(v) if v >= 0 else "" for v in rng.integers(-1, 40, 12))]
        cats = [f"{v:x}" if v % 4 else "" for v in rng.integers(0, 2**36, 26)]
        lines.append("\t".join([str(i % 2), *ints, *cats]))
    lines[33] = "a malformed line"
    (root / "day.tsv").write_text("\n".join(lines[:45]) + "\n")
    with gzip.open(root / "day.tsv.gz", "wt") as handle:
        handle.write("\n".join(lines[45:]) + "\n")
    arrays = (rng.random((65, 13), dtype=np.float32), rng.integers(-1, 10**8, (65, 26)), rng.integers(0, 2, 65))
    for array, path in zip(arrays, npy_paths(root / "day_0"), strict=True):
        np.save(path, array)


def _sources(root: Path) -> dict[str, Any]:
    tsv = [root / "day.tsv", root / "day.tsv.gz"]
    return {
        "synthetic": lambda **kw: SyntheticRecSource([60, 25], num_dense=2, num_samples=77, chunk_size=16, **kw),
        "criteo_npy": lambda **kw: CriteoNPYSource(root / "day_0", HASH, **kw),
        "criteo_tsv": lambda **kw: CriteoTSVSource(tsv, HASH, malformed="skip", **kw),
    }


def _row_keys(batch: Batch) -> list[str]:
    """One key per valid row: its dense features and its ids, so a duplicate or a missing row shows."""
    kjt, rows = batch.sparse_features, []
    per_key = [kjt[key].to_dense() for key in kjt.keys()]
    for row in torch.nonzero(batch.valid_mask).flatten().tolist():
        ids = [bag[row].tolist() for bag in per_key]
        rows.append(batch.dense_features[row].numpy().tobytes().hex() + repr(ids))
    return rows


def union_cases(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Per source (and with 2 loader workers for one): the epoch's rows over all ranks equal the dataset's rows."""
    results = {}
    for name, make in _sources(root).items():
        for num_workers in (0, 2) if name == "criteo_npy" else (0,):
            source = make(rank=rank, world_size=world, shuffle_buffer=8)
            loader = make_rank_loader(source, BATCH, num_workers, multiprocessing_context=_FORK)
            mine = [key for batch in loader for key in _row_keys(batch)]
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            full = [key for batch in make_rank_loader(make(), BATCH) for key in _row_keys(batch)]
            union = Counter(key for keys in gathered for key in keys)
            results[f"union/{name}/workers{num_workers}"] = {
                "union_is_the_dataset": union == Counter(full),
                "no_duplicates": max(union.values()) == 1,
                "every_rank_reads": all(len(keys) > 0 for keys in gathered),
            }
    return results


def uneven_end_case(rank: int, world: int, root: Path) -> dict[str, Any]:
    """65 npy rows over the ranks in batches of 8: some ranks have one batch more; all stop at the same step."""
    loader = make_rank_loader(CriteoNPYSource(root / "day_0", HASH, rank=rank, world_size=world), BATCH)
    local_batches = len(list(loader))
    iterator = MultiHostDataLoadIterator(loader)
    steps = sum(1 for _ in iterator)
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, (local_batches, steps))
    second_epoch = sum(1 for _ in iterator)  # the longer ranks kept their extra batch; the short ones restart
    return {
        "uneven_data": len({local for local, _ in counts}) > 1,
        "steps_are_the_minimum": all(s == min(local for local, _ in counts) for _, s in counts),
        "second_epoch_steps": second_epoch,
    }


def pad_shapes_case(rank: int, world: int) -> dict[str, Any]:
    kjt = KeyedJaggedTensor(["f"], torch.arange(rank + 1), lengths=torch.tensor([rank + 1]))
    batches = [
        {"x": torch.full((rank + 1, 3), float(rank)), "seq": torch.ones(2, rank + 2, dtype=torch.int64), "kjt": kjt}
        for _ in range(2)
    ]
    out = list(MultiHostDataLoadIterator(batches, pad_shapes=True, pad_value=-1))
    x, seq = out[0]["x"], out[0]["seq"]
    same_kjt = KeyedJaggedTensor(["f"], torch.arange(4), lengths=torch.ones(4, dtype=torch.int32))
    same_b = Batch(torch.ones(4, 2), same_kjt, torch.zeros(4), torch.ones(4, dtype=torch.bool))
    kept = next(iter(MultiHostDataLoadIterator([same_b], pad_shapes=True)))
    pair = Pair(torch.zeros(rank + 1), torch.ones(2))
    by_key = defaultdict(list, {"x": torch.zeros(rank + 1)})
    pair_out = next(iter(MultiHostDataLoadIterator([pair], pad_shapes=True)))
    by_key_out = next(iter(MultiHostDataLoadIterator([by_key], pad_shapes=True)))
    return {
        "shapes": [tuple(x.shape), tuple(seq.shape)],
        "padded_with_value": bool((x[rank + 1 :] == -1).all()) and bool((seq[:, rank + 2 :] == -1).all()),
        "data_kept": bool((x[: rank + 1] == rank).all()) and bool((seq[:, : rank + 2] == 1).all()),
        "kjt_unchanged": out[0]["kjt"] is kjt,
        "equal_batches_untouched": kept.dense_features is same_b.dense_features,
        "namedtuple_padded": type(pair_out) is Pair and tuple(pair_out.x.shape) == (world,),
        "defaultdict_padded": type(by_key_out) is defaultdict
        and by_key_out.default_factory is list
        and tuple(by_key_out["x"].shape) == (world,),
    }


def pad_batch_sizes_case(rank: int, world: int) -> str:
    """Batches whose batch sizes differ across ranks: every rank must raise the same error at the same step (a
    rank that went on would wait in its next collective). One next() only, so that a rank which does not raise
    leaves no collective unmatched and the suite's later cases still run."""
    rows = rank + 1
    kjt = KeyedJaggedTensor(["f"], torch.arange(rows), lengths=torch.ones(rows, dtype=torch.int32))
    batch = Batch(torch.ones(rows, 2), kjt, torch.zeros(rows), torch.ones(rows, dtype=torch.bool))
    try:
        next(iter(MultiHostDataLoadIterator([batch, batch], pad_shapes=True)))
    except ValueError as error:
        return f"ValueError: {error}"
    return "returned a batch"


def _next_steps(iterator: MultiHostDataLoadIterator, count: int) -> list[Batch]:
    """``count`` batches, starting a new epoch (``iter()``) whenever one ends."""
    out: list[Batch] = []
    while len(out) < count:
        try:
            out.append(next(iterator))
        except StopIteration:
            iter(iterator)
    return out


def _same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def _tensors(batch: Batch) -> list[torch.Tensor]:
    kjt = batch.sparse_features
    return [batch.dense_features, batch.labels, batch.valid_mask, kjt.values(), kjt.lengths()]


def resume_case(rank: int, world: int, root: Path, num_workers: int) -> bool:
    """After 4 steps, the next 10 batches (crossing an epoch of 6 steps and a pass of the data) are bit-equal when
    a fresh loader and iterator resume from the state."""

    def build() -> MultiHostDataLoadIterator:
        source = CriteoNPYSource(root / "day_0", HASH, rank=rank, world_size=world, shuffle_buffer=6, shuffle_seed=1)
        loader = make_rank_loader(source, 4, num_workers, num_passes=None, multiprocessing_context=_FORK)
        return MultiHostDataLoadIterator(loader, iterator_length=6)

    first = build()
    iter(first)
    _next_steps(first, 4)
    state = first.get_state()
    expected = _next_steps(first, 10)
    del first
    resumed = build()
    resumed.set_state(state)
    iter(resumed)
    return all(_same(a, b) for a, b in zip(expected, _next_steps(resumed, 10), strict=True))


@contextlib.contextmanager
def _workers_allowed() -> Iterator[None]:
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def run_loader_cases(rank: int, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"loader_rank{rank}_") as tmp, _workers_allowed():
        root = Path(tmp)
        _write_files(root)
        results = union_cases(rank, world, root)
        results["uneven_end"] = uneven_end_case(rank, world, root)
        results["pad_shapes"] = pad_shapes_case(rank, world)
        results["pad_batch_sizes"] = pad_batch_sizes_case(rank, world)
        for num_workers in (0, 2):
            results[f"resume/workers{num_workers}"] = resume_case(rank, world, root, num_workers)
    return results
