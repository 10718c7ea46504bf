"""Train pipelines in one process (toy sharded module, no process group): fx discovery of the sharded modules'
inputs and every reason a module is not pipelined, pipelined == base bit for bit, the logged fallback, detach /
attach, the background batch thread, CUDA streams (gpu marker), and the input checks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.train_pipeline.toy import (
    BranchFirstModel,
    ComputedInputModel,
    ToyModel,
    TwiceModel,
    progress_losses,
    staged_losses,
    toy_batches,
)
from tritonrec.dist.train_pipeline import (
    DataLoadingThread,
    EvalPipelineSparseDist,
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
    trace_sharded_inputs,
)

CPU = torch.device("cpu")


def _train(model: torch.nn.Module, make: Callable[..., Any], data: Iterator[Any], device: torch.device = CPU):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = make(model, optimizer)
    losses = progress_losses(pipeline, data)
    pipeline.close()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, pipeline


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------ tracing
def test_tracing_finds_the_input_path_from_the_batch() -> None:
    traced = trace_sharded_inputs(ToyModel())
    assert list(traced.pipelineable) == ["sharded"] and traced.reasons == {}
    _, call_args = traced.pipelineable["sharded"]
    batch = next(toy_batches(1))
    args, kwargs = call_args.build(batch)
    assert args == [batch.sparse_features] and kwargs == {}
    assert traced.trace_error is not None  # the branch after the lookup stopped tracing, after the call was seen


@pytest.mark.parametrize(("model", "reason"), [
    (ComputedInputModel, "computed inside the model"),
    (TwiceModel, "called 2 times"),
    (BranchFirstModel, "tracing stopped before it is called"),
])  # fmt: skip
def test_tracing_says_why_a_module_is_not_pipelined(model: type, reason: str) -> None:
    traced = trace_sharded_inputs(model())
    assert traced.pipelineable == {}
    assert reason in traced.reasons["sharded"]


# ---------------------------------------------------------------------------------------------------- pipelines
def test_sparse_dist_equals_base_and_prefetches() -> None:
    base_model, model = ToyModel(), ToyModel()
    base_losses, base_weights, _ = _train(base_model, lambda m, o: TrainPipelineBase(m, o, CPU), toy_batches(12))
    losses, weights, pipeline = _train(model, lambda m, o: TrainPipelineSparseDist(m, o, CPU), toy_batches(12))
    assert pipeline.pipelined_modules == ["sharded"] and pipeline.fallback_reason is None
    assert losses == base_losses and len(losses) == 12
    assert _same(weights, base_weights)
    assert base_model.sharded.events[:4] == ["input_dist", "compute", "input_dist", "compute"]
    assert model.sharded.events[:4] == ["input_dist", "input_dist", "compute", "input_dist"]


def test_profiler_ranges_appear_only_while_a_profiler_runs() -> None:
    """The pipeline's ranges (``## forward k ##`` ...) are recorded under torch.profiler, including one started
    mid-run; with no profiler, ``record`` hands back the shared no-op context instead of a record_function."""
    from torch.profiler import ProfilerActivity, profile

    from tritonrec.dist.record import _NO_RANGE, record

    assert record("## idle ##") is _NO_RANGE
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    data = toy_batches(6)
    pipeline.progress(data)  # no profiler yet
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert record("## profiled ##") is not _NO_RANGE
        pipeline.progress(data)
    pipeline.close()
    names = {event.name for event in prof.events()}
    assert {"## forward 1 ##", "## optimizer 1 ##", "## backward ##"} <= names, sorted(names)
    assert "## forward 0 ##" not in names


def test_untraceable_model_falls_back_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    base_losses, base_weights, _ = _train(
        ComputedInputModel(), lambda m, o: TrainPipelineBase(m, o, CPU), toy_batches(6)
    )
    with caplog.at_level(logging.WARNING, logger="tritonrec.dist.train_pipeline.tracing"):
        losses, weights, pipeline = _train(
            ComputedInputModel(), lambda m, o: TrainPipelineSparseDist(m, o, CPU), toy_batches(6)
        )
    assert pipeline.pipelined_modules == []
    assert "computed inside the model" in pipeline.fallback_reason
    assert "falls back to the model's own forward" in caplog.text
    assert losses == base_losses and _same(weights, base_weights)


def test_detach_gives_back_the_forward_and_attach_resumes() -> None:
    base_losses, base_weights, _ = _train(ToyModel(), lambda m, o: TrainPipelineBase(m, o, CPU), toy_batches(8))
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU, host_prefetch=0)
    data = toy_batches(8)
    losses = [pipeline.progress(data)[0].item() for _ in range(3)]
    pipeline.detach()
    assert "forward" not in model.sharded.__dict__ and not model.sharded.is_pipelined
    with torch.no_grad():
        model(next(toy_batches(1, start=100)))  # the model's own forward works in between
    losses += [pipeline.progress(data)[0].item() for _ in range(5)]  # progress re-attaches
    assert model.sharded.is_pipelined
    assert losses == base_losses
    assert _same({n: p.detach() for n, p in model.named_parameters()}, base_weights)


def test_a_forward_outside_the_pipeline_is_refused_not_fed_the_next_batch() -> None:
    """Calling the model between steps without detach() used to consume the next batch's prefetched input dist
    (its lookup ran on the training batch's features) and fail a step later with a misleading error (staged: after
    training 4 batches on their predecessors' features). Now that call raises, naming detach()."""
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, host_prefetch=0)
    data = toy_batches(8)
    for _ in range(3):
        pipeline.progress(data)
    outside = next(toy_batches(1, start=100))
    with pytest.raises(RuntimeError, match=r"called on other features than batch 3's.*pipeline.detach\(\)"):
        model(outside)
    pipeline.progress(data)  # the refused call consumed nothing: training goes on


def test_eval_pipeline_runs_every_batch_without_changing_weights() -> None:
    model = ToyModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipeline = EvalPipelineSparseDist(model, None, CPU)
    data = toy_batches(5)
    logits = []
    while True:
        try:
            logits.append(pipeline.progress(data)[1])
        except StopIteration:
            break
    pipeline.detach()
    with torch.no_grad():
        expected = [model(b)[1][1] for b in toy_batches(5)]
    assert len(logits) == 5 and all(torch.equal(a, b) for a, b in zip(logits, expected, strict=True))
    assert _same(before, {n: p.detach() for n, p in model.named_parameters()})


def test_staged_pipeline_with_a_user_stage_equals_base() -> None:
    def double_dense(batch: Any) -> Any:
        return type(batch)(batch.dense_features * 2, batch.sparse_features, batch.labels, batch.valid_mask)

    base_losses, base_weights, _ = _train(
        ToyModel(), lambda m, o: TrainPipelineBase(m, o, CPU), map(double_dense, toy_batches(7))
    )
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline([
        PipelineStage("data_copy", lambda b: b.to(CPU)),
        PipelineStage("double_dense", double_dense),
        PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sdd_fill_callback),
    ], host_prefetch=2)  # fmt: skip
    losses = staged_losses(pipeline, model, optimizer, toy_batches(7))
    pipeline.close()
    assert sdd.pipelined_modules == ["sharded"]
    assert losses == base_losses
    assert _same({n: p.detach() for n, p in model.named_parameters()}, base_weights)


def test_sparse_data_dist_util_detach_and_attach_mid_run() -> None:
    """Evaluating between steps: detach gives the model its own forward, attach continues the in-flight batches."""
    base_losses, base_weights, _ = _train(ToyModel(), lambda m, o: TrainPipelineBase(m, o, CPU), toy_batches(7))
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline([
        PipelineStage("data_copy", lambda b: b),
        PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sdd_fill_callback),
    ])  # fmt: skip

    def evaluate_after_step_3(batch: Any, losses: list[float]) -> None:
        if len(losses) == 3:
            sdd.detach()
            with torch.no_grad():
                model(next(toy_batches(1, start=50)))
            sdd.attach()

    losses = staged_losses(pipeline, model, optimizer, toy_batches(7), evaluate_after_step_3)
    assert losses == base_losses
    assert _same({n: p.detach() for n, p in model.named_parameters()}, base_weights)


def test_a_failing_stage_raises_its_own_error() -> None:
    def boom(batch: Any) -> Any:
        raise RuntimeError("stage exploded")

    pipeline = StagedTrainPipeline([PipelineStage("copy", lambda b: b), PipelineStage("boom", boom)])
    with pytest.raises(RuntimeError, match="stage exploded"):
        pipeline.progress(toy_batches(5))


def test_a_failing_data_loader_raises_its_own_error() -> None:
    def broken() -> Iterator[Any]:
        yield from toy_batches(2)
        raise OSError("disk gone")

    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    data = broken()
    with pytest.raises(OSError, match="disk gone"):
        for _ in range(5):
            pipeline.progress(data)
    pipeline.close()


@pytest.mark.gpu
def test_cuda_streams_sparse_dist_equals_base() -> None:
    device = torch.device("cuda")
    base_losses, base_weights, _ = _train(
        ToyModel().to(device), lambda m, o: TrainPipelineBase(m, o, device), toy_batches(10)
    )
    losses, weights, pipeline = _train(
        ToyModel().to(device), lambda m, o: TrainPipelineSparseDist(m, o, device), toy_batches(10)
    )
    assert pipeline.pipelined_modules == ["sharded"]
    assert losses == base_losses and _same(weights, base_weights)


# ----------------------------------------------------------------------------------------------- batch thread
def test_data_loading_thread_keeps_order_and_forwards_errors() -> None:
    def numbers() -> Iterator[int]:
        yield from range(5)
        raise KeyError("bad row")

    thread = DataLoadingThread(numbers(), depth=2)
    assert [thread.get() for _ in range(5)] == list(range(5))
    with pytest.raises(KeyError, match="bad row"):
        thread.get()
    assert thread.get() is None
    thread.stop()


def test_data_loading_thread_stops_on_an_endless_iterator() -> None:
    def forever() -> Iterator[int]:
        n = 0
        while True:
            n += 1
            yield n

    thread = DataLoadingThread(forever(), depth=1)
    assert thread.get() == 1
    thread.stop()
    assert not thread._thread.is_alive()


# ------------------------------------------------------------------------------------------------- bad input
def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.parametrize(("build", "error", "name"), [
    (lambda: TrainPipelineSparseDist("model", _sgd(), CPU), TypeError, "model"),
    (lambda: TrainPipelineSparseDist(ToyModel(), "sgd", CPU), TypeError, "optimizer"),
    (lambda: TrainPipelineBase(ToyModel(), _sgd(), 3), TypeError, "device"),
    (lambda: TrainPipelineSparseDist(ToyModel(), _sgd(), CPU, execute_all_batches=1), TypeError,
     "execute_all_batches"),
    (lambda: TrainPipelineSparseDist(ToyModel(), _sgd(), CPU, host_prefetch=-1), ValueError, "host_prefetch"),
    (lambda: StagedTrainPipeline([]), ValueError, "pipeline_stages"),
    (lambda: StagedTrainPipeline([lambda b: b]), TypeError, "PipelineStage"),
    (lambda: StagedTrainPipeline([PipelineStage("a", abs), PipelineStage("a", abs)]), ValueError, "distinct"),
    (lambda: PipelineStage("", abs), ValueError, "name"),
    (lambda: PipelineStage("copy", 3), TypeError, "runnable"),
    (lambda: SparseDataDistUtil("model"), TypeError, "model"),
    (lambda: DataLoadingThread(iter([]), depth=0), ValueError, "depth"),
])  # fmt: skip
def test_bad_arguments_are_named(build: Callable[[], Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        build()


def test_progress_needs_an_iterator_of_batches() -> None:
    model = ToyModel()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, host_prefetch=0)
    with pytest.raises(TypeError, match="dataloader_iter"):
        pipeline.progress(list(toy_batches(2)))
    with pytest.raises(TypeError, match="batch"):
        TrainPipelineBase(model, _sgd(), CPU).progress(iter([object()]))
