"""Rank-sharded sources (in-process; the gloo-rank versions are in tests/distributed/test_multihost_loader.py): for
synthetic, Criteo npy and Criteo TSV (plain and .gz), the union over ranks (and loader workers) of one epoch is the
dataset with no duplicates; the bounded-buffer shuffle is deterministic per (seed, epoch, rank), keeps rows inside
their block and resumes exactly mid-epoch; chunk-wise collation equals element-wise collation."""

from __future__ import annotations

import gzip
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import tritonrec.data.criteo_files as criteo_files
from tritonrec.data.batcher import Batcher
from tritonrec.data.criteo import CriteoTSVSource
from tritonrec.data.criteo_npy import CriteoNPYSource, npy_paths
from tritonrec.data.elements import RecElement
from tritonrec.data.sharding import Shard
from tritonrec.data.synthetic import SyntheticRecSource

HASH = 10**6
Key = tuple


def _key(element: RecElement) -> Key:
    return (element.dense.tobytes(), element.sparse_ids.tobytes(), element.sparse_lengths.tobytes(), element.label)


def _keys(source, position: int = 0, epoch: int = 0) -> list[Key]:
    return [_key(e) for e in source.iter_from(position, epoch)]


def _criteo_line(i: int, rng: np.random.Generator) -> str:
    ints = [str(i), *(str(v) if v >= 0 else "" for v in rng.integers(-1, 50, 12))]
    cats = [f"{v:x}" if v % 5 else "" for v in rng.integers(0, 2**40, 26)]
    return "\t".join([str(i % 2), *ints, *cats])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    rng = np.random.default_rng(1)
    lines = [_criteo_line(i, rng) for i in range(157)]
    lines[40] = lines[99] = "malformed"
    (root / "a.tsv").write_text("\n".join(lines[:90]) + "\n")
    with gzip.open(root / "b.tsv.gz", "wt") as handle:
        handle.write("\n".join(lines[90:]) + "\n")
    for day, rows in enumerate((61, 44)):
        arrays = (rng.random((rows, 13), dtype=np.float32), rng.integers(-1, 10**9, (rows, 26)),
                  rng.integers(0, 2, rows).astype(np.int32))  # fmt: skip
        for array, path in zip(arrays, npy_paths(root / f"day_{day}"), strict=True):
            np.save(path, array)
    return {"root": root}


def _make(kind: str, files: dict[str, Path]) -> Callable[..., object]:
    root = files["root"]
    if kind == "synthetic":
        return lambda **kw: SyntheticRecSource([40, 30], num_dense=2, num_samples=103, chunk_size=16, **kw)
    if kind == "npy":
        return lambda **kw: CriteoNPYSource([root / "day_0", root / "day_1"], HASH, **kw)
    paths = {"tsv": [root / "a.tsv"], "tsv_gz": [root / "b.tsv.gz"], "tsv_both": [root / "a.tsv", root / "b.tsv.gz"]}
    return lambda **kw: CriteoTSVSource(paths[kind], HASH, malformed="skip", **kw)


KINDS = ["synthetic", "npy", "tsv", "tsv_gz", "tsv_both"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_union_over_ranks_and_workers_is_the_dataset(
    kind: str, world_size: int, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(criteo_files, "BLOCK_BYTES", 1500)  # several blocks per shard
    make = _make(kind, files)
    full = _keys(make())
    assert len(set(full)) == len(full) > 40
    per_rank = [_keys(make(rank=r, world_size=world_size)) for r in range(world_size)]
    assert Counter(k for keys in per_rank for k in keys) == Counter(full)
    assert all(keys for keys in per_rank)
    rank = world_size - 1
    workers = [_keys(make(rank=rank, world_size=world_size).sub_shard(w, 2)) for w in range(2)]
    assert Counter(workers[0] + workers[1]) == Counter(per_rank[rank])  # a worker split stays inside its rank


def test_endless_synthetic_stream_is_split_by_chunks() -> None:
    make = lambda **kw: SyntheticRecSource([40], num_dense=1, chunk_size=8, **kw)
    full = [_key(e) for _, e in zip(range(48), make(), strict=False)]
    ranks = [[_key(e) for _, e in zip(range(16), make(rank=r, world_size=3), strict=False)] for r in range(3)]
    assert ranks[1][:8] == full[8:16] and ranks[1][8:] == full[32:40]  # rank 1 of 3: chunks 1 and 4
    assert Counter(k for keys in ranks for k in keys) == Counter(full)


def test_malformed_lines_are_counted_once_and_named_by_their_owner(files: dict[str, Path]) -> None:
    root = files["root"]
    skipped = 0
    for rank in range(3):
        source = CriteoTSVSource([root / "a.tsv", root / "b.tsv.gz"], HASH, malformed="skip", rank=rank, world_size=3)
        list(source)
        skipped += source.num_skipped
        for example in source.skipped_examples:  # global line numbers, whichever rank reports them
            assert example.startswith((f"{root / 'a.tsv'}:41: ", f"{root / 'b.tsv.gz'}:10: "))
    assert skipped == 2
    owner = CriteoTSVSource(root / "a.tsv", HASH, rank=1, world_size=3)  # bytes: line 41 is in the middle third
    with pytest.raises(ValueError, match=re.escape(f"{root / 'a.tsv'}:41: expected 40 tab-separated fields")):
        list(owner)


@pytest.mark.parametrize("kind", ["synthetic", "npy", "tsv_both"])
def test_shuffle_is_bounded_deterministic_and_resumable(kind: str, files: dict[str, Path]) -> None:
    make, buffer = _make(kind, files), 16
    plain = _keys(make(rank=1, world_size=2))
    shuffled = make(rank=1, world_size=2, shuffle_buffer=buffer, shuffle_seed=7)
    epoch0, epoch1 = _keys(shuffled, epoch=0), _keys(shuffled, epoch=1)
    assert epoch0 == _keys(make(rank=1, world_size=2, shuffle_buffer=buffer, shuffle_seed=7), epoch=0)  # deterministic
    assert epoch0 != plain and epoch1 != epoch0 and sorted(epoch1) == sorted(plain)
    assert epoch0 != _keys(make(rank=1, world_size=2, shuffle_buffer=buffer, shuffle_seed=8), epoch=0)
    assert epoch0 != _keys(make(rank=0, world_size=2, shuffle_buffer=buffer, shuffle_seed=7), epoch=0)
    for start in range(0, len(plain), buffer):  # bounded: each block of the buffer holds the same rows
        assert sorted(epoch0[start : start + buffer]) == sorted(plain[start : start + buffer])
    for position in (1, buffer - 1, buffer, buffer + 5, len(plain) - 1, len(plain)):
        assert _keys(shuffled, position, epoch=1) == epoch1[position:]


@pytest.mark.parametrize("shuffle_buffer", [0, 16, 1000])
@pytest.mark.parametrize("kind", KINDS)
def test_a_position_past_the_end_is_refused_with_or_without_shuffling(
    kind: str, shuffle_buffer: int, files: dict[str, Path]
) -> None:
    """The same check in every mode, naming the caller's position: shuffled TSV used to yield nothing for a position
    inside the last, partial block and to name the block-rounded position otherwise."""
    source = _make(kind, files)(rank=1, world_size=2, shuffle_buffer=shuffle_buffer, shuffle_seed=3)
    rows = len(_keys(source))
    assert _keys(source, rows) == []  # the end itself is a valid (empty) position
    for position in (rows + 1, rows + 3, rows + 17, 10 * rows):
        with pytest.raises(ValueError, match=rf"position={position} is past the end of the (data|stream) \("):
            _keys(source, position)


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_collation_equals_element_collation(kind: str, files: dict[str, Path]) -> None:
    source = _make(kind, files)(rank=0, world_size=2, shuffle_buffer=8)
    by_chunks = list(Batcher(source.element_spec).process(source, 7))
    by_elements = list(Batcher(source.element_spec).process(list(source.iter_from(0)), 7))
    assert len(by_chunks) == len(by_elements) and by_chunks[-1].num_valid() <= 7
    for a, b in zip(by_chunks, by_elements, strict=True):
        assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.valid_mask, b.valid_mask)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def test_shard_arithmetic() -> None:
    shard = Shard.of(2, 3).split(1, 2)
    assert shard.key == (2, 3, 1, 2) and (shard.rank, shard.world_size) == (2, 3)
    assert Shard.of(2, 3).range_of(0, 10) == (6, 10) and shard.range_of(0, 10) == (8, 10)
    assert shard.stride() == (2 + 3 * 1, 6)
    pieces = [Shard.of(r, 4).range_of(5, 12) for r in range(4)]
    assert pieces == [(5, 6), (6, 8), (8, 10), (10, 12)]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, world_size=2\), got rank=2"),
        ({"rank": -1, "world_size": 2}, r"rank must be an int in \[0, world_size=2\), got rank=-1"),
        ({"world_size": 0}, "world_size must be a positive int, got world_size=0"),
        ({"world_size": 1.5}, "world_size must be a positive int, got world_size=1.5"),
        ({"shuffle_buffer": -1}, r"shuffle_buffer must be a non-negative int \(0: no shuffle\), got shuffle_buffer=-1"),
        ({"shuffle_seed": -2}, "shuffle_seed must be a non-negative int, got shuffle_seed=-2"),
    ],
)
@pytest.mark.parametrize("kind", ["synthetic", "npy", "tsv"])
def test_bad_shard_arguments(kind: str, kwargs: dict, pattern: str, files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=pattern):
        _make(kind, files)(**kwargs)


def test_bad_sub_shard() -> None:
    source = SyntheticRecSource([10], num_samples=10)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, count=2\), got index=2"):
        source.sub_shard(2, 2)
    with pytest.raises(ValueError, match="count must be a positive int, got count=0"):
        source.sub_shard(0, 0)
    with pytest.raises(ValueError, match=r"position=6 is past the end of the stream \(5 samples\)"):
        SyntheticRecSource([10], num_samples=10, rank=1, world_size=2).iter_from(6)
