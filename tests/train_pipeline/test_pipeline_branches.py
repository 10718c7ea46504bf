"""Sharded modules around a data-dependent branch, where the fx trace stops (one process, toy sharded module): a
module called before the branch is pipelined only when every way through the branches calls it exactly once; one
called again after the branch runs its own forward, with the reason (naming it and where tracing stopped) logged,
and the pipelines (TrainPipelineSparseDist, StagedTrainPipeline) equal TrainPipelineBase bit for bit either way."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.train_pipeline.toy import (
    DENSE,
    DIM,
    ToyModel,
    ToySharded,
    _loss,
    progress_losses,
    staged_losses,
    toy_batches,
)
from tritonrec.data.batch import Batch
from tritonrec.dist.train_pipeline import (
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
    trace_sharded_inputs,
)
from tritonrec.dist.train_pipeline.tracing import MAX_BRANCH_PATHS

CPU = torch.device("cpu")
STEPS = 8
TRACE_STOP = "TraceError: symbolically traced variables cannot be used as inputs to control flow"


class CallAfterBranch(ToyModel):
    """The QA repro: the lookup before a data-dependent branch, and again inside it."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if batch.labels.sum() > 0:  # data-dependent: fx tracing stops here
            emb = emb + self.sharded(batch.sparse_features)
        return _loss(emb, batch, self.linear)


class CallInElseBranch(ToyModel):
    """Called again only on the branch's second way (and after a second branch)."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if batch.labels.sum() > 100:  # never true on the toy data: the base run never calls it twice
            emb = emb * 2
        elif batch.dense_features.sum() > 1e9:
            emb = emb + self.sharded(batch.sparse_features)
        return _loss(emb, batch, self.linear)


class OnceAcrossBranches(ToyModel):
    """Called once, then two data-dependent branches that do not call it: provably once, so pipelined."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if batch.labels.sum() > 0:
            emb = emb * 2
        if batch.dense_features.sum() > 0:
            emb = emb + 1
        return _loss(emb, batch, self.linear)


class OneOfTwoAfterBranch(ToyModel):
    """Two sharded modules before a branch; only ``other`` is called again inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.other = ToySharded()
        self.linear = nn.Linear(2 * DIM + DENSE, 1)

    def forward(self, batch: Batch) -> tuple:
        features = batch.sparse_features
        first, second = self.sharded(features), self.other(features)
        if batch.labels.sum() > 0:
            second = second + self.other(features)
        return _loss(torch.cat([first, second], 1), batch, self.linear)


class UntraceableAfterBranch(ToyModel):
    """Past the branch, code fx cannot follow (iterating a tensor): whether it calls the module again is unknown."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if batch.labels.sum() > 0:
            for _ in batch.labels:
                pass
        return _loss(emb, batch, self.linear)


class LoopOnAValue(ToyModel):
    """A loop on a tensor's value after the call: more ways through it than are traced."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        while emb.abs().sum() > 1e9:
            emb = emb / 2
        return _loss(emb, batch, self.linear)


class LoopUntilAValue(ToyModel):
    """A loop that, its condition taken False every time, never ends: one way has more branches than are traced."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        while not emb.abs().sum() < 1e9:
            emb = emb / 2
        return _loss(emb, batch, self.linear)


class AssertAfterTheLookup(ToyModel):
    """A check on the data after the lookup: the way on which it fails ends the forward there (QA wave 2: any
    exception on a re-traced way made the module unprovable, and such models stopped being pipelined)."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        assert batch.labels.sum() >= 0, "labels must be non-negative"
        return _loss(emb, batch, self.linear)


class RaiseAfterTheLookup(ToyModel):
    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if not torch.isfinite(emb).all():
            raise ValueError("non-finite embedding")
        return _loss(emb, batch, self.linear)


class NoisyAfterBranch(ToyModel):
    """Draws random numbers in its forward, past a data-dependent branch: every trace ran that draw too, so the
    pipelined run trained on other numbers than the plain one."""

    def forward(self, batch: Batch) -> tuple:
        emb = self.sharded(batch.sparse_features)
        if batch.labels.sum() > 0:
            emb = emb + torch.rand(DIM) * 0.01  # a fixed shape: drawn for real while tracing
        return _loss(emb + torch.rand(DIM) * 0.01, batch, self.linear)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _base(model_type: type) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = model_type()
    pipeline = TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    losses = progress_losses(pipeline, toy_batches(STEPS))
    pipeline.close()
    return losses, _weights(model)


def _sparse_dist(model_type: type) -> tuple[list[float], dict[str, torch.Tensor], list[str], str | None]:
    model = model_type()
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    losses = progress_losses(pipeline, toy_batches(STEPS))
    pipeline.close()
    return losses, _weights(model), pipeline.pipelined_modules, pipeline.fallback_reason


def _staged(model_type: type) -> tuple[list[float], dict[str, torch.Tensor], list[str], str | None]:
    model = model_type()
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline([PipelineStage("copy", lambda b: b), sdd.start_sparse_data_dist_stage()])
    losses = staged_losses(pipeline, model, torch.optim.SGD(model.parameters(), lr=0.1), toy_batches(STEPS))
    pipeline.close()
    return losses, _weights(model), sdd.pipelined_modules, sdd.fallback_reason


PIPELINES: dict[str, Callable[[type], Any]] = {"sparse_dist": _sparse_dist, "staged": _staged}


# ------------------------------------------------------------------------------------------------------ tracing
@pytest.mark.parametrize("model_type", [CallAfterBranch, CallInElseBranch])
def test_a_module_called_again_past_the_branch_is_not_pipelined(model_type: type) -> None:
    traced = trace_sharded_inputs(model_type())
    assert traced.pipelineable == {} and traced.trace_error is not None
    reason = traced.reasons["sharded"]
    assert "tracing stopped after its call" in reason and TRACE_STOP in reason and "calls it 2 times" in reason


def test_a_module_called_once_on_every_way_stays_pipelined() -> None:
    traced = trace_sharded_inputs(OnceAcrossBranches())
    assert traced.trace_error is not None and list(traced.pipelineable) == ["sharded"] and traced.reasons == {}


def test_only_the_module_called_again_falls_back() -> None:
    traced = trace_sharded_inputs(OneOfTwoAfterBranch())
    assert list(traced.pipelineable) == ["sharded"]
    assert list(traced.reasons) == ["other"] and "calls it 2 times" in traced.reasons["other"]


@pytest.mark.parametrize(("model_type", "why"), [
    (UntraceableAfterBranch, "does not trace (branches taken: T; TraceError: Proxy object cannot be iterated"),
    (LoopOnAValue, f"more than {MAX_BRANCH_PATHS} ways through its data-dependent branches"),
    (LoopUntilAValue, "RuntimeError: more than 64 data-dependent branches on one way through the forward"),
])  # fmt: skip
def test_a_call_count_that_cannot_be_proven_falls_back(model_type: type, why: str) -> None:
    traced = trace_sharded_inputs(model_type())
    assert traced.pipelineable == {}
    reason = traced.reasons["sharded"]
    assert "tracing stopped after its call" in reason and "cannot be proven" in reason and why in reason, reason


# ---------------------------------------------------------------------------------------------------- pipelines
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("model_type", [CallAfterBranch, CallInElseBranch, UntraceableAfterBranch])
def test_the_pipelines_fall_back_and_equal_base(
    pipeline: str, model_type: type, caplog: pytest.LogCaptureFixture
) -> None:
    base_losses, base_weights = _base(model_type)
    with caplog.at_level(logging.WARNING, logger="tritonrec.dist.train_pipeline.tracing"):
        losses, weights, pipelined, fallback = PIPELINES[pipeline](model_type)
    assert pipelined == [] and fallback is not None
    assert "sharded: tracing stopped after its call" in fallback and "TraceError" in fallback
    assert "sharded module 'sharded' runs unpipelined: tracing stopped after its call" in caplog.text
    assert "falls back to the model's own forward" in caplog.text
    assert len(losses) == STEPS and losses == base_losses and _same(weights, base_weights)


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize(("model_type", "expected"), [
    (OnceAcrossBranches, ["sharded"]),
    (OneOfTwoAfterBranch, ["sharded"]),
    (AssertAfterTheLookup, ["sharded"]),
    (RaiseAfterTheLookup, ["sharded"]),
])  # fmt: skip
def test_the_provably_fine_modules_stay_pipelined_and_equal_base(
    pipeline: str, model_type: type, expected: list[str]
) -> None:
    base_losses, base_weights = _base(model_type)
    losses, weights, pipelined, fallback = PIPELINES[pipeline](model_type)
    assert pipelined == expected and fallback is None
    assert len(losses) == STEPS and losses == base_losses and _same(weights, base_weights)


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_tracing_leaves_the_random_state_alone(pipeline: str) -> None:
    torch.manual_seed(5)
    base_losses, base_weights = _base(NoisyAfterBranch)
    torch.manual_seed(5)
    losses, weights, pipelined, _ = PIPELINES[pipeline](NoisyAfterBranch)
    assert pipelined == ["sharded"]
    assert len(losses) == STEPS and losses == base_losses and _same(weights, base_weights)
