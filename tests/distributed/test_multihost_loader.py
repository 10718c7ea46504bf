"""Data across ranks on real gloo ranks (2 and 4): each source's epoch split over the ranks is the dataset with no
duplicates (also with 2 loader workers per rank), ranks with uneven data end at the same step, pad_shapes equalises
dense shapes (in namedtuples and defaultdicts too), passes KJTs through and refuses batch sizes that differ on every
rank, and resuming after k steps gives the next 10 batches bit-equal on every rank
with 0 and 2 loader workers. Rank-side code: loader_cases.py (run in the folder's shared spawn, spawned.py)."""

from __future__ import annotations

import pytest

from tests.distributed.spawned import suite_results

pytestmark = pytest.mark.dist
WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "case", ["union/synthetic/workers0", "union/criteo_npy/workers0", "union/criteo_npy/workers2",
             "union/criteo_tsv/workers0"],
)  # fmt: skip
def test_one_epoch_over_the_ranks_is_the_dataset(world: int, case: str) -> None:
    for rank, results in enumerate(suite_results("loader", world)):
        assert all(results[case].values()), f"rank {rank}: {results[case]}"


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_uneven_data_end_together(world: int) -> None:
    for rank, results in enumerate(suite_results("loader", world)):
        checks = results["uneven_end"]
        assert checks["uneven_data"] and checks["steps_are_the_minimum"], f"rank {rank}: {checks}"
        assert checks["second_epoch_steps"] == 1, f"rank {rank}: the longer ranks' kept batch, then the end"


@pytest.mark.parametrize("world", WORLDS)
def test_pad_shapes_equalises_dense_shapes(world: int) -> None:
    for rank, results in enumerate(suite_results("loader", world)):
        checks = results["pad_shapes"]
        assert checks["shapes"] == [(world, 3), (2, world + 1)], f"rank {rank}: {checks['shapes']}"
        assert all(v for k, v in checks.items() if k != "shapes"), f"rank {rank}: {checks}"


@pytest.mark.parametrize("world", WORLDS)
def test_pad_shapes_refuses_batch_sizes_that_differ_on_every_rank(world: int) -> None:
    """Every rank raises the same error at the same step; before, only the smaller ranks did, and the others hung
    in their next collective."""
    outcomes = [results["pad_batch_sizes"] for results in suite_results("loader", world)]
    sizes = list(range(1, world + 1))
    assert outcomes == [outcomes[0]] * world, outcomes
    assert outcomes[0].startswith(f"ValueError: pad_shapes: batch has batch sizes {sizes} on ranks 0..{world - 1}")
    assert "give every rank the same batch_size" in outcomes[0]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_gives_the_next_batches_bit_equal(world: int, num_workers: int) -> None:
    for rank, results in enumerate(suite_results("loader", world)):
        assert results[f"resume/workers{num_workers}"], f"rank {rank} of {world}: resumed batches differ"
