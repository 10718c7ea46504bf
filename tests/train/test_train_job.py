"""The job's new surface in one process: the sharding/pipeline/qcomm/logger groups compose typed, their bad values
name the field, train.log holds the step and eval lines, the csv and tensorboard loggers write their series, a resume
that would train nothing or on other data is refused, and a multirun sweep lands in one folder with a summary table.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from tests.train.dist_job_cases import tiny_config
from tritonrec.dist.train import as_train_config, register_configs, run
from tritonrec.dist.train.config import OptimConfig
from tritonrec.dist.train.job_config import LoggerConfig, PipelineConfig, QCommConfig, ShardingConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
register_configs()


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_the_new_groups_hold_every_option() -> None:
    assert _names("sharding") == ["auto", "cw", "dp", "rw", "tw", "twrw"]
    assert _names("pipeline") == ["base", "semi_sync", "sparse_dist", "staged"]
    assert _names("qcomm") == ["bf16", "fp16", "fp8", "int8", "mx4", "none"]
    assert _names("logger") == ["csv", "none", "tensorboard"]


def test_every_option_composes_typed() -> None:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        for group in ("sharding", "pipeline", "qcomm", "logger"):
            for option in _names(group):
                cfg = as_train_config(compose(config_name="train", overrides=[f"{group}={option}"]))
                node = getattr(cfg, group)
                if group == "qcomm":
                    expected = "fp32" if option == "none" else option
                    assert (node.forward, node.backward) == (expected, expected), option
                else:
                    assert node.kind == option


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("dist.nproc", 0, r"dist.nproc must be an int >= 1, got dist.nproc=0"),
    ("dist.backend", "mpi", r"dist.backend must be one of \['auto', 'gloo', 'nccl'\], got dist.backend='mpi'"),
    ("sharding.kind", "diagonal", r"sharding.kind must be one of .*got sharding.kind='diagonal'"),
    ("pipeline.kind", "async", r"pipeline.kind must be one of .*got pipeline.kind='async'"),
    ("pipeline.host_prefetch", -1, r"pipeline.host_prefetch must be an int >= 0"),
    ("qcomm.forward", "fp64", r"qcomm.forward must be one of .*got qcomm.forward='fp64'"),
    ("logger.kind", "wandb", r"logger.kind must be one of \['none', 'csv', 'tensorboard'\], got logger.kind='wandb'"),
    ("data.chunk_size", 0, r"data.chunk_size must be a positive int or None, got data.chunk_size=0"),
])  # fmt: skip
def test_bad_job_config_names_the_field(tmp_path: Path, field: str, value: Any, pattern: str) -> None:
    cfg = tiny_config(tmp_path / "run")
    group, name = field.split(".")
    setattr(getattr(cfg, group), name, value)
    with pytest.raises(ValueError, match=pattern):
        run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("changes", "note"), [
    ({}, None),
    ({"pipeline": PipelineConfig(kind="staged"), "qcomm": QCommConfig("int8", "int8")},
     "pipeline=staged, qcomm=int8/int8 ignored: one process (dist.nproc=1)"),
])  # fmt: skip
def test_single_process_says_which_distributed_settings_it_ignores(
    tmp_path: Path, changes: dict[str, Any], note: str | None
) -> None:
    cfg = tiny_config(tmp_path, steps=2, eval_every=0, **changes)
    cfg.sharding = ShardingConfig()  # the default, auto: nothing to say about it
    run(cfg)
    lines = [line for line in (tmp_path / "train.log").read_text().splitlines() if "ignored" in line]
    if note is None:
        assert lines == []
    else:
        assert len(lines) == 1 and note in lines[0]


def test_single_process_log_and_csv_series(tmp_path: Path) -> None:
    metrics = run(tiny_config(tmp_path, steps=4, eval_every=2))
    assert metrics["world_size"] == 1 and metrics["eval_history"]["samples"] == [64.0, 64.0]
    log = (tmp_path / "train.log").read_text().splitlines()
    # tiny_config asks for sharding=tw, which one process cannot apply: the job says so first
    assert "] tiny_dist: sharding=tw ignored: one process (dist.nproc=1) has no embedding collectives" in log[0]
    log = log[1:]
    assert [line.split("] ")[1].split(":")[0] for line in log] == ["step 2", "step 2", "step 4", "step 4"]
    assert "held-out AUROC" in log[1] and "samples/s" in log[0]
    assert "train NE" in log[0] and log[1].endswith(f"held-out NE {metrics['eval_history']['ne'][0]:.4f}")
    rows = list(csv.DictReader((tmp_path / "series.csv").open()))
    assert [(r["kind"], r["step"]) for r in rows] == [("train", "2"), ("eval", "2"), ("train", "4"), ("eval", "4")]
    assert float(rows[0]["loss"]) > 0 and 0 < float(rows[1]["auroc"]) < 1
    ne_history = metrics["train_ne_history"]
    assert [float(rows[i]["ne"]) for i in (0, 2)] == ne_history["window_ne"]
    assert [float(rows[i]["lifetime_ne"]) for i in (0, 2)] == ne_history["lifetime_ne"]
    assert [float(rows[i]["ne"]) for i in (1, 3)] == metrics["eval_history"]["ne"]


def test_tensorboard_logger(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, steps=2)
    cfg.logger = LoggerConfig(kind="tensorboard")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ValueError, match="logger=tensorboard needs the tensorboard package"):
            run(cfg)
        return
    run(cfg)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize(("change", "pattern"), [
    ({"steps": 4}, "was taken after step 4, and steps=4 leaves nothing to train"),
    ({"seed": 3}, "data.seed=0 in the checkpoint but 3 now"),
    ({"num_embeddings": 50}, "data.num_embeddings=40 in the checkpoint but 50 now"),
    # the distributed job refuses both at the same world size; the one process trained on with them
    ({"batch_size": 4}, r"trained batch_size=8, this job has batch_size=4: set batch_size=8"),
    ({"optim": OptimConfig(sparse="ADAM", dense="adam")},
     r"optim.dense='adagrad' in the checkpoint but 'adam' now, optim.sparse='EXACT_ROWWISE_ADAGRAD' in the"),
])  # fmt: skip
def test_single_process_resume_refuses_no_steps_or_other_data(
    tmp_path: Path, change: dict[str, Any], pattern: str
) -> None:
    run(tiny_config(tmp_path / "first", steps=4, logger=LoggerConfig()))
    cfg = tiny_config(tmp_path / "again", steps=8, resume=str(tmp_path / "first" / "checkpoints" / "step_000004.pt"))
    for key, value in change.items():
        setattr(cfg if key in ("steps", "batch_size", "optim") else cfg.data, key, value)
    with pytest.raises(ValueError, match=pattern):
        run(cfg)


def test_a_resume_trains_with_the_configs_learning_rates(tmp_path: Path) -> None:
    """Loading the optimizers' state restored their saved rates, so a run resumed with optim.sparse_lr /
    optim.dense_lr changed (what the job advises after a non-finite loss) trained on with the old ones, silently:
    now the config's apply, and train.log says so. An unchanged resume stays exact."""
    run(tiny_config(tmp_path / "first", steps=6, checkpoint_every=3))
    checkpoint = str(tmp_path / "first" / "checkpoints" / "step_000003.pt")
    same = run(tiny_config(tmp_path / "same", steps=6, resume=checkpoint))
    first = json.loads((tmp_path / "first" / "metrics.json").read_text())
    assert same["history"]["loss"] == first["history"]["loss"] and len(first["history"]["loss"]) == 6
    for field in ("sparse_lr", "dense_lr"):
        cfg = tiny_config(tmp_path / field, steps=6, resume=checkpoint)
        setattr(cfg.optim, field, 1.5)
        changed = run(cfg)
        losses = changed["history"]["loss"]  # steps 1-3 restored; step 4's forward read the saved weights
        assert losses[:4] == first["history"]["loss"][:4], field
        assert all(a != b for a, b in zip(losses[4:], first["history"]["loss"][4:], strict=True)), field
        note = next(line for line in (tmp_path / field / "train.log").read_text().splitlines() if "resumed" in line)
        assert note.endswith(f"from here on optim.{field}=1.5 (checkpoint: {getattr(OptimConfig(), field)!r})")


def test_restore_hyperparameters_puts_back_what_the_config_built() -> None:
    """Every group gets the hyperparameters its optimizer was built with, each change reported once; an argument
    the config no longer sets goes back to its default (a weight_decay dropped from dense_kwargs stayed at the
    checkpoint's)."""
    import torch

    from tritonrec.dist.train.job_state import built_hyperparameters, restore_hyperparameters

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    fused = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:2]}], lr=0.01)
    dense = torch.optim.Adam(params[2:], lr=0.05)  # weight_decay: the default, 0
    optimizers = {"sparse": fused, "dense": dense}
    built = built_hyperparameters(optimizers)
    for group in fused.param_groups:  # as a loaded checkpoint leaves them
        group["lr"] = 0.05
    dense.param_groups[0].update(weight_decay=0.5, betas=[0.9, 0.999])  # betas: equal, as a list
    changes = restore_hyperparameters(built, optimizers)
    assert changes == ["optim.sparse_lr=0.01 (checkpoint: 0.05)", "optim.dense_kwargs.weight_decay=0 (checkpoint: 0.5)"]
    assert [g["lr"] for g in fused.param_groups] == [0.01, 0.01] and dense.param_groups[0]["weight_decay"] == 0
    assert restore_hyperparameters(built, optimizers) == []  # nothing left to change


def test_multirun_sweep_lands_in_one_folder_with_a_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "-m", "experiment=synthetic_dlrm,synthetic_dcn",
               "steps=3", "batch_size=8", "eval_batch_size=32", "log_every=1", "eval_every=3", "data.num_embeddings=40",
               "data.num_eval_samples=64", "model.backend=torch", "progress=false", "plot=false",
               f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "0_synthetic_dlrm", "1_synthetic_dcn"]  # fmt: skip
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["name"] for r in rows] == ["synthetic_dlrm", "synthetic_dcn"]
    assert all(float(r["final_loss"]) > 0 and r["steps"] == "3" for r in rows)
    for row in rows:  # the CSV holds the jobs' own numbers, unrounded and without thousands separators
        metrics = json.loads((sweep / row["job"] / "metrics.json").read_text())
        assert (
            float(row["samples_per_s"]) == metrics["samples_per_s"]
            and float(row["final_loss"]) == metrics["final_loss"]
            and float(row["eval_ne"]) == metrics["eval_ne"]
        )
    assert "experiment=synthetic_dcn" in rows[1]["overrides"]
    assert (sweep / "summary.md").read_text().count("\n") == 4  # header, rule, two jobs
    assert "sweep summary" in done.stdout


def _job_state(world: int, batch: int, chunk: int | None) -> Any:
    from tritonrec.dist.train.job_state import JobState

    job = JobState()
    states = [{"epoch": 0, "position": 5 * batch, "batches": 5} for _ in range(world)]
    job.update(5, world, batch, states, {}, {}, chunk)
    return job


def test_data_position_at_another_world_size() -> None:
    """Same world: each rank's saved position; another world: derived where every step keeps its samples, else a
    ValueError saying what to change."""
    job = _job_state(2, 8, 8)
    assert job.data_state_for(1, 2, 8, endless_synthetic=False) == {"epoch": 0, "position": 40, "batches": 5}
    assert job.data_state_for(0, 1, 16, endless_synthetic=True) == {"epoch": 0, "position": 80, "batches": 5}
    with pytest.raises(ValueError, match="only the endless synthetic stream keeps every step's samples"):
        job.data_state_for(0, 1, 16, endless_synthetic=False)
    with pytest.raises(ValueError, match="global batch is 8 x 2 ranks = 16 samples; with 1 ranks set batch_size=16"):
        job.data_state_for(0, 1, 8, endless_synthetic=True)
    with pytest.raises(ValueError, match="chunks of 16 samples, which do not divide batch_size=8"):
        _job_state(1, 16, 16).data_state_for(0, 2, 8, endless_synthetic=True)
    with pytest.raises(ValueError, match="set batch_size=8"):
        job.data_state_for(0, 2, 4, endless_synthetic=True)
    # 16 samples over 3 ranks: no batch_size keeps them (it advised batch_size=5.33333)
    with pytest.raises(ValueError, match="16 samples do not split evenly over 3 ranks: resume with a world size that"):
        job.data_state_for(0, 3, 5, endless_synthetic=True)


def test_data_that_yields_no_batch_says_why() -> None:
    """It said "empty or shorter than one batch" where a short part is padded unless drop_remainder is set."""
    from tritonrec.data.batcher import Batcher
    from tritonrec.data.synthetic import SyntheticRecSource
    from tritonrec.dist.train.loop import iterate_batches

    short = SyntheticRecSource([40, 40], num_dense=2, num_samples=3, chunk_size=8)
    assert next(iterate_batches(Batcher(short.element_spec), short, 8)).num_valid() == 3  # padded, not refused
    with pytest.raises(ValueError, match="the training data holds fewer than batch_size=8 samples, and drop_remainder"):
        next(iterate_batches(Batcher(short.element_spec), short, 8, drop_remainder=True))
    empty = SyntheticRecSource([40, 40], num_dense=2, num_samples=1, chunk_size=8, rank=0, world_size=2)
    with pytest.raises(ValueError, match="the training data holds no sample: it yields no batch"):
        next(iterate_batches(Batcher(empty.element_spec), empty, 8))
