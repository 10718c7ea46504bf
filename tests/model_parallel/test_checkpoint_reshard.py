"""Re-sharding checkpoints of a DLRM under DMP (rank-side code: checkpoint_cases.py): saved by 2 ranks table-wise,
loaded by 4 ranks row-wise and saved again, loaded by 2 ranks column-wise and saved again - the three checkpoints
hold identical unsharded weights, fused and dense optimizer state and data position; training resumed on 4 ranks
matches the uninterrupted single-process reference; an asynchronous save keeps the state of its call; a sharded
checkpoint loads into an unsharded model in one process (and resumes there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model_parallel.checkpoint_cases import (
    GLOBAL_BATCH,
    SAVED_AT,
    DataPosition,
    batch_slice,
    global_batch,
    loss_of,
)
from tests.model_parallel.dlrm_cases import DENSE_LR, SHARDED_PATH, build_dlrm, dense_optimizer, max_diff
from tests.model_parallel.spawned import checkpoint_root, suite_results
from tritonrec.dist.checkpoint import load_checkpoint, load_unsharded_checkpoint

pytestmark = pytest.mark.dist


def _path(name: str) -> Path:
    return Path(checkpoint_root()) / name / f"step_{SAVED_AT:08d}"


def _expected() -> dict[str, Any]:
    suite_results("checkpoint_save", 2)
    return torch.load(Path(checkpoint_root()) / "expected.pt", weights_only=False)  # type: ignore[no-any-return]


def _assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Same structure, bit-identical tensors, equal values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_saved_checkpoint_holds_the_trained_state() -> None:
    expected = _expected()
    saved = load_unsharded_checkpoint(_path("tw2"))
    _assert_identical(saved["model"], expected["at_save"], "model")
    reference = expected["reference_at_save"]
    for name, state in reference["fused"]["state"].items():
        table = name.split(".")[-2]
        got = saved["fused_optimizer"][SHARDED_PATH][table]
        assert max_diff(got["momentum1"], state["momentum1"]) <= 1e-5, table
        assert int(got["step"]) == int(state["step"]) == SAVED_AT
    dense = saved["optimizers"]["dense"]
    for name, state in reference["dense"]["state"].items():
        assert max_diff(dense["state"][name]["momentum_buffer"], state["momentum_buffer"]) <= 1e-5, name
    assert dense["param_groups"][0]["lr"] == DENSE_LR and dense["param_groups"][0]["momentum"] == 0.9
    assert saved["extra"] == {"data": {"position": SAVED_AT}}
    assert saved["fused_hyperparameters"][SHARDED_PATH]["lr"] == 0.1


def test_resharding_round_trips_are_identical() -> None:
    results = suite_results("checkpoint_reshard", 4)
    for rank, got in enumerate(results):
        assert got["step"] == SAVED_AT and got["position"] == SAVED_AT, f"rank {rank}: {got}"
        assert got["saved_plan_has_table_wise"]
    assert results[0]["cw_plan"] == ["column_wise"]
    tw2, rw4, cw2 = (load_unsharded_checkpoint(_path(n)) for n in ("tw2", "rw4", "cw2"))
    _assert_identical(rw4, tw2, "2 ranks TW -> 4 ranks RW")
    _assert_identical(cw2, rw4, "4 ranks RW -> 2 ranks CW")
    # training resumed on 4 ranks from the 2-rank checkpoint continues like the uninterrupted reference
    assert results[0]["after_two_steps"] <= 1e-5


def test_async_save_keeps_the_state_of_its_call() -> None:
    expected = _expected()
    saved = load_unsharded_checkpoint(_path("async2"))
    _assert_identical(saved["model"], expected["at_save"], "async model")
    changed = [k for k, v in expected["trained_on"].items() if not torch.equal(v, expected["at_save"][k])]
    assert changed, "the step after the async save changed nothing: the test cannot tell the states apart"


def test_sharded_checkpoint_loads_into_an_unsharded_model() -> None:
    suite_results("checkpoint_reshard", 4)
    expected = _expected()
    model = build_dlrm(seed=5)
    dense = dense_optimizer(model.named_parameters())
    data = DataPosition()
    loaded = load_checkpoint(_path("cw2"), model, {"dense": dense}, {"data": data})
    assert loaded.step == SAVED_AT and data.position == SAVED_AT
    _assert_identical(dict(model.state_dict()), expected["at_save"], "unsharded model")
    for step in range(SAVED_AT, SAVED_AT + 2):  # resumes like the reference
        dense.zero_grad()
        loss_of(model, *batch_slice(global_batch(step, GLOBAL_BATCH), 0, GLOBAL_BATCH)).backward()
        dense.step()
    for key, value in expected["reference_after"].items():
        assert max_diff(model.state_dict()[key], value) <= 1e-5, key
