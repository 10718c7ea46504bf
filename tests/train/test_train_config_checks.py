"""Config mistakes of the training job fail early and say what to change: a CUDA device on a machine without CUDA,
a TrainConfig without data, an unknown sparse rule, and (through the hydra entry point) no empty run folder left
behind; every fused rule, per-element Adagrad included, is a valid ``optim.sparse``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tritonrec.dist.train.config import SyntheticDataConfig, TrainConfig, as_train_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**changes: object) -> TrainConfig:
    cfg = TrainConfig(data=SyntheticDataConfig(num_sparse_features=2, num_embeddings=10), steps=1, progress=False)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def test_cuda_device_without_cuda_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"device='{device}' needs CUDA, which this torch .* cannot use.*=cpu"):
            as_train_config(_cfg(device=device))
    assert as_train_config(_cfg(device="cpu")).device == "cpu"


def test_cuda_device_index_past_the_gpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device='cuda:2' but this machine has 2 CUDA device\(s\)"):
        as_train_config(_cfg(device="cuda:2"))


def test_missing_data_says_how_to_set_it() -> None:
    with pytest.raises(ValueError, match=r"data is missing: .*data=synthetic.*TrainConfig\(data=SyntheticDataConfig"):
        as_train_config(TrainConfig())


def test_failed_config_leaves_no_run_folder(tmp_path: Path) -> None:
    """A bad value fails before training and the hydra run folder is removed, not left empty."""
    run_dir = tmp_path / "outputs" / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "steps=0", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "steps must be a positive int, got steps=0" in result.stderr
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def test_sparse_optimizer_takes_per_element_adagrad_and_names_the_rules(tmp_path: Path) -> None:
    """``optim.sparse=EXACT_ADAGRAD`` trains (its per-element state next to the tables); an unknown rule's error lists
    the fused rules."""
    from tests.train.dist_job_cases import tiny_config
    from tritonrec.dist.train import run
    from tritonrec.dist.train.config import OptimConfig

    optim = OptimConfig(sparse="EXACT_ADAGRAD", sparse_lr=0.05, sparse_kwargs={"eps": 1e-6}, dense="adagrad")
    metrics = run(tiny_config(tmp_path, optim=optim, steps=2, eval_every=0, checkpoint_every=0))
    assert metrics["steps"] == 2 and all(math.isfinite(loss) for loss in metrics["history"]["loss"])
    unknown = r"optim.sparse / optim.sparse_kwargs: optimizer_type='ADAGRAD' cannot be fused; .*'EXACT_ADAGRAD'"
    with pytest.raises(ValueError, match=unknown):
        as_train_config(_cfg(optim=OptimConfig(sparse="ADAGRAD")))
