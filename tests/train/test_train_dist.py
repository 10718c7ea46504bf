"""The distributed training job: torchrun with 2 ranks (one output folder, rank 0 reports), the sharding x pipeline x
codec groups, metrics over all ranks, DCP checkpoints with exact resume (same world size) and resume at another world
size (same global batch), SIGTERM's final checkpoint, and the errors for a resume that would train nothing or on
other data, a torchrun world that contradicts dist.nproc, and an unwritable output folder. Rank-side code:
dist_job_cases.py (one spawn of 2 gloo ranks runs them all).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.distributed.spawned import spawn_ranks
from tests.train.dist_job_cases import VARIANTS, tiny_config
from tritonrec.dist.train import run
from tritonrec.dist.train.config import OptimConfig

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist_job")


@functools.cache
def _suite(root: str) -> list[dict[str, Any]]:
    from tests.train.dist_job_cases import run_suite, write_malformed_day

    write_malformed_day(Path(root) / "malformed.tsv")
    return spawn_ranks(run_suite, 2, root, timeout=420)


@pytest.fixture(scope="module")
def ranks(root: Path) -> list[dict[str, Any]]:
    return _suite(str(root))


def test_torchrun_two_ranks_one_output_folder(tmp_path: Path) -> None:
    """The 2-rank main-job smoke test: torchrun, a few steps, rank 0's bar and files only."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "scripts" / "train.py")
    # hydra.verbose: the planner's DEBUG records, whose routing the last assert checks
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, "experiment=dlrm_2ranks",
               "steps=4", "eval_every=2", "log_every=2", "data.num_eval_samples=256", "plot=false",
               "progress=false", "model.backend=torch", f"hydra.run.dir={tmp_path / 'run'}",
               "hydra.verbose=tritonrec.dist.planner"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("dlrm_2ranks: loss") == 1, done.stdout  # one summary line: rank 0's
    assert "over 2 rank(s)" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 4 and metrics["pipeline"] == "sparse_dist"
    assert metrics["pipelined_modules"] == ["model.sparse_arch.embedding_bag_collection"]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 2: loss" in log and "step 4: loss" in log and "held-out AUROC" in log
    # the planner's (sharding=auto) library records (DEBUG, enabled by hydra.verbose) go to hydra's own log, not
    # into the job's train.log
    assert all(re.match(r"^\[[0-9-]+ [0-9:,]+\] [^\[]", line) for line in log.splitlines()), log
    assert "tritonrec.dist.planner" in (tmp_path / "run" / "hydra.log").read_text()


def test_metrics_cover_every_rank(ranks: list[dict[str, Any]], root: Path) -> None:
    metrics = ranks[0]["smoke"]
    assert ranks[1]["smoke"] is None  # rank 0 alone reports
    assert metrics["world_size"] == 2 and metrics["history"]["step"] == [1, 2, 3, 4, 5, 6]
    assert metrics["train_samples"] == 6 * 8 * 2  # every rank's samples
    assert metrics["eval_history"]["samples"] == [64.0, 64.0]  # both ranks' halves of the held-out set
    assert all(np.isfinite(metrics["history"]["loss"])) and 0 < metrics["eval_auroc"] < 1
    smoke = root / "smoke"
    assert json.loads((smoke / "metrics.json").read_text())["history"] == metrics["history"]
    rows = list(csv.DictReader((smoke / "series.csv").open()))
    assert [(r["kind"], r["step"]) for r in rows] == [("train", "2"), ("eval", "3"), ("train", "4"), ("train", "6"),
                                                      ("eval", "6")]  # fmt: skip
    assert all(float(r["ne"]) > 0 for r in rows)
    assert all(float(r["lifetime_ne"]) > 0 for r in rows if r["kind"] == "train")
    log = (smoke / "train.log").read_text()
    assert "step 6: loss" in log and "held-out AUROC" in log and "held-out NE" in log and "train NE" in log
    # the eval line at step 3 (between log lines) reports the mean loss of steps 1-3, not a stale or NaN one
    eval_line = next(line for line in log.splitlines() if "step 3: loss" in line)
    assert f"step 3: loss {np.mean(metrics['history']['loss'][:3]):.4f}, held-out AUROC" in eval_line
    assert sorted(p.name for p in (smoke / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_sharding_pipeline_and_codec_trains(ranks: list[dict[str, Any]], root: Path, variant: str) -> None:
    metrics = ranks[0][variant]
    sharding, pipeline, qcomm = VARIANTS[variant]
    assert metrics["history"]["step"] == [1, 2, 3] and all(np.isfinite(metrics["history"]["loss"]))
    assert (metrics["sharding"], metrics["pipeline"], metrics["qcomm"]) == (sharding, pipeline, f"{qcomm}/{qcomm}")
    expected = [] if pipeline == "base" else ["model.sparse_arch.embedding_bag_collection"]
    assert metrics["pipelined_modules"] == expected
    # a codec on data-parallel tables has no collective to ride: the job says so instead of implying it applied
    ignored = [line for line in (root / variant / "train.log").read_text().splitlines() if "ignored" in line]
    if sharding == "dp" and qcomm != "fp32":
        assert len(ignored) == 1 and f"qcomm={qcomm}/{qcomm} ignored: every table is data-parallel" in ignored[0]
    else:
        assert ignored == []


@pytest.mark.parametrize("case", ["resumed", "resumed_staged"])
def test_resume_at_the_same_world_size_is_exact(ranks: list[dict[str, Any]], case: str) -> None:
    full, resumed = ranks[0]["smoke"], ranks[0][case]
    assert (full["pipeline"], resumed["pipeline"]) == (
        "sparse_dist",
        "staged" if case == "resumed_staged" else "sparse_dist",
    )
    assert resumed["history"]["step"] == [1, 2, 3, 4, 5, 6]
    assert resumed["history"]["loss"] == full["history"]["loss"]  # exact: steps 4-6 retrained after the resume
    assert resumed["train_auroc"] == full["train_auroc"] and resumed["eval_auroc"] == full["eval_auroc"]
    # the lifetime NE states travel in the job state; the window is rebuilt from the AUROC's rows (summed anew)
    assert resumed["train_lifetime_ne"] == full["train_lifetime_ne"] and resumed["eval_ne"] == full["eval_ne"]
    assert resumed["train_window_ne"] == pytest.approx(full["train_window_ne"], rel=1e-12)


def test_a_resume_trains_the_tables_with_the_configs_learning_rate(ranks: list[dict[str, Any]], root: Path) -> None:
    full, resumed = ranks[0]["smoke"], ranks[0]["resumed_sparse_lr"]
    assert resumed["history"]["loss"][:4] == full["history"]["loss"][:4]  # step 4's forward read the saved tables
    assert all(a != b for a, b in zip(resumed["history"]["loss"][4:], full["history"]["loss"][4:], strict=True))
    log = (root / "resumed_sparse_lr" / "train.log").read_text()
    assert "from here on optim.sparse_lr=1.5 (checkpoint: 0.05)" in log


def test_one_process_and_two_ranks_report_the_same_ne(ranks: list[dict[str, Any]], root: Path) -> None:
    """The one-process job on the same samples (a batch of 16 = the 2 ranks' 8 + 8, drawn in the same chunks of 8)
    reports the 2 ranks' NE, train (window and lifetime, at every log point) and held-out, up to the rounding by which
    the two jobs' weights differ (their losses agree to ~1e-8). test_train_ne.py checks the one process's NE against
    the formula written out."""
    two = ranks[0]["smoke"]
    data = dataclasses.replace(tiny_config(root).data, chunk_size=8)
    one = run(tiny_config(root / "one_process", batch_size=16, data=data))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for key in ("train_window_ne", "train_lifetime_ne", "eval_ne"):
        assert one[key] == pytest.approx(two[key], rel=1e-6), key
    assert one["train_ne_history"]["step"] == two["train_ne_history"]["step"] == [2, 4, 6]
    for key in ("window_ne", "lifetime_ne"):
        assert one["train_ne_history"][key] == pytest.approx(two["train_ne_history"][key], rel=1e-6)
    assert one["eval_history"]["ne"] == pytest.approx(two["eval_history"]["ne"], rel=1e-6)


def test_resume_at_another_world_size_keeps_the_global_batch(ranks: list[dict[str, Any]], root: Path) -> None:
    """2 ranks x 8 samples -> 1 rank x 16: every step sees the same samples, so the losses agree to rounding."""
    full = ranks[0]["smoke"]
    cfg = tiny_config(root / "one_rank", batch_size=16, resume=str(root / "smoke" / "checkpoints" / "step_00000003"))
    resumed = run(cfg)
    assert resumed["world_size"] == 1
    np.testing.assert_allclose(resumed["history"]["loss"][3:], full["history"]["loss"][3:], rtol=1e-5)
    assert resumed["history"]["loss"][:3] == full["history"]["loss"][:3]


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint(ranks: list[dict[str, Any]], root: Path) -> None:
    metrics = ranks[0]["sigterm"]
    assert metrics["stopped_by"] == "SIGTERM"
    step = metrics["steps"]
    assert 2 <= step < 100_000 and metrics["history"]["step"][-1] == step
    assert metrics["checkpoint"].endswith(f"step_{step:08d}")
    manifest = json.loads((Path(metrics["checkpoint"]) / "manifest.json").read_text())
    assert manifest["step"] == step


def test_diverging_run_raises_on_every_rank(ranks: list[dict[str, Any]], root: Path) -> None:
    """The same error on both ranks (neither hangs), naming the first non-finite step; no checkpoint after it."""
    errors = [r["diverged"] for r in ranks]
    assert errors[0] == errors[1], errors
    found = re.match(r"NonFiniteLossError: step (\d+): the training loss is (nan|inf)", errors[0] or "")
    assert found, errors[0]
    saved = [int(p.name.split("_")[1]) for p in (root / "diverged" / "checkpoints").glob("step_*")]
    assert all(step < int(found.group(1)) for step in saved), saved
    assert f"NonFiniteLossError: step {found.group(1)}:" in (root / "diverged" / "train.log").read_text()


def test_nan_on_one_rank_stops_every_rank_at_that_step(ranks: list[dict[str, Any]], root: Path) -> None:
    """Rank 1's loss alone turns NaN at step 3 (log steps are 5, 10): both ranks raise at step 3, naming rank 1, and
    no checkpoint is written after step 2."""
    errors = [r["nan_one_rank"] for r in ranks]
    assert [r["nan_one_rank_steps"] for r in ranks] == [3, 3]  # no rank trained past the NaN step
    assert errors[0] == errors[1], errors
    assert (errors[0] or "").startswith("NonFiniteLossError: step 3: the training loss is nan on rank 1:"), errors[0]
    saved = sorted(p.name for p in (root / "nan_one_rank" / "checkpoints").glob("step_*"))
    assert saved == ["step_00000002"], saved
    assert "NonFiniteLossError: step 3:" in (root / "nan_one_rank" / "train.log").read_text()


def test_a_malformed_line_on_one_rank_is_the_cause_in_rank_0s_log(ranks: list[dict[str, Any]], root: Path) -> None:
    """Rank 1 reads a malformed line: it raises the error naming file and line; rank 0 stops with it, and its
    train.log (the one the user reads) names that error, not only that rank 1 failed in stage 'next_batch'."""
    cause = f"MalformedLineError: malformed Criteo line in file {root / 'malformed.tsv'}:41: "
    errors = [r["malformed_on_rank_1"] for r in ranks]
    assert (errors[1] or "").startswith(cause), errors[1]
    assert (errors[0] or "").startswith("PipelineStageError: pipeline stage 'next_batch' failed on rank(s) [1]")
    assert f"rank 1 raised {cause}" in errors[0], errors[0]
    stopped = (root / "malformed" / "train.log").read_text().splitlines()[-1]
    assert "stopped at step" in stopped and f"rank 1 raised {cause}" in stopped, stopped


def test_the_jobs_side_group_keeps_the_world_timeout(ranks: list[dict[str, Any]]) -> None:
    """The metrics / step-agreement group times out with the job's collectives (the spawn's 60 s group here), not
    after gloo's default 30 minutes, when a rank never arrives."""
    assert [r["side_group_timeout_s"] for r in ranks] == [60.0, 60.0]


@pytest.mark.parametrize(("change", "pattern"), [
    ({"steps": 3}, "was taken after step 3, and steps=3 leaves nothing to train"),
    ({"data.seed": 7}, r"data.seed=0 in the checkpoint but 7 now"),
    # checked before spawning too: these used to fail inside a rank (ProcessRaisedException, folder left behind)
    ({"batch_size": 4}, r"the checkpoint trained batch_size=8 per rank, this job has batch_size=4: set batch_size=8"),
    ({"dist.nproc": 1}, r"global batch is 8 x 2 ranks = 16 samples; with 1 ranks set batch_size=16"),
    ({"optim": OptimConfig(sparse="ADAM", dense="adam")}, r"optim.dense='adagrad' in the checkpoint but 'adam' now"),
])  # fmt: skip
def test_resume_that_trains_nothing_or_other_data_is_refused(
    ranks: list[dict[str, Any]], root: Path, change: dict[str, Any], pattern: str
) -> None:
    cfg = tiny_config(root / "refused", resume=str(root / "smoke" / "checkpoints" / "step_00000003"))
    cfg.dist.nproc = 2
    for key, value in change.items():
        if key == "data.seed":
            cfg.data.seed = value
        elif key == "dist.nproc":
            cfg.dist.nproc = value
        else:
            setattr(cfg, key, value)
    with pytest.raises(ValueError, match=pattern):
        run(cfg)
    assert not (root / "refused").exists()  # refused before any output folder


def test_torchrun_world_must_match_dist_nproc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    cfg = tiny_config(tmp_path)
    cfg.dist.nproc = 2
    with pytest.raises(ValueError, match=r"dist.nproc=2 but torchrun started 4 rank\(s\)"):
        run(cfg)


def test_unwritable_output_dir_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="output_dir .* is not writable"):
        run(tiny_config(blocker / "run"))
    cfg = tiny_config(blocker / "run")
    cfg.dist.nproc = 2
    with pytest.raises(ValueError, match="output_dir .* is not writable"):
        run(cfg)


def test_a_one_process_checkpoint_resumed_on_ranks_names_the_fix(tmp_path: Path) -> None:
    run(tiny_config(tmp_path / "one", steps=3, checkpoint_every=3))
    cfg = tiny_config(tmp_path / "again", steps=6, resume=str(tmp_path / "one" / "checkpoints" / "step_000003.pt"))
    cfg.dist.nproc = 2
    with pytest.raises(ValueError, match="it is a one-process checkpoint: resume it with dist.nproc=1"):
        run(cfg)
