"""TrainPipelineSemiSync in one process (toy sharded module with a plain table the optimizer steps, no process
group): the staleness against a loop written out, TrainPipelineSparseDist before ``start_batch``, the model's own
forward when nothing is pipelined, detach / attach, evaluation, and every bad argument."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.train_pipeline.toy import ComputedInputModel, ToyModel, progress_losses, toy_batches
from tritonrec.data.batch import Batch
from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSemiSync, TrainPipelineSparseDist

CPU = torch.device("cpu")
LR = 1.0


def _train(model: torch.nn.Module, data: Iterator[Batch], **kwargs: Any) -> tuple[list[float], Any]:
    pipeline = TrainPipelineSemiSync(model, torch.optim.SGD(model.parameters(), lr=LR), CPU, **kwargs)
    losses = progress_losses(pipeline, data)
    pipeline.close()
    return losses, pipeline


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _stale_reference(batches: list[Batch], start_batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """ToyModel trained by SGD where batch ``j`` looks up the table as it was after batch ``j - 1``'s step when
    ``j <= start_batch``, after batch ``j - 2``'s otherwise; its gradient steps the current table."""
    model = ToyModel()
    table = model.sharded.weight.detach().clone()
    after = {-1: table.clone()}
    optimizer = torch.optim.SGD(model.linear.parameters(), lr=LR)
    losses = []
    for j, batch in enumerate(batches):
        leaf = (after[j - 1] if j <= start_batch else after[j - 2]).clone().requires_grad_()
        features = batch.sparse_features
        embedded = torch.nn.functional.embedding_bag(
            features.values().long(), leaf, features.offsets()[:-1].long(), mode="sum"
        )
        logits = model.linear(torch.cat([embedded, batch.dense_features], dim=1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        table -= LR * leaf.grad
        after[j] = table.clone()
        losses.append(loss.item())
    weights = _weights(model)
    weights["sharded.weight"] = table
    return losses, weights


@pytest.mark.parametrize("start_batch", [0, 1, 4])
def test_lookups_read_the_table_one_step_behind_from_start_batch(start_batch: int) -> None:
    model = ToyModel()
    losses, pipeline = _train(model, toy_batches(10), start_batch=start_batch)
    want_losses, want = _stale_reference(list(toy_batches(10)), start_batch)
    assert pipeline.pipelined_modules == ["sharded"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    got = _weights(model)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    _, fresh = _stale_reference(list(toy_batches(10)), 10)  # the check can fail: without staleness, other weights
    assert (got["sharded.weight"] - fresh["sharded.weight"]).abs().max() > 1e-3


def test_before_start_batch_it_equals_sparse_dist_bit_for_bit() -> None:
    sparse_model, model = ToyModel(), ToyModel()
    optimizer = torch.optim.SGD(sparse_model.parameters(), lr=LR)
    sparse = progress_losses(TrainPipelineSparseDist(sparse_model, optimizer, CPU), toy_batches(9))
    losses, pipeline = _train(model, toy_batches(9), start_batch=9)
    assert losses == sparse and len(losses) == 9 and not pipeline.is_semi_sync()
    got, want = _weights(model), _weights(sparse_model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_model_with_nothing_pipelined_trains_as_the_base_pipeline() -> None:
    base_model, model = ComputedInputModel(), ComputedInputModel()
    base = progress_losses(TrainPipelineBase(base_model, torch.optim.SGD(base_model.parameters(), lr=LR), CPU),
                           toy_batches(6))  # fmt: skip
    losses, pipeline = _train(model, toy_batches(6), start_batch=0)
    assert pipeline.pipelined_modules == [] and pipeline.fallback_reason is not None
    assert losses == base


def test_detach_and_attach_between_steps_keep_the_training() -> None:
    straight, _ = _train(ToyModel(), toy_batches(8), start_batch=2)
    model = ToyModel()
    pipeline = TrainPipelineSemiSync(model, torch.optim.SGD(model.parameters(), lr=LR), CPU, start_batch=2)
    data = toy_batches(8)
    losses = [pipeline.progress(data)[0].item() for _ in range(4)]
    pipeline.detach()
    with torch.no_grad():  # the model's own forward, outside the pipeline
        model(next(toy_batches(1, start=50)))
    pipeline.attach()
    losses += progress_losses(pipeline, data)
    assert losses == straight


def test_flush_applies_the_stashed_gradients_and_drops_the_batches_in_flight() -> None:
    """What the job calls before a checkpoint it restarts after: the last step's stashed dense gradients are
    stepped now (a checkpoint without them would lose a step's update) and nothing stays in flight."""
    model = ToyModel()
    pipeline = TrainPipelineSemiSync(model, torch.optim.SGD(model.linear.parameters(), lr=LR), CPU, start_batch=0,
                                     stash_gradients=True)  # fmt: skip
    data = toy_batches(8)
    for _ in range(3):
        pipeline.progress(data)
    stashed = {n: g.clone() for n, g in pipeline._gradients.items() if g is not None and n.startswith("linear.")}
    assert stashed.keys() == {"linear.weight", "linear.bias"}
    before = _weights(model)
    pipeline.flush()
    assert not pipeline.batches and not pipeline.contexts and not pipeline._gradients
    after = _weights(model)
    for name, value in after.items():
        want = before[name] - LR * stashed[name] if name in stashed else before[name]
        assert torch.equal(value, want), name
    # going on would skip the dropped batches (it trained 5 + 2 of 10 silently): refused; reset() starts over
    with pytest.raises(RuntimeError, match=r"progress after flush\(\): the batches it had in flight were dropped"):
        pipeline.progress(data)
    pipeline.reset()
    pipeline.progress(toy_batches(2))
    pipeline.close()
    idle = TrainPipelineSemiSync(model, torch.optim.SGD(model.linear.parameters(), lr=LR), CPU, start_batch=0)
    idle.flush()  # nothing in flight, nothing dropped: it trains on
    assert len(progress_losses(idle, toy_batches(3))) == 3
    idle.flush()  # after the data ended: the end stays an end (StopIteration), not an error
    with pytest.raises(StopIteration):
        idle.progress(toy_batches(0))


def test_evaluation_mode_runs_every_batch_and_changes_nothing() -> None:
    model = ToyModel()
    model.eval()
    before = _weights(model)
    losses, _ = _train(model, toy_batches(5), start_batch=0)
    assert len(losses) == 5
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())


def test_an_optimizer_holding_the_pipelined_tables_warns_or_raises_with_strict(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="tritonrec.dist.train_pipeline.semi_sync"):
        _train(ToyModel(), toy_batches(3))
    assert "optimizer holds parameters of pipelined module 'sharded'" in caplog.text
    with pytest.raises(ValueError, match="strict=True"):
        _train(ToyModel(), toy_batches(3), strict=True)
    model = ToyModel()  # the dense parameters only: accepted with strict
    pipeline = TrainPipelineSemiSync(model, torch.optim.SGD(model.linear.parameters(), lr=LR), CPU, strict=True)
    assert len(progress_losses(pipeline, toy_batches(3))) == 3


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"start_batch": -1}, ValueError, "start_batch"),
    ({"start_batch": 2.0}, TypeError, "start_batch"),
    ({"start_batch": True}, TypeError, "start_batch"),
    ({"stash_gradients": 1}, TypeError, "stash_gradients"),
    ({"strict": "no"}, TypeError, "strict"),
    ({"execute_all_batches": None}, TypeError, "execute_all_batches"),
    ({"dmp_collection_sync_interval_batches": 0}, ValueError, "dmp_collection_sync_interval_batches"),
    ({"dmp_collection_sync_interval_batches": "1"}, TypeError, "dmp_collection_sync_interval_batches"),
    ({"apply_jit": True}, NotImplementedError, "apply_jit"),
    ({"pipeline_postproc": True}, NotImplementedError, "pipeline_postproc"),
    ({"enable_inplace_copy_batch": True}, NotImplementedError, "enable_inplace_copy_batch"),
    ({"free_features_storage_early": True}, NotImplementedError, "free_features_storage_early"),
    ({"clear_data_dist_inputs": True}, NotImplementedError, "clear_data_dist_inputs"),
    ({"clear_data_dist_inputs": 0}, TypeError, "clear_data_dist_inputs"),
    ({"custom_model_fwd": 3}, TypeError, "custom_model_fwd"),
    ({"host_prefetch": -1}, ValueError, "host_prefetch"),
])  # fmt: skip
def test_bad_arguments_raise_naming_the_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    model = ToyModel()
    with pytest.raises(error, match=name):
        TrainPipelineSemiSync(model, torch.optim.SGD(model.linear.parameters(), lr=LR), CPU, **kwargs)


@pytest.mark.parametrize(("args", "error", "name"), [
    (("not a model", None, CPU), TypeError, "model"),
    ((ToyModel(), "sgd", CPU), TypeError, "optimizer"),
    ((ToyModel(), None, 0), TypeError, "device"),
])  # fmt: skip
def test_bad_model_optimizer_or_device_raise_naming_it(args: tuple, error: type, name: str) -> None:
    model, optimizer, device = args
    if optimizer is None:
        optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=LR)
    with pytest.raises(error, match=name):
        TrainPipelineSemiSync(model, optimizer, device)


def test_bad_attach_arguments_raise_naming_them() -> None:
    model = ToyModel()
    pipeline = TrainPipelineSemiSync(model, torch.optim.SGD(model.linear.parameters(), lr=LR), CPU)
    with pytest.raises(TypeError, match="model"):
        pipeline.attach("model")
    with pytest.raises(TypeError, match="sparse_dist"):
        pipeline.attach(None, sparse_dist="yes")
