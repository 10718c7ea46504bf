"""JobStepAgreement without a process group (one rank): the per-step SIGTERM flag and non-finite check, and the one-step
lag used on accelerators (exercised here with CPU tensors and the lag forced). Two-rank cases: test_train_dist.py."""

from __future__ import annotations

import signal

import pytest
import torch

from tritonrec.dist.train.launch import StopRequest
from tritonrec.dist.train.loop import NonFiniteLossError
from tritonrec.dist.train.step_agreement import JobStepAgreement


def _output(loss: float, logits: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = torch.tensor(logits if logits is not None else [0.5, -0.5])
    return torch.tensor(loss), scores, torch.zeros_like(scores)


def test_finite_steps_agree_to_go_on() -> None:
    agreement = JobStepAgreement(StopRequest(), None, torch.device("cpu"))
    for step in range(1, 4):
        agreement.note(step, _output(0.69))
        assert agreement.agree() is False


@pytest.mark.parametrize(("loss", "logits", "pattern"), [
    (float("nan"), None, r"^step 2: the training loss is nan on rank 0: training diverged"),
    (float("inf"), None, r"^step 2: the training loss is inf on rank 0: training diverged"),
    (0.7, [0.1, float("nan")], r"^step 2: the training loss is 0.7 on rank 0, and the model's scores hold NaN"),
])  # fmt: skip
def test_a_nonfinite_step_raises_at_that_step(loss: float, logits: list[float] | None, pattern: str) -> None:
    agreement = JobStepAgreement(StopRequest(), None, torch.device("cpu"))
    agreement.note(1, _output(0.69))
    agreement.agree()
    agreement.note(2, _output(loss, logits))
    with pytest.raises(NonFiniteLossError, match=pattern):
        agreement.agree()


def test_lagged_check_reports_the_step_one_step_later() -> None:
    """On an accelerator the check of step s is read at step s + 1's agreement, and still names step s."""
    agreement = JobStepAgreement(StopRequest(), None, torch.device("cpu"))
    agreement._lagged = True  # what a CUDA device sets; the tensors stay on the CPU here
    agreement.note(1, _output(float("nan")))
    assert agreement.agree() is False  # step 1's check is not read yet
    agreement.note(2, _output(0.69))
    with pytest.raises(NonFiniteLossError, match=r"^step 1: the training loss is nan on rank 0"):
        agreement.agree()


def test_sigterm_is_agreed() -> None:
    stop = StopRequest()
    agreement = JobStepAgreement(stop, None, torch.device("cpu"))
    agreement.note(1, _output(0.69))
    assert agreement.agree() is False
    stop.signal = signal.SIGTERM
    agreement.note(2, _output(0.69))
    assert agreement.agree() is True and stop.name == "SIGTERM"
