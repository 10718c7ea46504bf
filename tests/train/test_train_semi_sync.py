"""The distributed job under ``pipeline=semi_sync``: its options compose and their bad values name the field; a
2-rank job trains through it (its first steps as ``sparse_dist`` bit for bit, the later ones a step stale), with
held-out evaluations between steps; and a job resumed from any of its checkpoints repeats the uninterrupted job's
steps bit for bit (each checkpoint restarts the pipeline, as a resume does), with and without ``stash_gradients``.
Rank side: semi_sync_job_cases.py (one spawn of 2 gloo ranks runs them all)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from tests.distributed.spawned import spawn_ranks
from tests.train.dist_job_cases import tiny_config
from tests.train.semi_sync_job_cases import RESUMES, STEPS
from tritonrec.dist.train import as_train_config, register_configs, run
from tritonrec.dist.train.job_config import PipelineConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
register_configs()


def _compose(*overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return as_train_config(compose(config_name="train", overrides=["data=synthetic", *overrides]))


def test_semi_sync_composes_with_torchrecs_defaults() -> None:
    pipeline = _compose("pipeline=semi_sync").pipeline
    assert (pipeline.kind, pipeline.start_batch, pipeline.stash_gradients) == ("semi_sync", 900, False)
    pipeline = _compose("pipeline=semi_sync", "pipeline.start_batch=0", "pipeline.stash_gradients=true").pipeline
    assert (pipeline.start_batch, pipeline.stash_gradients) == (0, True)


@pytest.mark.parametrize(("overrides", "error", "pattern"), [
    (["pipeline=semi_sync", "pipeline.start_batch=-1"], ValueError,
     r"pipeline.start_batch must be an int >= 0, got pipeline.start_batch=-1"),
    (["pipeline=sparse_dist", "pipeline.start_batch=10"], ValueError,
     r"pipeline.start_batch=10 applies to pipeline=semi_sync only, and pipeline.kind='sparse_dist': choose "
     r"pipeline=semi_sync, or leave pipeline.start_batch at its default 900"),
    (["pipeline=staged", "pipeline.stash_gradients=true"], ValueError,
     r"pipeline.stash_gradients=True applies to pipeline=semi_sync only, and pipeline.kind='staged'"),
])  # fmt: skip
def test_bad_semi_sync_option_names_the_field(overrides: list[str], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _compose(*overrides)


@pytest.mark.parametrize(("field", "value", "error", "pattern"), [
    ("start_batch", True, TypeError, r"pipeline.start_batch must be an int >= 0, got pipeline.start_batch=True"),
    ("start_batch", 2.5, TypeError, r"pipeline.start_batch must be an int >= 0, got pipeline.start_batch=2.5"),
    ("stash_gradients", "yes", TypeError, r"pipeline.stash_gradients must be a bool, got "
                                          r"pipeline.stash_gradients='yes'"),
])  # fmt: skip
def test_bad_semi_sync_value_fails_before_the_run_folder(
    tmp_path: Path, field: str, value: Any, error: type[Exception], pattern: str
) -> None:
    pipeline = PipelineConfig(kind="semi_sync")
    setattr(pipeline, field, value)
    with pytest.raises(error, match=pattern):
        run(tiny_config(tmp_path / "run", pipeline=pipeline))
    assert not (tmp_path / "run").exists()


@functools.cache
def _suite(root: str) -> list[dict[str, Any]]:
    from tests.train.semi_sync_job_cases import run_suite

    return spawn_ranks(run_suite, 2, root, timeout=300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _suite(str(tmp_path_factory.mktemp("semi_sync_job")))


@pytest.mark.dist
def test_two_rank_job_trains_semi_sync_after_start_batch(ranks: list[dict[str, Any]]) -> None:
    semi, sparse_dist = ranks[0]["after_start_no_checkpoints"], ranks[0]["sparse_dist"]
    assert semi["pipeline"] == "semi_sync" and semi["pipelined_modules"] and semi["world_size"] == 2
    assert semi["history"]["step"] == list(range(1, STEPS + 1)) and semi["eval_history"]["step"] == [4, 8]
    # start_batch=2: batches 0 and 1 train synchronously, so batch 2's lookup (step 3) still reads batch 1's update;
    # step 4's lookup ran before step 3's update
    assert semi["history"]["loss"][:3] == sparse_dist["history"]["loss"][:3]
    assert semi["history"]["loss"][3] != sparse_dist["history"]["loss"][3]
    # the evaluations at steps 4 and 8 (the model's own forward while lookups of the next batch are in flight)
    assert semi["history"]["loss"] == ranks[0]["no_evaluations"]["history"]["loss"]


@pytest.mark.dist
@pytest.mark.parametrize("case", list(RESUMES))
def test_semi_sync_resume_is_exact(ranks: list[dict[str, Any]], case: str) -> None:
    full, resumed = ranks[0][case], ranks[0][f"{case}_resumed"]
    resumed_from = RESUMES[case][3]
    assert resumed["resumed_from"].endswith(f"step_{resumed_from:08d}")
    assert resumed["history"]["step"] == full["history"]["step"] == list(range(1, STEPS + 1))
    assert resumed["history"]["loss"] == full["history"]["loss"]  # bit for bit, the steps after the resume too
    assert resumed["train_auroc"] == full["train_auroc"] and resumed["eval_history"] == full["eval_history"]
    assert resumed["train_lifetime_ne"] == full["train_lifetime_ne"]


@pytest.mark.dist
@pytest.mark.parametrize("case", list(RESUMES))
def test_checkpoints_after_start_batch_restart_the_staleness(ranks: list[dict[str, Any]], case: str) -> None:
    """What exact resume costs: the batch after a checkpoint taken after step ``start_batch`` reads the tables as
    that step left them (no staleness), as a resumed job's first batch does; an earlier checkpoint changes nothing
    (``start_batch`` counts the job's steps across restarts)."""
    checkpointed = ranks[0][case]["history"]["loss"]
    plain = ranks[0][f"{case}_no_checkpoints"]["history"]["loss"]
    start_batch, _, every, _ = RESUMES[case]
    first_restart = min(k for k in range(every, STEPS, every) if k > start_batch)
    assert checkpointed[:first_restart] == plain[:first_restart]
    assert checkpointed[first_restart] != plain[first_restart]
