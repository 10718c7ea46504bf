"""StagedTrainPipeline in one process, on what the other suites do not reach: one agreement per step once filled,
a failing stage losing only its own batch (the step's later stages still run on theirs) before the step raises,
and a flush that trains every batch once, in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.train_pipeline.toy import ToyModel, progress_losses, staged_losses, toy_batches
from tritonrec.dist.train_pipeline import PipelineStage, SparseDataDistUtil, StagedTrainPipeline, TrainPipelineBase
from tritonrec.dist.train_pipeline.agreement import Status, StepAgreement

CPU = torch.device("cpu")


def _recorder(name: str, seen: dict[str, list[int]], fail_on: int | None = None):
    def run(batch: int) -> int:
        if batch == fail_on:
            raise RuntimeError(f"{name} failed on batch {batch}")
        seen.setdefault(name, []).append(batch)
        return batch

    return run


def test_one_agreement_per_step_once_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = StepAgreement.start
    monkeypatch.setattr(StepAgreement, "start", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    seen: dict[str, list[int]] = {}
    pipeline = StagedTrainPipeline([PipelineStage(n, _recorder(n, seen)) for n in ("copy", "process", "dist")])
    data = iter(range(8))
    per_call = []
    while True:
        before = len(calls)
        batch = pipeline.progress(data)
        per_call.append(len(calls) - before)
        if batch is None:
            break
    # the first call fills (an agreement after each of the 3 + 2 + 1 stage runs, one per batch read: 3, and the
    # read-ahead), then runs its step (1); every later call is one step: one agreement (none in the call that finds
    # the pipeline drained)
    assert per_call == [6 + 3 + 1 + 1] + [1] * 7 + [0]
    assert seen == {name: list(range(8)) for name in ("copy", "process", "dist")}


def test_a_failing_stage_loses_its_batch_and_the_step_raises_after_its_other_stages() -> None:
    seen: dict[str, list[int]] = {}
    pipeline = StagedTrainPipeline([
        PipelineStage("copy", _recorder("copy", seen)),
        PipelineStage("process", _recorder("process", seen, fail_on=3)),
        PipelineStage("dist", _recorder("dist", seen)),
    ])  # fmt: skip
    data = iter(range(8))
    assert pipeline.progress(data) == 0
    with pytest.raises(RuntimeError, match="process failed on batch 3") as raised:
        pipeline.progress(data)
    # in the failing step, "dist" still ran on batch 2 (its collectives pair with the other ranks'), never on 3
    assert seen["dist"] == [0, 1, 2] and seen["process"] == [0, 1, 2] and seen["copy"] == [0, 1, 2, 3, 4]
    assert not getattr(raised.value, "__notes__", None)


def test_a_second_failure_in_the_same_step_is_a_note_on_the_first() -> None:
    seen: dict[str, list[int]] = {}
    pipeline = StagedTrainPipeline([
        PipelineStage("copy", _recorder("copy", seen)),
        PipelineStage("process", _recorder("process", seen, fail_on=3)),
        PipelineStage("dist", _recorder("dist", seen, fail_on=2)),
    ])  # fmt: skip
    data = iter(range(8))
    pipeline.progress(data)
    with pytest.raises(RuntimeError, match="process failed on batch 3") as raised:
        pipeline.progress(data)
    assert raised.value.__notes__ == ["then stage 'dist' failed too: RuntimeError: dist failed on batch 2"]


def test_a_flush_trains_every_batch_once_in_order() -> None:
    optimizer_of = lambda model: torch.optim.SGD(model.parameters(), lr=0.1)
    base_model = ToyModel()
    base = TrainPipelineBase(base_model, optimizer_of(base_model), CPU)
    base_losses = progress_losses(base, toy_batches(9))
    model = ToyModel()
    optimizer = optimizer_of(model)
    sdd = SparseDataDistUtil(model)
    flushes: list[int] = []
    steps: list[int] = []  # steps done, read by the flush callback (which runs inside progress)
    pipeline = StagedTrainPipeline([
        PipelineStage("data_copy", lambda b: b),
        PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sdd_fill_callback),
    ], on_flush_end=lambda: flushes.append(len(steps)), host_prefetch=1)  # fmt: skip

    def after_step(batch: Any, losses: list[float]) -> None:
        steps.append(len(losses))
        if len(losses) == 3:
            pipeline.set_flush(True)

    losses = staged_losses(pipeline, model, optimizer, toy_batches(9), after_step)
    pipeline.close()
    # the batches in flight at the request (two in the stages, one read ahead) trained before the refill
    assert flushes == [6]
    assert losses == base_losses and len(losses) == 9
    assert torch.equal(model.sharded.weight, base_model.sharded.weight)


def _tagger(name: str, seen: dict[str, list[int]], none_on: int | None = None):
    """Stage ``name``: records the batch, returns None for ``none_on``, else the batch with ``name`` appended."""

    def run(batch: Any) -> Any:
        key = batch if isinstance(batch, int) else batch[0]
        seen.setdefault(name, []).append(key)
        if key == none_on:
            return None
        return (key, *(() if isinstance(batch, int) else batch[1:]), name)

    return run


def test_a_batch_a_stage_returns_none_for_is_skipped_and_every_later_batch_gets_every_stage() -> None:
    seen: dict[str, list[int]] = {}
    pipeline = StagedTrainPipeline([
        PipelineStage("a", _tagger("a", seen)),
        PipelineStage("b", _tagger("b", seen, none_on=3)),
        PipelineStage("c", _tagger("c", seen)),
    ])  # fmt: skip
    data = iter(range(8))
    outs = [pipeline.progress(data) for _ in range(9)]
    # progress returned None at batch 3 (ending a `while` loop early) and then batch 4 without stage c
    assert outs == [(k, "a", "b", "c") for k in (0, 1, 2, 4, 5, 6, 7)] + [None, None]
    assert seen == {"a": list(range(8)), "b": list(range(8)), "c": [0, 1, 2, 4, 5, 6, 7]}


def test_a_dropped_batch_is_not_the_end_of_the_data_for_later_stages() -> None:
    """Stage c's data_exhausted_callback runs only once the data is over, not at the hole batch 3 leaves."""
    exhausted: list[int] = []
    outs: list[Any] = []
    pipeline = StagedTrainPipeline([
        PipelineStage("a", _tagger("a", {})),
        PipelineStage("b", _tagger("b", {}, none_on=3)),
        PipelineStage("c", _tagger("c", {}), data_exhausted_callback=lambda: exhausted.append(len(outs))),
    ])  # fmt: skip
    data = iter(range(8))
    while (out := pipeline.progress(data)) is not None:
        outs.append(out)
    assert [o[0] for o in outs] == [0, 1, 2, 4, 5, 6, 7]
    assert exhausted and min(exhausted) == 6, exhausted  # from the step that returns batch 6: no batch 8 to run


def test_a_cancelled_flush_leaves_no_batch_short_of_a_stage() -> None:
    seen: dict[str, list[int]] = {}
    pipeline = StagedTrainPipeline([PipelineStage(n, _tagger(n, seen)) for n in "abc"])
    data, outs = iter(range(10)), []
    for call in range(12):
        outs.append(pipeline.progress(data))
        pipeline.set_flush(call == 1)  # requested after the second batch, cancelled after the third
    assert outs == [(k, "a", "b", "c") for k in range(10)] + [None, None]


def test_a_new_iterator_after_the_end_refills_the_pipeline() -> None:
    pipeline = StagedTrainPipeline([PipelineStage("a", lambda b: b), PipelineStage("b", lambda b: b)])
    first = iter(range(3))
    assert [pipeline.progress(first) for _ in range(5)] == [0, 1, 2, None, None]
    second = iter(range(10, 13))  # the same iterator gives None, another one trains on (it read nothing before)
    assert [pipeline.progress(second) for _ in range(5)] == [10, 11, 12, None, None]


def test_a_skipped_batch_leaves_the_input_dists_in_step_with_the_forwards() -> None:
    """The input-dist stage after a stage that drops batch 3: the forward of batch 4 finds its input dist (its split
    round was not finished by batch 2's forward hook, as batch 3 started none) and training equals the base
    pipeline on the other batches."""
    losses, base_losses, weights_equal = _train_with_a_drop(3, after_start=False, by_hand=False)
    assert losses == base_losses and len(losses) == 7
    assert weights_equal


def test_staged_arguments_are_checked_and_tritonrec_ones_keyword_only() -> None:
    stages = [PipelineStage("a", lambda b: b)]
    with pytest.raises(TypeError, match="debug_mode must be a bool, got debug_mode='yes'"):
        StagedTrainPipeline(stages, debug_mode="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_flush_end must be a callable or None, got on_flush_end=3"):
        StagedTrainPipeline(stages, on_flush_end=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positional"):
        StagedTrainPipeline(stages, False, None, None, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="flush must be a bool, got flush=1"):
        StagedTrainPipeline(stages).set_flush(1)  # type: ignore[arg-type]


def test_the_agreement_carries_each_ranks_drops_in_its_one_tensor() -> None:
    pending = StepAgreement(None, ["next_batch"], slots=3).start(Status.OK, dropped=[2, 0])
    assert pending.result() is True and pending.dropped() == [0, 2]
    with pytest.raises(ValueError, match=r"dropped must hold slots in \[0, 3\), got 3"):
        StepAgreement(None, slots=3).start(Status.OK, dropped=[3])
    with pytest.raises(ValueError, match="slots must be a non-negative int, got slots=-1"):
        StepAgreement(None, slots=-1)


def test_drops_cost_no_extra_agreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped batch still takes its steps (as a hole), each with its one agreement: the same count as without."""
    calls = []
    original = StepAgreement.start
    monkeypatch.setattr(StepAgreement, "start", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    counts = []
    for none_on in (None, 3):
        calls.clear()
        seen: dict[str, list[int]] = {}
        pipeline = StagedTrainPipeline([
            PipelineStage("a", _tagger("a", seen)),
            PipelineStage("b", _tagger("b", seen, none_on=none_on)),
            PipelineStage("c", _tagger("c", seen)),
        ])  # fmt: skip
        data = iter(range(8))
        while pipeline.progress(data) is not None:
            pass
        counts.append(len(calls))
    assert counts[0] == counts[1]


def _train_with_a_drop(drop_at: int, after_start: bool, by_hand: bool) -> tuple[list[float], list[float], bool]:
    """ToyModel through copy, the input dist and a stage that drops batch ``drop_at``, before the input dist or
    (``after_start``) after it started: the losses, the base pipeline's on the other batches, and whether the
    weights are equal. ``by_hand``: the input-dist stage built from the util's method, not its stage helper."""
    optimizer_of = lambda model: torch.optim.SGD(model.parameters(), lr=0.1)
    base_model = ToyModel()
    base = TrainPipelineBase(base_model, optimizer_of(base_model), CPU)
    base_losses = progress_losses(base, (b for k, b in enumerate(toy_batches(8)) if k != drop_at))
    model = ToyModel()
    optimizer = optimizer_of(model)
    sdd = SparseDataDistUtil(model)
    start = sdd.start_sparse_data_dist_stage()
    if by_hand:  # the util's method in a stage built by hand gets the util's drop callback too
        start = PipelineStage(
            "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sdd_fill_callback
        )
    calls = iter(range(100))
    drop = PipelineStage("drop", lambda b: None if next(calls) == drop_at else b)
    stages = [start, drop] if after_start else [drop, start]
    pipeline = StagedTrainPipeline([PipelineStage("data_copy", lambda b: b), *stages])
    losses = staged_losses(pipeline, model, optimizer, toy_batches(8))
    return losses, base_losses, torch.equal(model.sharded.weight, base_model.sharded.weight)


@pytest.mark.parametrize("by_hand", [False, True])
@pytest.mark.parametrize("drop_at", [0, 3, 7])
def test_a_batch_dropped_after_its_input_dist_started_leaves_the_next_batch_its_own(
    drop_at: int, by_hand: bool
) -> None:
    """Batch 0 is dropped while filling, 3 in a step, 7 the last. Before the drop callback, the dropped batch's
    context stayed queued and the next forward consumed it: batch 4 trained on batch 3's sparse features."""
    losses, base_losses, weights_equal = _train_with_a_drop(drop_at, after_start=True, by_hand=by_hand)
    assert losses == base_losses and len(losses) == 7
    assert weights_equal


def test_a_forward_outside_the_staged_pipeline_is_refused_not_fed_the_next_batch() -> None:
    """SparseDataDistUtil's hook points the model at the next batch's prefetched input after each forward: a call
    between steps used to consume it (then four batches trained on their predecessors' features before a step
    failed). Now it raises, naming detach(); after sdd.detach() the call runs and training resumes as before."""
    base = staged_losses_with(None)
    with pytest.raises(RuntimeError, match=r"called on other features than batch \d+'s.*detach\(\)"):
        staged_losses_with("call")
    assert staged_losses_with("detach") == base


def staged_losses_with(outside: str | None) -> list[float]:
    """A 2-stage pipeline (copy, input dist) on 8 toy batches; after the 3rd step the model runs on another batch:
    ``"call"`` as is, ``"detach"`` between the util's detach() and attach()."""
    torch.manual_seed(0)
    model = ToyModel()
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline([PipelineStage("copy", lambda b: b), sdd.start_sparse_data_dist_stage()])

    def run_outside(batch: Any, losses: list[float]) -> None:
        if outside is None or len(losses) != 3:
            return
        if outside == "detach":
            sdd.detach()
        with torch.no_grad():
            model(next(toy_batches(1, start=100)))
        if outside == "detach":
            sdd.attach()

    return staged_losses(pipeline, model, torch.optim.SGD(model.parameters(), lr=0.1), toy_batches(8), run_outside)
