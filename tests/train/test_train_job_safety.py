"""What the training job does when something goes wrong: SIGTERM during an evaluation or after the last step, a
diverging run, a failed run's hydra folder and log, an output folder reused by a new run or by a resume, a config
the distributed job must refuse before it spawns ranks, and a sweep with a failed job."""

from __future__ import annotations

import csv
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

import tritonrec.dist.train.single as single_job
from tests.train.dist_job_cases import tiny_config
from tritonrec.dist.train import as_train_config, register_configs, run
from tritonrec.dist.train.config import OptimConfig
from tritonrec.dist.train.launch import init_process_group, spawn
from tritonrec.dist.train.loop import NonFiniteLossError

ROOT = Path(__file__).resolve().parents[2]
register_configs()
DIVERGING = OptimConfig(sparse="EXACT_SGD", dense="sgd", sparse_lr=1e4, dense_lr=1e4)


def _sigterm_at_eval(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """SIGTERM to this process during the ``call``-th held-out evaluation of the one-process job."""
    evaluate, calls = single_job.evaluate, []

    def evaluate_then_signal(*args: Any, **kwargs: Any) -> dict[str, float]:
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)  # the job's handler records it; evaluation goes on
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(single_job, "evaluate", evaluate_then_signal)


def test_sigterm_during_an_evaluation_ends_the_next_step_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal lands in step 2's evaluation: step 3 trains, evaluates and writes the final checkpoint (as the
    distributed job agrees on it at its next step); it used to stop at step 2 with no checkpoint at all."""
    _sigterm_at_eval(monkeypatch, call=1)
    metrics = run(tiny_config(tmp_path, steps=10, eval_every=2, checkpoint_every=0))
    assert metrics["stopped_by"] == "SIGTERM" and metrics["steps"] == 3
    assert metrics["checkpoint"] == str(tmp_path / "checkpoints" / "step_000003.pt")
    assert Path(metrics["checkpoint"]).is_file()
    assert "SIGTERM at step 3: final checkpoint" in (tmp_path / "train.log").read_text()


def test_sigterm_after_the_last_step_is_a_completed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step trained before the signal (it lands in the final evaluation): completed, as the distributed job
    reports it, not a stopped run told to resume from a checkpoint with nothing left to train."""
    _sigterm_at_eval(monkeypatch, call=1)
    metrics = run(tiny_config(tmp_path, steps=4, eval_every=0, checkpoint_every=0))
    assert metrics["stopped_by"] is None and metrics["steps"] == 4
    assert metrics["checkpoint"] == str(tmp_path / "checkpoints" / "step_000004.pt")
    assert "SIGTERM" not in (tmp_path / "train.log").read_text()


def test_diverging_run_names_the_step_and_keeps_its_log(tmp_path: Path) -> None:
    """Through scripts/train.py: the NaN loss is named with its step and the fix; the hydra run folder stays with
    train.log (the job's lines only, the reason last) and hydra's own log apart in hydra.log."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "optim=sgd", "optim.dense_lr=1e4",
               "optim.sparse_lr=1e4", "steps=20", "log_every=1", "batch_size=32", "data.num_eval_samples=64",
               "data.num_embeddings=40", "model.backend=torch", "progress=false", "plot=false", "num_threads=1",
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    error = re.search(r"NonFiniteLossError: step (\d+): the training loss is (nan|inf)", done.stderr)
    assert error, done.stderr[-3000:]
    assert "lower the learning rates (optim.dense_lr, optim.sparse_lr)" in done.stderr
    assert "scores must not be NaN" not in done.stderr
    log = (run_dir / "train.log").read_text().splitlines()
    assert f"by NonFiniteLossError: step {error.group(1)}:" in log[-1]
    assert all(re.match(r"^\[[0-9-]+ [0-9:,]+\] (step \d+: |stopped at step )", line) for line in log), log
    assert (run_dir / "hydra.log").is_file() and (run_dir / ".hydra").is_dir()


def test_diverging_run_raises_in_one_process(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLossError, match=r"step \d+: the training loss is (nan|inf)"):
        run(tiny_config(tmp_path, optim=DIVERGING, steps=20, eval_every=0, checkpoint_every=0))
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "checkpoints").exists()


def test_an_explicit_output_dir_gets_the_config_and_no_stray_run_folder(tmp_path: Path) -> None:
    """hydra's composed config went to its own run folder, which then held nothing else of the job's."""
    results, run_dir = tmp_path / "results", tmp_path / "hydra_run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "steps=2", "batch_size=8", "eval_every=0",
               "data.num_embeddings=40", "model.backend=torch", "progress=false", "plot=false", "num_threads=1",
               f"output_dir={results}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps: 2" in (results / ".hydra" / "config.yaml").read_text()
    assert (results / "metrics.json").is_file() and not run_dir.exists()


def test_failed_config_still_leaves_no_run_folder_and_failure_keeps_it(tmp_path: Path) -> None:
    """The hydra folder goes only when the job wrote nothing: a mid-run error (here a malformed Criteo line after
    the first logged steps) keeps it with the log, which names the failure."""
    lines = ["\t".join(["1", *["1"] * 13, *["0a"] * 26])] * 40 + ["not a criteo line"]
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "data=criteo_tsv", f"data.paths=[{data}]",
               "data.num_embeddings=40", "steps=20", "batch_size=8", "log_every=1", "model.backend=torch",
               "progress=false", "plot=false", "num_threads=1", f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "MalformedLineError" in done.stderr, done.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "step 5: loss" in log and "stopped at step 6 by MalformedLineError" in log


def test_a_new_run_into_a_used_output_dir_is_refused(tmp_path: Path) -> None:
    run(tiny_config(tmp_path, steps=6, eval_every=0, checkpoint_every=3))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    for nproc in (1, 2):  # refused before any rank is spawned
        cfg = tiny_config(tmp_path, steps=3, seed=1)
        cfg.dist.nproc = nproc
        with pytest.raises(ValueError, match=r"output_dir .* already holds another run's results \(metrics.json, "):
            run(cfg)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_resume_into_its_own_folder_rewrites_the_series_from_the_resume_step(tmp_path: Path) -> None:
    """Resuming from step 3 of a 6-step run in the same folder: series.csv keeps steps 1-3 once and gets 4-6 from
    the resumed run; train.log marks where the resumed run starts and names the earlier run's later checkpoint."""
    run(tiny_config(tmp_path, steps=6, eval_every=3, checkpoint_every=3))
    metrics = run(tiny_config(tmp_path, steps=5, eval_every=3, checkpoint_every=3,
                              resume=str(tmp_path / "checkpoints" / "step_000003.pt")))  # fmt: skip
    assert metrics["steps"] == 5
    rows = [(r["kind"], r["step"]) for r in csv.DictReader((tmp_path / "series.csv").open())]
    assert rows == [("train", "2"), ("eval", "3"), ("train", "4"), ("train", "5"), ("eval", "5")]
    log = (tmp_path / "train.log").read_text()
    assert re.search(r"resumed from .*step_000003.pt after step 3; .*step_000006.pt in this folder are from the "
                     r"earlier run", log)  # fmt: skip


@pytest.mark.parametrize(("change", "error", "pattern"), [
    ({"dense": "rmsprop"}, ValueError, r"optim.dense must be one of \['adagrad', 'adam', 'sgd'\], got 'rmsprop'"),
    ({"dense_lr": -1.0}, ValueError, r"optim.dense_lr must be a positive number, got -1.0"),
    ({"dense_kwargs": {"bogus": 1}}, TypeError, r"optim.dense_kwargs=\{'bogus': 1\} do not fit optim.dense"),
    ({"sparse": "LAMB"}, ValueError, r"optim.sparse / optim.sparse_kwargs: optimizer_type='LAMB' cannot be fused"),
])  # fmt: skip
def test_distributed_job_checks_optim_before_spawning(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    """The same error as the one-process job, raised in this process (no rank, no output folder)."""
    cfg = tiny_config(tmp_path / "run", optim=OptimConfig(**change))
    cfg.dist.nproc = 2
    with pytest.raises(error, match=pattern):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_distributed_job_checks_the_backend_before_spawning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl on the CPU is refused in this process: no rank is spawned (it was, to fail in each) and no folder made."""
    run_module = importlib.import_module("tritonrec.dist.train.run")  # the package exports run(), the function

    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(run_module, "spawn", no_spawn)
    cfg = tiny_config(tmp_path / "run")
    cfg.dist.nproc, cfg.dist.backend = 2, "nccl"
    with pytest.raises(ValueError, match=r"dist.backend=nccl needs device=cuda, got device='cpu'"):
        run(cfg)
    assert not (tmp_path / "run").exists()


def _raise_in_rank() -> None:
    raise KeyError("only in the rank")


def test_a_rank_error_keeps_its_type() -> None:
    with pytest.raises(KeyError, match="only in the rank"):
        spawn(_raise_in_rank, 1)


def _rank_1_fails_while_rank_0_waits_for_it() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 broke while starting")
    init_process_group("gloo", 120)  # waits for rank 1, which never joins


def test_a_rank_failing_at_start_ends_the_others_at_once() -> None:
    """torch.multiprocessing ends the other ranks with SIGTERM when one fails. The ranks took every SIGTERM for a
    stop request from their first line, so one waiting to join the group was killed only after torch's 30 s grace
    period (the job failed in ~37 s instead of ~5); the parent now asks them to stop with another signal."""
    import time

    began = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 broke while starting"):
        spawn(_rank_1_fails_while_rank_0_waits_for_it, 2)
    assert time.monotonic() - began < 25  # well under the 30 s grace period it used to wait out


def _sum_of_ranks() -> tuple[int, int]:
    init_process_group("gloo", 60)
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    store_port = int(os.environ["MASTER_PORT"])
    dist.destroy_process_group()
    return int(total), store_port


def test_spawned_ranks_join_the_store_the_parent_holds() -> None:
    """dist.nproc=N's ranks meet at a store this process bound to an OS-assigned port (no free port probed, released
    and raced for); the port the ranks saw is bound here until they finish, then released."""
    total, port = spawn(_sum_of_ranks, 2)
    assert total == 1 + 2
    with socket.socket() as sock:  # free again: the parent's store went with the spawn
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_a_key_the_schema_lacks_is_named() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+model.embeding_dim=8"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) model.embeding_dim: DLRMConfig has no such field"):
        as_train_config(cfg)


def test_sweep_with_a_failing_job_still_writes_its_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "-m", "steps=2,0", "batch_size=8",
               "eval_batch_size=32", "data.num_embeddings=40", "data.num_eval_samples=64", "model.backend=torch",
               "progress=false", "plot=false", "num_threads=1", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "steps must be a positive int" in done.stderr
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["completed", "failed: ValueError: steps must be a positive int, got steps=0"]
    assert rows[0]["steps"] == "2" and float(rows[0]["final_loss"]) > 0 and rows[1]["final_loss"] == ""
    assert "steps=0" in rows[1]["overrides"] and (sweep / "summary.md").read_text().count("\n") == 4
