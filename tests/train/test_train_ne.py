"""The job's NE (computed by tritonrec.metrics' NEMetric) against NE written out on the predictions the job saw:
training window and lifetime NE at every log point (padding rows weigh nothing), held-out NE; and a resumed job's NE,
from a checkpoint with the NE state and from one written before it was kept. The distributed job's NE is checked
against this one in test_train_dist.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tritonrec.dist.train.single as single_job
from tests.train.dist_job_cases import tiny_config
from tritonrec.data.batcher import Batcher
from tritonrec.dist.train import run
from tritonrec.dist.train.config import SyntheticDataConfig
from tritonrec.dist.train.loop import TrainHistory
from tritonrec.dist.train.ne import ne_module, ne_values, update_ne

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # logits, labels, weights (valid mask)


def written_out_ne(logits: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    """torchrec's NE: the weighted cross entropy (bits) of p = sigmoid(logit), clamped to [1e-12, 1 - 1e-12], over
    that of predicting the weighted base rate q for every row."""
    p = np.clip(1.0 / (1.0 + np.exp(-logits)), 1e-12, 1 - 1e-12)
    cross_entropy = -np.sum(weights * (labels * np.log2(p) + (1 - labels) * np.log2(1 - p)))
    positives, negatives = np.sum(weights * labels), np.sum(weights * (1 - labels))
    q = positives / (positives + negatives)
    return float(cross_entropy / -(positives * np.log2(q) + negatives * np.log2(1 - q)))


def _ne_of(steps: list[Rows]) -> float:
    return written_out_ne(*(np.concatenate(part) for part in zip(*steps, strict=True)))


def _config(output_dir: Path, **changes: Any) -> Any:
    """50 training samples in batches of 16 (each epoch's 4th batch holds 2 real rows and 14 padding rows), 40
    held-out ones in batches of 16 (the last half padding), and a window of 40 rows: the training AUROC holds the
    last 40 rows, the window NE the last 2 whole steps (32 rows)."""
    data = SyntheticDataConfig(num_sparse_features=3, num_embeddings=40, num_samples=50, num_eval_samples=40)
    return tiny_config(output_dir, data=data, batch_size=16, eval_batch_size=16, steps=8, log_every=2, eval_every=4,
                       checkpoint_every=4, train_auroc_window=40, **changes)  # fmt: skip


def _run_recording(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[Rows], list[Any]]:
    """Run the one-process job, recording each step's (logits, labels, valid mask) and each evaluation's result
    with the logits its model produced (read by a forward hook) and the held-out batches' labels and masks."""
    train_step, evaluate = single_job.train_step, single_job.evaluate
    steps: list[Rows] = []
    evals: list[tuple[dict[str, float], Rows]] = []

    def train_step_and_record(model: Any, optimizer: Any, batch: Any) -> Any:
        loss, logits = train_step(model, optimizer, batch)
        steps.append((logits.double().numpy(), batch.labels.double().numpy(), batch.valid_mask.double().numpy()))
        return loss, logits

    def evaluate_and_record(model: Any, source: Any, batch_size: int, device: Any) -> dict[str, float]:
        logits: list[torch.Tensor] = []
        hook = model.model.register_forward_hook(lambda module, args, out: logits.append(out.detach().squeeze(-1)))
        try:
            result = evaluate(model, source, batch_size, device)
        finally:
            hook.remove()
        batches = list(Batcher(source.element_spec).process(source, batch_size))
        labels = torch.cat([b.labels for b in batches]).double().numpy()
        mask = torch.cat([b.valid_mask for b in batches]).double().numpy()
        evals.append((result, (torch.cat(logits).double().numpy(), labels, mask)))
        return result

    monkeypatch.setattr(single_job, "train_step", train_step_and_record)
    monkeypatch.setattr(single_job, "evaluate", evaluate_and_record)
    return run(cfg), steps, evals


def test_ne_equals_the_formula_on_the_predictions_the_job_saw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, steps, evals = _run_recording(_config(tmp_path), monkeypatch)
    assert len(steps) == 8 and [int(mask.sum()) for _, _, mask in steps[:4]] == [16, 16, 16, 2]  # padding rows
    history = metrics["train_ne_history"]
    assert history["step"] == [2, 4, 6, 8]
    for i, step in enumerate(history["step"]):
        assert history["lifetime_ne"][i] == pytest.approx(_ne_of(steps[:step]), rel=1e-10)
        assert history["window_ne"][i] == pytest.approx(_ne_of(steps[step - 2 : step]), rel=1e-10)
    assert metrics["train_lifetime_ne"] == history["lifetime_ne"][-1]
    assert metrics["train_window_ne"] == history["window_ne"][-1]
    assert [int(rows[2].sum()) for _, rows in evals] == [40, 40] and len(evals[0][1][0]) == 48  # 8 padding rows
    for result, rows in evals:
        assert result["ne"] == pytest.approx(written_out_ne(*rows), rel=1e-10)
    assert metrics["eval_history"]["ne"] == [result["ne"] for result, _ in evals]
    assert metrics["eval_ne"] == evals[-1][0]["ne"]


def test_a_resumed_job_reports_the_uninterrupted_jobs_ne(tmp_path: Path) -> None:
    full = run(_config(tmp_path / "full"))
    resumed = run(_config(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoints" / "step_000004.pt")))
    assert resumed["history"]["loss"] == full["history"]["loss"]  # bit for bit: the same predictions
    assert resumed["train_lifetime_ne"] == full["train_lifetime_ne"]  # the lifetime states came with the checkpoint
    # the window is rebuilt from the checkpoint's training AUROC rows: the same rows, summed in another order
    assert resumed["train_window_ne"] == pytest.approx(full["train_window_ne"], rel=1e-12)
    assert resumed["train_ne_history"]["step"] == full["train_ne_history"]["step"]
    for key in ("window_ne", "lifetime_ne"):
        assert resumed["train_ne_history"][key] == pytest.approx(full["train_ne_history"][key], rel=1e-12)
    assert resumed["eval_history"]["ne"] == full["eval_history"]["ne"]


def test_a_checkpoint_from_before_ne_resumes_with_ne_from_the_resume_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older checkpoint (no NE state in its history) loads; the lifetime NE covers the steps trained after the
    resume, the window NE is the uninterrupted one's, earlier evaluations have no NE, and train.log says so."""
    full, steps, _ = _run_recording(_config(tmp_path / "full"), monkeypatch)
    payload = torch.load(tmp_path / "full" / "checkpoints" / "step_000004.pt", weights_only=True)
    del payload["history"]["train_ne"], payload["history"]["train_ne_points"], payload["history"]["eval_points"]["ne"]
    torch.save(payload, tmp_path / "old.pt")
    resumed = run(_config(tmp_path / "resumed", resume=str(tmp_path / "old.pt")))
    assert resumed["history"]["loss"] == full["history"]["loss"]
    assert resumed["train_lifetime_ne"] == pytest.approx(_ne_of(steps[4:]), rel=1e-10)
    assert resumed["train_window_ne"] == pytest.approx(full["train_window_ne"], rel=1e-12)
    assert resumed["train_ne_history"]["step"] == [6, 8]
    assert resumed["eval_history"]["ne"] == [None, full["eval_history"]["ne"][1]]
    note = "the checkpoint holds no NE state: the lifetime NE covers the steps after 4 only"
    assert note in (tmp_path / "resumed" / "train.log").read_text()


def test_a_window_smaller_than_a_step_holds_the_latest_step() -> None:
    """torchrec's NE window drops whole batches; ``train_auroc_window`` below one step's rows keeps that step."""
    generator = torch.Generator().manual_seed(0)
    module = ne_module(4, 16)
    steps = []
    for _ in range(3):
        logits, labels = torch.randn(16, generator=generator), (torch.rand(16, generator=generator) < 0.3).double()
        weights = (torch.arange(16) < 12).double()  # 4 padding rows
        update_ne(module, logits, labels, weights)
        steps.append((logits.double().numpy(), labels.numpy(), weights.numpy()))
    values = ne_values(module)
    assert values["window_ne"] == pytest.approx(_ne_of(steps[-1:]), rel=1e-10)
    assert values["lifetime_ne"] == pytest.approx(_ne_of(steps), rel=1e-10)


def test_a_window_of_more_than_a_thousand_steps_holds_them_all() -> None:
    """Small steps: the window NE covers the latest ``train_auroc_window`` rows like the training AUROC beside it,
    also after a resume (torchrec's window buffer stops at 1000 batches; it covered the last 1000 steps only)."""
    generator = torch.Generator().manual_seed(1)
    history, steps = TrainHistory(train_auroc_window=2400, step_samples=2), []
    for step in range(1, 1501):  # the second half predicts worse: a window cut at 1000 steps reads differently
        logits = torch.randn(2, generator=generator, dtype=torch.float64) + (2.0 if step > 900 else 0.0)
        labels = (torch.rand(2, generator=generator) < 0.3).double()
        weights = torch.ones(2, dtype=torch.float64)
        history.record_values(step, 0.5, logits, labels, weights, 2, 0.0)
        steps.append((logits.numpy(), labels.numpy(), weights.numpy()))
    resumed = TrainHistory(train_auroc_window=2400, step_samples=2)
    resumed.load_state_dict(history.state_dict())
    for point in (history.log_point(1500), resumed.log_point(1500)):
        assert point["ne"] == pytest.approx(_ne_of(steps[-1200:]), rel=1e-10)
        assert point["lifetime_ne"] == pytest.approx(_ne_of(steps), rel=1e-10)
