"""GradientAccumulationWrapper in one process (torchrec's API): the pipeline's optimizer steps once per window of
``num_steps`` micro-batches on the summed gradients, a partial last window is stepped at the end of the data or on
``is_last_batch``, disabled accumulation passes through, and bad arguments are refused. The 2-rank cases (DDP's sync
skipped inside a window, the flush all-reducing a partial window) are in pipeline_cases.py."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.train_pipeline.toy import ToyModel, progress_losses, toy_batches
from tritonrec.dist.train_pipeline import (
    EvalPipelineSparseDist,
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
    PipelineStage,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)

CPU = torch.device("cpu")


def _manual(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, window: int) -> list[float]:
    """The reference: zero the gradients, run ``window`` micro-batches' backward, step; the last window may be
    short."""
    losses = []
    for start in range(0, len(batches), window):
        optimizer.zero_grad()
        for batch in batches[start : start + window]:
            loss = model(batch)[0]
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return losses


@pytest.mark.parametrize("pipeline_type", [TrainPipelineBase, TrainPipelineSparseDist])
@pytest.mark.parametrize(("count", "window"), [(9, 3), (7, 3), (5, 1), (4, 6)])
def test_accumulated_steps_equal_the_manual_loop(pipeline_type: type, count: int, window: int) -> None:
    model = ToyModel()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    pipeline = pipeline_type(model, optimizer, CPU)
    wrapped = GradientAccumulationWrapper(pipeline, optimizer, model, GradientAccumulationConfig(num_steps=window))
    losses = progress_losses(wrapped, toy_batches(count))
    assert losses == _manual(reference, ref_optimizer, list(toy_batches(count)), window)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, ref), name
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {-(-count // window)}  # one step per window, the partial last one included
    assert wrapped.current_step == (count if window > 1 else 0)  # disabled at 1: counts nothing (torchrec)


def test_is_last_batch_steps_a_partial_window() -> None:
    model = ToyModel()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = GradientAccumulationWrapper(
        TrainPipelineBase(model, optimizer, CPU), optimizer, model, GradientAccumulationConfig(num_steps=4)
    )
    data = toy_batches(5)
    for k in range(5):
        wrapped.progress(data, is_last_batch=k == 1)
    # windows: batches 0-1 (cut short by is_last_batch), then 2-5 counted from step 2: 2, 3 (step at step 3), 4
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = list(toy_batches(5))
    _manual(reference, ref_optimizer, batches[:2], 2)
    _manual(reference, ref_optimizer, batches[2:4], 2)
    ref_optimizer.zero_grad()
    reference(batches[4])[0].backward()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, ref)
        assert torch.equal(param.grad, ref.grad)  # batch 4's gradient waits for its window's step


def test_disabled_accumulation_passes_through() -> None:
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipelineBase(model, optimizer, CPU)
    wrapped = GradientAccumulationWrapper(pipeline, optimizer, model, GradientAccumulationConfig())
    assert pipeline._optimizer is optimizer  # not swapped
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert progress_losses(wrapped, toy_batches(4)) == _manual(reference, ref_optimizer, list(toy_batches(4)), 1)
    assert wrapped.current_step == 0  # torchrec's: a disabled wrapper counts nothing
    assert wrapped.close == pipeline.close and wrapped._fetcher is pipeline._fetcher  # the rest is the pipeline's


def test_reset_and_set_step_restart_the_windows() -> None:
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = GradientAccumulationWrapper(
        TrainPipelineBase(model, optimizer, CPU), optimizer, model, GradientAccumulationConfig(num_steps=3)
    )
    data = toy_batches(10)
    wrapped.progress(data)
    wrapped.set_step(2)  # the next micro-batch closes a window
    wrapped.progress(data)
    assert wrapped.current_step == 3 and wrapped.optimizer_wrapper._needs_zero_grad
    wrapped.reset()
    assert wrapped.current_step == 0
    with pytest.raises(ValueError, match="step"):
        wrapped.set_step(-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_steps": 0}, ValueError, "num_steps"),
        ({"num_warmup_steps": 0}, ValueError, "num_warmup_steps"),
        ({"num_steps": True}, TypeError, "num_steps"),
        ({"num_steps": 2.0}, TypeError, "num_steps"),
        ({"is_enabled": 1}, TypeError, "is_enabled"),
    ],
)
def test_bad_config_is_refused_by_name(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GradientAccumulationConfig(**kwargs)


def test_config_enables_itself_for_several_steps() -> None:
    assert GradientAccumulationConfig(num_steps=2).is_enabled
    assert not GradientAccumulationConfig(num_steps=1).is_enabled


def test_an_optimizer_the_pipeline_does_not_step_is_refused() -> None:
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(num_steps=2)
    with pytest.raises(ValueError, match="the optimizer the pipeline steps"):
        GradientAccumulationWrapper(TrainPipelineBase(model, optimizer, CPU), other, model, config)
    with pytest.raises(ValueError, match="StagedTrainPipeline"):
        GradientAccumulationWrapper(StagedTrainPipeline([PipelineStage("copy", lambda b: b)]), optimizer, model, config)
    with pytest.raises(TypeError, match="config"):
        GradientAccumulationWrapper(TrainPipelineBase(model, optimizer, CPU), optimizer, model, {"num_steps": 2})


@pytest.mark.parametrize("eval_optimizer", ["none", "training"])
def test_an_eval_pipeline_passes_through_without_touching_the_open_window(eval_optimizer: str) -> None:
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(num_steps=3)
    train = GradientAccumulationWrapper(TrainPipelineBase(model, optimizer, CPU), optimizer, model, config)
    data = toy_batches(2)
    train.progress(data)
    train.progress(data)  # a window of 3 left open: 2 micro-batches' gradients wait for the step
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    optim = None if eval_optimizer == "none" else optimizer
    evaluation = EvalPipelineSparseDist(model, optim, CPU)
    wrapped = GradientAccumulationWrapper(evaluation, optim, model, config)
    assert len(progress_losses(wrapped, toy_batches(4))) == 4  # StopIteration steps nothing (no optimizer to step)
    assert evaluation._optimizer is optim and wrapped.current_step == 0
    for param, weight, grad in zip(model.parameters(), weights, grads, strict=True):
        assert torch.equal(param, weight) and torch.equal(param.grad, grad)


class _SyncLog(DistributedDataParallel):
    """Stands in for a DDP module (no process group): records ``label`` each time its sync is skipped."""

    def __init__(self, log: list[str], label: str) -> None:
        nn.Module.__init__(self)
        self.log, self.label = log, label

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.log.append(self.label)
        yield


class _Holder(nn.Module):
    """A model object around ``toy`` with its own DDP module (what ``attach(model)`` may hand over)."""

    def __init__(self, toy: ToyModel, log: list[str], label: str) -> None:
        super().__init__()
        self.toy, self.ddp = toy, _SyncLog(log, label)

    def forward(self, batch: object) -> tuple:
        return self.toy(batch)


def test_attach_a_new_model_skips_its_sync_from_then_on() -> None:
    """torchrec's wrapper keeps skipping the first model's DDP sync after attach(new model)."""
    toy, log = ToyModel(), []
    first, second = _Holder(toy, log, "first"), _Holder(toy, log, "second")
    optimizer = torch.optim.SGD(toy.parameters(), lr=0.1)
    config = GradientAccumulationConfig(num_steps=3)
    wrapped = GradientAccumulationWrapper(TrainPipelineSparseDist(first, optimizer, CPU), optimizer, first, config)
    batches = toy_batches(9)
    for _ in range(3):  # micro-batch 0 syncs (the first), 1 skips, 2 closes the window
        wrapped.progress(batches)
    wrapped.attach(second)
    for _ in range(2):  # 3 and 4 skip the sync: of the model now trained
        wrapped.progress(batches)
    assert log == ["first", "second", "second"]
    with pytest.raises(RuntimeError, match="inside an accumulation window"):
        wrapped.attach(first)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or None, got str"):
        wrapped.attach("model")
