"""The training job where sweeps, signals and ranks meet: SIGTERM during a sweep still writes the sweep's summary
(with the stopped job's row) and ends the sweep with 143; a sweep under torchrun is refused at once (its second job
hung); the distributed job's skipped-line count covers every rank's part of the files; and the fields only the ranks
used to check (the data sources', column-wise sharding's split, the tensorboard package) fail before any rank is
spawned."""

from __future__ import annotations

import csv
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.train.dist_job_cases import tiny_config
from tritonrec.dist.train import run
from tritonrec.dist.train.config import CriteoNPYDataConfig, CriteoTSVDataConfig, DLRMConfig, SyntheticDataConfig
from tritonrec.dist.train.job_config import LoggerConfig, ShardingConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "train.py")
TINY = ["batch_size=8", "eval_batch_size=32", "data.num_embeddings=40", "data.num_eval_samples=64", "log_every=1",
        "eval_every=0", "model.backend=torch", "progress=false", "plot=false", "num_threads=1"]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}


def test_sigterm_in_a_sweep_writes_the_stopped_jobs_row_and_ends_the_sweep(tmp_path: Path) -> None:
    """The job's sys.exit(143) inside hydra's job used to skip hydra's job-end callback: no summary at all."""
    sweep = tmp_path / "sweep"
    command = [sys.executable, SCRIPT, "-m", "steps=100000,2", *TINY, f"hydra.sweep.dir={sweep}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    log, deadline = sweep / "0_synthetic_dlrm" / "train.log", time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and "step 2:" in log.read_text():
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 143, output[-3000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["stopped by SIGTERM"], output[-3000:]
    assert int(rows[0]["steps"]) >= 2 and float(rows[0]["final_loss"]) > 0
    assert "stopped by SIGTERM" in (sweep / "summary.md").read_text()
    assert not (sweep / "1_synthetic_dlrm").exists()  # the sweep ended: its later job did not run


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks' processes")
def test_sigterm_while_the_spawned_ranks_start_or_end_stops_or_completes_the_job(tmp_path: Path) -> None:
    """A SIGTERM forwarded to spawned ranks outside their training loop killed them (the job failed with
    ProcessExitedException): now a signal while they start stops the job at its first step with a checkpoint (143),
    and one after the last step, while they tear down, leaves a completed run (0)."""
    for when in ("starting", "ending"):
        out = tmp_path / when
        command = [sys.executable, SCRIPT, "dist.nproc=2", "steps=4", "checkpoint_every=0", *TINY,
                   f"hydra.run.dir={out}"]  # fmt: skip
        process = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            ranks = [
                c for c in _children(process.pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()
            ]
            if (when == "starting" and len(ranks) >= 2) or (when == "ending" and (out / "metrics.json").is_file()):
                break
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=240)
        metrics = json.loads((out / "metrics.json").read_text())
        if when == "starting":
            assert process.returncode == 143, output[-3000:]
            assert metrics["stopped_by"] == "SIGTERM" and metrics["steps"] == 1 and metrics["checkpoint"]
        else:
            assert process.returncode == 0, output[-3000:]
            assert metrics["stopped_by"] is None and metrics["steps"] == 4


@pytest.mark.dist
def test_a_sweep_under_torchrun_is_refused_before_hydra_starts(tmp_path: Path) -> None:
    """Every rank ran the whole sweep and the second job's process group hung at its rendezvous."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, "-m",
               "experiment=dlrm_2ranks", "steps=2,3", *TINY]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "a sweep (-m) cannot run under torchrun" in done.stderr and "dist.nproc=2" in done.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.dist
def test_skipped_lines_count_every_ranks_part_of_the_files(tmp_path: Path) -> None:
    """Rank 0 reads the first half of the file (1 malformed line), rank 1 the second (2): metrics.json said 1."""
    good = "\t".join(["1", *["1"] * 13, *["0a"] * 26])
    lines = [good] * 60
    for index in (10, 40, 50):
        lines[index] = "not\ta\tcriteo\tline"
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    cfg = tiny_config(tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0,
                      data=CriteoTSVDataConfig(paths=[str(data)], num_embeddings=40, malformed="skip"))  # fmt: skip
    cfg.dist.nproc = 2
    metrics = run(cfg)
    assert metrics["world_size"] == 2 and metrics["data_skipped_lines"] == 3


def _bad_cw(cfg: Any) -> None:
    cfg.sharding = ShardingConfig(kind="cw")
    cfg.model = DLRMConfig(embedding_dim=5, dense_arch_layer_sizes=[8, 5], over_arch_layer_sizes=[8, 1],
                           backend="torch")  # fmt: skip


def _bad_data(cfg: Any) -> None:
    cfg.data = SyntheticDataConfig(num_sparse_features=3, num_embeddings=40, zipf_alpha=0.0)


def _bad_over_arch(cfg: Any) -> None:
    cfg.model = DLRMConfig(embedding_dim=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[1], backend="torch")


def _missing_file(cfg: Any) -> None:
    cfg.data = CriteoTSVDataConfig(paths=["/no/such/day.tsv"], num_embeddings=40)


def _missing_npy_day(cfg: Any) -> None:
    cfg.data = CriteoNPYDataConfig(prefixes=["/no/such/day_0"], num_embeddings=40)


def _tensorboard_missing(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tensorboard() -> None:
        raise ValueError("logger=tensorboard needs the tensorboard package (test)")

    monkeypatch.setattr(importlib.import_module("tritonrec.dist.train.loggers"), "tensorboard_writer_class",
                        no_tensorboard)  # fmt: skip
    cfg.logger = LoggerConfig(kind="tensorboard")


@pytest.mark.parametrize(("change", "pattern"), [
    (_bad_cw, r"sharding=cw gives every one of the 2 ranks .* embedding_dim \[5\] is not divisible by 2"),
    (_bad_data, r"data: zipf_alpha must be a positive number, got zipf_alpha=0.0"),
    (_bad_over_arch, r"model.over_arch_layer_sizes must list at least 2 layer sizes .*=\[1\]"),
    (_missing_file, r"paths: no such file '/no/such/day.tsv'"),
    (_missing_npy_day, r"prefixes: prefix '/no/such/day_0' has no file '/no/such/day_0_dense.npy'"),
    (_tensorboard_missing, r"logger=tensorboard needs the tensorboard package"),
])  # fmt: skip
def test_rank_side_fields_are_checked_before_spawning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, pattern: str
) -> None:
    """README: every config field is checked before ranks are spawned; these were found by the ranks (after the
    spawn, the process group and the planner), each rank's traceback before the parent's re-raise."""
    run_module = importlib.import_module("tritonrec.dist.train.run")  # the package exports run(), the function

    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(run_module, "spawn", no_spawn)
    cfg = tiny_config(tmp_path / "run")
    cfg.dist.nproc = 2
    if change is _tensorboard_missing:
        change(cfg, monkeypatch)
    else:
        change(cfg)
    with pytest.raises(ValueError, match=pattern):
        run(cfg)
    assert not (tmp_path / "run").exists()


def _slow_exit() -> None:
    time.sleep(3)


def _fail_on_every_rank() -> None:
    """Rank 1 fails first (its error saved at once, its exit held back 3 s); rank 0 then stops with it."""
    import atexit

    from tritonrec.dist.train_pipeline.agreement import PipelineStageError

    rank = int(os.environ["RANK"])
    if rank == 1:
        atexit.register(_slow_exit)
        raise LookupError("the original error: malformed line 46 of day.tsv")
    time.sleep(0.5)
    raise PipelineStageError("next_batch", [1], rank)


def test_spawn_reraises_the_failing_ranks_error_not_the_one_that_stopped_with_it() -> None:
    """torch reports the rank that exited first: here rank 0's PipelineStageError, which only says that rank 1
    raised 'the original error', shown nowhere (a malformed Criteo line lost its file and line)."""
    from tritonrec.dist.train.launch import spawn

    with pytest.raises(LookupError, match="the original error: malformed line 46 of day.tsv"):
        spawn(_fail_on_every_rank, 2)
