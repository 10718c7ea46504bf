"""Train pipelines in one process, on what porting torchrec code and the sparse-dist pipeline's agreement placement
need: torchrec's positional arguments and keywords (``apply_jit``, ``context_type``, ``custom_model_fwd``,
``attach(model, sparse_dist)``, ``SparseDataDistUtil.data_exhausted_callback``), the (loss, output) contract's
error, when the ranks' agreement may run after the forward, and ``execute_all_batches=False`` in that mode.

The toy collections that claim their input dists run on a group of their own (``OwnGroupSharded``) put the
sparse-dist pipeline in the mode where it reads the agreement after the forward, in one process (the agreement is
then a no-op, its placement is what these tests check).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.train_pipeline.toy import (
    OwnGroupModel,
    OwnGroupPlusComputedModel,
    ToyModel,
    ToySharded,
    progress_losses,
    staged_losses,
    toy_batches,
)
from tritonrec.dist.train_pipeline import (
    EvalPipelineSparseDist,
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineContext,
    TrainPipelineSparseDist,
    trace_sharded_inputs,
)
from tritonrec.dist.train_pipeline.fetch import PendingBatch
from tritonrec.dist.train_pipeline.tracing import rewrite_model

CPU = torch.device("cpu")


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _run(pipeline: Any, data: Iterator[Any]) -> list[float]:
    losses = progress_losses(pipeline, data)
    pipeline.close()
    return losses


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _base(model_type: type, data: Iterator[Any], fwd: Callable[..., Any] | None = None) -> tuple[list[float], Any]:
    model = model_type()
    custom = None if fwd is None else (lambda batch: fwd(model, batch))
    return _run(TrainPipelineBase(model, _sgd(model), CPU, custom), data), _weights(model)


# --------------------------------------------------------------------------------------- where the ranks agree
def _step_order(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Any]:
    """The order of the agreement's read and the model's forward in the 3rd ``progress`` (a steady-state step)."""
    events: list[str] = []
    result = PendingBatch.result
    monkeypatch.setattr(PendingBatch, "result", lambda self: events.append("agree") or result(self))
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, host_prefetch=0)
    data = toy_batches(6)
    pipeline.progress(data)
    pipeline.progress(data)
    events.clear()
    pipeline.progress(data)
    return events, pipeline


def test_the_agreement_runs_after_the_forward_when_every_collection_is_pipelined_on_its_own_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events, pipeline = _step_order(OwnGroupModel(), monkeypatch)
    assert events == ["forward", "agree"]
    assert pipeline.defers_agreement


def test_a_collection_running_its_own_input_dist_in_the_forward_moves_the_agreement_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its input dist shares the input-dist group with the pipelined one's launch ahead: read after the forward,
    the agreement came too late to stop a rank from pairing it with a launch the failed rank lacks."""
    events, pipeline = _step_order(OwnGroupPlusComputedModel(), monkeypatch)
    assert pipeline.pipelined_modules == ["sharded"]
    assert events == ["agree", "forward"]
    assert not pipeline.defers_agreement and pipeline._pipelined.unpipelined == ["other"]


def test_a_collection_fed_a_computed_input_still_trains_like_base() -> None:
    base_losses, base_weights = _base(OwnGroupPlusComputedModel, toy_batches(9))
    model = OwnGroupPlusComputedModel()
    losses = _run(TrainPipelineSparseDist(model, _sgd(model), CPU), toy_batches(9))
    assert losses == base_losses and _same(_weights(model), base_weights)


class _Nested(OwnGroupModel):
    """A sharded module holding another (as a feature-processed collection holds its sharded EBC)."""

    def __init__(self) -> None:
        super().__init__()
        self.sharded.inner = ToySharded()


def test_a_sharded_module_inside_a_pipelined_one_neither_blocks_the_deferral_nor_is_reported() -> None:
    model = _Nested()
    assert trace_sharded_inputs(model).reasons == {}
    pipelined, _ = rewrite_model(model, TrainPipelineContext(index=0), None)
    assert list(pipelined.forwards) == ["sharded"] and pipelined.unpipelined == []
    assert pipelined.can_defer_agreement


# ---------------------------------------------------------------------------------- execute_all_batches=False
@pytest.mark.parametrize("model_type", [ToyModel, OwnGroupModel])
def test_without_execute_all_batches_the_stop_precedes_the_forward_and_a_new_iterator_trains_on(
    model_type: type,
) -> None:
    """torchrec's semantics, also when the agreement is otherwise read after the forward (OwnGroupModel): 4 batches
    train 2 steps with 2 forwards, the next call raises StopIteration again, a new iterator trains the 2 batches in
    flight then its own (whose last 2 stay in flight)."""
    model = model_type()
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, execute_all_batches=False, host_prefetch=0)
    data = toy_batches(4)
    losses = _run(pipeline, data)
    assert len(losses) == 2 and len(forwards) == 2
    with pytest.raises(StopIteration):
        pipeline.progress(data)
    losses += _run(pipeline, toy_batches(4, start=10))
    base_losses, base_weights = _base(model_type, itertools.chain(toy_batches(4), toy_batches(2, start=10)))
    assert losses == base_losses and _same(_weights(model), base_weights)


# ------------------------------------------------------------------------------------ torchrec's signatures
def test_torchrec_positional_arguments() -> None:
    model = ToyModel()
    fwd = lambda batch: model(batch)
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, False, False, TrainPipelineContext, False, fwd)
    assert pipeline._execute_all_batches is False and pipeline._custom_model_fwd is fwd
    assert TrainPipelineBase(model, _sgd(model), CPU, fwd)._custom_model_fwd is fwd
    EvalPipelineSparseDist(model, None, CPU, False, False)
    EvalPipelineSparseDist(model, None, CPU, apply_jit=False, pipeline_postproc=False)
    SparseDataDistUtil(model, None, False, None, False, None)


class _Context(TrainPipelineContext):
    pass


def test_context_type_makes_the_contexts() -> None:
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, context_type=_Context, host_prefetch=0)
    pipeline.progress(toy_batches(4))
    assert pipeline.contexts and all(type(c) is _Context for c in pipeline.contexts)


def _doubled(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
    _doubled.calls += 1  # type: ignore[attr-defined]
    loss, output = model(batch)
    return loss * 2, output


@pytest.mark.parametrize("make", [TrainPipelineBase, TrainPipelineSparseDist])
def test_custom_model_fwd_replaces_the_models_call(make: type) -> None:
    """The pipeline trains on custom_model_fwd's loss (twice the model's here, so the weights differ from a plain
    run); through the sparse-dist pipeline the model it calls still consumes the prefetched input dists."""
    _doubled.calls = 0  # type: ignore[attr-defined]
    model = ToyModel()
    losses = _run(make(model, _sgd(model), CPU, custom_model_fwd=lambda b: _doubled(model, b)), toy_batches(6))
    assert _doubled.calls == 6  # type: ignore[attr-defined]
    base_losses, base_weights = _base(ToyModel, toy_batches(6), _doubled)
    assert losses == base_losses and _same(_weights(model), base_weights)
    assert not _same(base_weights, _base(ToyModel, toy_batches(6))[1])
    if make is TrainPipelineSparseDist:
        assert model.sharded.events[:4] == ["input_dist", "input_dist", "compute", "input_dist"]


@pytest.mark.parametrize("sparse_dist", [True, False])
def test_attach_takes_torchrecs_sparse_dist_keyword(sparse_dist: bool) -> None:
    """After detach, ``attach(model, sparse_dist=...)`` resumes: the batch in line kept its input dist in flight,
    so with either value training goes on like the base pipeline."""
    base_losses, base_weights = _base(ToyModel, toy_batches(7))
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, host_prefetch=0)
    data = toy_batches(7)
    losses = [pipeline.progress(data)[0].item() for _ in range(3)]
    pipeline.detach()
    pipeline.attach(model, sparse_dist=sparse_dist)
    losses += _run(pipeline, data)
    assert losses == base_losses and _same(_weights(model), base_weights)


def test_attach_twice_keeps_the_models_own_forward_for_detach() -> None:
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, host_prefetch=0)
    data = toy_batches(5)
    pipeline.progress(data)
    pipeline.attach()
    pipeline.progress(data)
    pipeline.detach()
    assert "forward" not in model.sharded.__dict__


def test_sparse_data_dist_stage_has_the_data_exhausted_callback() -> None:
    """``start_sparse_data_dist_stage()`` builds the input-dist stage with torchrec's callbacks; the data-exhausted
    one marks the util exhausted once its stage gets no batch (the last 2 batches still train)."""
    base_losses, base_weights = _base(ToyModel, toy_batches(6))
    model = ToyModel()
    optimizer = _sgd(model)
    sdd = SparseDataDistUtil(model)
    stage = sdd.start_sparse_data_dist_stage()
    assert stage.data_exhausted_callback == sdd.data_exhausted_callback
    pipeline = StagedTrainPipeline([PipelineStage("data_copy", lambda b: b), stage])
    exhausted: list[bool] = []
    losses = staged_losses(
        pipeline, model, optimizer, toy_batches(6), lambda b, _: exhausted.append(sdd.data_exhausted)
    )
    assert losses == base_losses and _same(_weights(model), base_weights)
    assert exhausted[0] is False and exhausted[-1] is True


# ------------------------------------------------------------------------------------------------- bad input
def _model() -> ToyModel:
    return ToyModel()


def _sparse(**kwargs: Any) -> Callable[[], Any]:
    return lambda: TrainPipelineSparseDist(_model(), _sgd(_model()), CPU, **kwargs)


def _attach(**kwargs: Any) -> Any:
    pipeline = TrainPipelineSparseDist(_model(), _sgd(_model()), CPU)
    return pipeline.attach(**kwargs)


@pytest.mark.parametrize(("build", "error", "name"), [
    (_sparse(apply_jit=True), NotImplementedError, "apply_jit"),
    (_sparse(apply_jit=1), TypeError, "apply_jit"),
    (_sparse(pipeline_postproc=True), NotImplementedError, "pipeline_postproc"),
    (_sparse(context_type=dict), TypeError, "context_type"),
    (_sparse(custom_model_fwd=3), TypeError, "custom_model_fwd"),
    (lambda: TrainPipelineSparseDist(_model(), _sgd(_model()), CPU, True, 2), TypeError, "apply_jit"),
    (lambda: TrainPipelineBase(_model(), _sgd(_model()), CPU, 2), TypeError, "custom_model_fwd"),
    (lambda: EvalPipelineSparseDist(_model(), None, CPU, apply_jit=True), NotImplementedError, "apply_jit"),
    (lambda: SparseDataDistUtil(_model(), None, True), NotImplementedError, "apply_jit"),
    (lambda: SparseDataDistUtil(_model(), None, prefetch_stream=object()), NotImplementedError, "prefetch_stream"),
    (lambda: SparseDataDistUtil(_model()).start_sparse_data_dist_stage(runnable=3), TypeError, "runnable"),
    (lambda: _attach(sparse_dist=1), TypeError, "sparse_dist"),
    (lambda: _attach(model="model"), TypeError, "model"),
])  # fmt: skip
def test_bad_torchrec_arguments_are_named(build: Callable[[], Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        build()


# ------------------------------------------------------------------------------------ the (loss, output) contract
class _LossOnly(ToyModel):
    def forward(self, batch: Any) -> Any:
        return super().forward(batch)[0]


class _Triple(ToyModel):
    def forward(self, batch: Any) -> Any:
        return (*super().forward(batch), 1)


@pytest.mark.parametrize(("model_type", "got"), [(_LossOnly, "got a Tensor of shape []"),
                                                 (_Triple, "got a tuple of 3 items")])  # fmt: skip
@pytest.mark.parametrize("make", [TrainPipelineBase, TrainPipelineSparseDist, EvalPipelineSparseDist])
def test_a_model_not_returning_loss_and_output_is_named(model_type: type, got: str, make: type) -> None:
    model = model_type()
    with pytest.raises(TypeError, match=r"model\(batch\) must return a pair \(loss, output\)") as raised:
        make(model, _sgd(model), CPU).progress(toy_batches(3))
    assert got in str(raised.value)


def test_a_custom_model_fwd_not_returning_loss_and_output_is_named() -> None:
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, _sgd(model), CPU, custom_model_fwd=lambda b: model(b)[0])
    with pytest.raises(TypeError, match=r"custom_model_fwd\(batch\) must return a pair"):
        pipeline.progress(toy_batches(3))
