"""Regressions found in QA of the data loaders: exact resume of a ``num_passes`` iteration mid-way through a later
pass (with and without workers) and after a finished one; converting a Criteo day again into the other npy layout;
MultiHostDataLoadIterator restored from an epoch that ended early."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tritonrec.data.batch import Batch
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy, npy_paths
from tritonrec.data.key_major import key_major_paths
from tritonrec.data.loader import make_rank_loader
from tritonrec.data.multihost import MultiHostDataLoadIterator
from tritonrec.data.synthetic import SyntheticRecSource


def _key(batch: Batch) -> tuple[bytes, bytes]:
    return batch.dense_features.numpy().tobytes(), batch.valid_mask.numpy().tobytes()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_the_second_of_num_passes_makes_only_the_passes_left(num_workers: int) -> None:
    source = SyntheticRecSource([50, 20], num_dense=3, num_samples=37, chunk_size=16, shuffle_buffer=10)

    def loader() -> object:
        return make_rank_loader(
            source, 8, num_workers=num_workers, num_passes=2, multiprocessing_context="fork", snapshot_every_n_steps=1
        )

    reference = loader()
    first, second = [_key(b) for b in reference], [_key(b) for b in reference]
    interrupted = loader()
    stream = iter(interrupted)
    k = len(first) - 3  # inside the second pass
    for _ in range(k):
        next(stream)
    state = interrupted.state_dict()
    del stream, interrupted
    resumed = loader()
    resumed.load_state_dict(state)
    assert [_key(b) for b in resumed] == first[k:]  # was: the rest of pass 2, then a third pass
    assert [_key(b) for b in resumed] == second


def test_converting_a_prefix_again_replaces_the_other_layout(tmp_path: Path) -> None:
    """Rows layout over a key-major day: the stale key-major files were read first (a row-count error, or the old
    ids when the counts matched)."""
    rng = np.random.default_rng(0)
    lines = ["\t".join(["1", *map(str, rng.integers(0, 9, 13)), *(f"{v:x}" for v in rng.integers(1, 2**30, 26))])]
    (tmp_path / "a.tsv").write_text("\n".join(lines * 5) + "\n")
    (tmp_path / "b.tsv").write_text("\n".join(lines * 3) + "\n")
    prefix = tmp_path / "day_0"
    criteo_tsv_to_npy(tmp_path / "a.tsv", prefix, num_embeddings=1000)
    criteo_tsv_to_npy(tmp_path / "b.tsv", prefix)
    assert len(CriteoNPYSource(prefix, 10**6)) == 3
    assert not any(path.exists() for path in key_major_paths(prefix))
    criteo_tsv_to_npy(tmp_path / "a.tsv", prefix, num_embeddings=1000)
    assert len(CriteoNPYSource(prefix, 1000)) == 5 and not npy_paths(prefix)[1].exists()


@pytest.mark.parametrize("kind", ["list", "loader"])
def test_a_state_taken_after_an_early_end_resumes_at_the_next_epoch(kind: str) -> None:
    """``iterator_length=5`` over 3 batches: the epoch ends early at step 3. The restored iterator continued that
    epoch (2 steps, or none from an exhausted loader) where the saved one starts a new epoch of 3."""

    def build() -> MultiHostDataLoadIterator:
        source = SyntheticRecSource([5], num_dense=1, num_samples=12, chunk_size=4)
        loader = make_rank_loader(source, 4) if kind == "loader" else [source_batch(i) for i in range(3)]
        return MultiHostDataLoadIterator(loader, iterator_length=5, reset_after_epoch=True)

    saved = build()
    assert len(list(saved)) == 3
    state = saved.get_state()
    expected = [_values(b) for b in saved]
    resumed = build()
    resumed.set_state(state)
    assert [_values(b) for b in resumed] == expected and len(expected) == 3


def source_batch(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(i)])}


def _values(batch: Batch | dict[str, torch.Tensor]) -> list[float]:
    tensor = batch["x"] if isinstance(batch, dict) else batch.dense_features
    return tensor.flatten().tolist()


def test_resume_after_a_finished_num_passes_iteration_starts_the_next() -> None:
    source = SyntheticRecSource([50, 20], num_dense=3, num_samples=37, chunk_size=16, shuffle_buffer=10)
    reference = make_rank_loader(source, 8, num_passes=2)
    list(reference)
    expected = [_key(b) for b in reference]
    finished = make_rank_loader(source, 8, num_passes=2)
    list(finished)
    resumed = make_rank_loader(source, 8, num_passes=2)
    resumed.load_state_dict(finished.state_dict())
    assert [_key(b) for b in resumed] == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"num_workers": 1, "prefetch_factor": 0}, ValueError, "prefetch_factor must be a positive int or None"),
        ({"prefetch_factor": 2}, ValueError, "prefetch_factor=2 needs loader workers"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory must be a bool, got pin_memory='yes'"),
    ],
)
def test_make_rank_loader_refuses_bad_options(kwargs: dict, error: type[Exception], pattern: str) -> None:
    """Before: a bare AssertionError at the first iteration, or the option silently ignored."""
    source = SyntheticRecSource([5], num_dense=1, num_samples=12, chunk_size=4)
    with pytest.raises(error, match=pattern):
        make_rank_loader(source, 4, **kwargs)


def test_a_refused_first_epoch_leaves_the_dataset_as_it_was() -> None:
    source = SyntheticRecSource([50, 20], num_dense=3, num_samples=37, chunk_size=16)
    dataset = make_rank_loader(source, 8, num_passes=2).dataset
    before = dataset.state_dict()
    good = make_rank_loader(source, 8, num_passes=2)
    stream = iter(good)
    for _ in range(7):
        next(stream)
    bad = dict(good.dataset.state_dict(), first_epoch=99)
    with pytest.raises(ValueError, match="first_epoch"):
        dataset.load_state_dict(bad)
    assert dataset.state_dict() == before
