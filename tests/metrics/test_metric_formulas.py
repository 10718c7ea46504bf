"""Each metric against its formula written out as a plain loop (tests/metrics/reference.py), after every one of
several weighted updates: the lifetime value over every sample so far, the window value over the most recent batches
that fit in ``window_size`` samples (AUC: exactly the most recent ``window_size`` samples), for both task layouts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tests.metrics.reference import (
    accuracy,
    auc,
    calibration,
    cat_steps,
    ctr,
    logloss,
    mae,
    mse,
    ne,
    r_squared,
    rmse,
    stream,
)
from tritonrec.metrics import (
    AccuracyMetric,
    AUCMetric,
    CalibrationMetric,
    CTRMetric,
    MAEMetric,
    MSEMetric,
    NEMetric,
    RecComputeMode,
    RecTaskInfo,
)
from tritonrec.metrics.rec_metric import RecMetric

TASKS = [RecTaskInfo(name=f"t{t}", label_name=f"l{t}", prediction_name=f"p{t}", weight_name=f"w{t}") for t in range(2)]
# torchrec sums a batch's float32 inputs in float32 before adding it to the float64 state: float32 rounding
RTOL = 2e-6
BATCH, STEPS, WINDOW = 10, 7, 35  # the window holds 3 whole batches (sum metrics) or 35 samples (AUC)

Ref = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], float]
# metric class, its arguments, {reported metric name: reference}
CASES: dict[str, tuple[type[RecMetric], dict, dict[str, Ref]]] = {
    "ne": (NEMetric, {"include_logloss": True}, {"ne": ne, "logloss": logloss}),
    "ctr": (CTRMetric, {}, {"ctr": ctr}),
    "calibration": (CalibrationMetric, {}, {"calibration": calibration}),
    "accuracy": (AccuracyMetric, {"threshold": 0.3}, {"accuracy": lambda p, y, w: accuracy(p, y, w, 0.3)}),
    "mse": (MSEMetric, {"include_r_squared": True}, {"mse": mse, "rmse": rmse, "r_squared": r_squared}),
    "mae": (MAEMetric, {}, {"mae": mae}),
}


def _build(cls: type[RecMetric], mode: RecComputeMode, **kwargs: object) -> RecMetric:
    return cls(world_size=1, my_rank=0, batch_size=BATCH, tasks=TASKS, compute_mode=mode, window_size=WINDOW, **kwargs)


def _task_inputs(step: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    return tuple({task.name: step[f"{role}{t}"] for t, task in enumerate(TASKS)} for role in "plw")  # type: ignore[return-value]


@pytest.mark.parametrize("mode", [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lifetime_and_window_match_the_formula(name: str, mode: RecComputeMode) -> None:
    cls, kwargs, refs = CASES[name]
    metric = _build(cls, mode, **kwargs)
    steps = stream(seed=1, steps=STEPS, batch=BATCH)
    for k in range(1, STEPS + 1):
        predictions, labels, weights = _task_inputs(steps[k - 1])
        metric.update(predictions=predictions, labels=labels, weights=weights)
        out = metric.compute()
        assert len(out) == 2 * len(refs) * len(TASKS)
        for t, task in enumerate(TASKS):
            for scope, seen in (("lifetime", steps[:k]), ("window", steps[max(0, k - WINDOW // BATCH) : k])):
                p, y, w = (cat_steps(seen, f"{role}{t}") for role in "plw")
                for metric_name, ref in refs.items():
                    value = out[f"{name}-{task.name}|{scope}_{metric_name}"]
                    assert value.dtype == torch.float64
                    assert value.item() == pytest.approx(ref(p, y, w), rel=RTOL, abs=1e-12), (scope, metric_name, k)


@pytest.mark.parametrize("mode", [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION])
def test_auc_window_keeps_exactly_the_last_window_size_samples(mode: RecComputeMode) -> None:
    metric = _build(AUCMetric, mode)
    steps = stream(seed=2, steps=STEPS, batch=BATCH)
    for k in range(1, STEPS + 1):
        predictions, labels, weights = _task_inputs(steps[k - 1])
        metric.update(predictions=predictions, labels=labels, weights=weights)
        out = metric.compute()
        assert set(out) == {"auc-t0|window_auc", "auc-t1|window_auc"}  # torchrec reports no lifetime AUC
        for t, task in enumerate(TASKS):
            p, y, w = (cat_steps(steps[:k], f"{role}{t}")[-WINDOW:] for role in "plw")
            assert out[f"auc-{task.name}|window_auc"].item() == pytest.approx(auc(p, y, w), abs=1e-6)


def test_auc_ties_count_one_half_and_degenerate_windows_report_one_half() -> None:
    metric = _build(AUCMetric, RecComputeMode.UNFUSED_TASKS_COMPUTATION)
    p = torch.tensor([0.5, 0.5, 0.5, 0.9, 0.1, 0.9, 0.2, 0.2, 0.5, 0.7])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    metric.update(predictions={"t0": p}, labels={"t0": y}, weights={"t0": w})
    assert metric.compute()["auc-t0|window_auc"].item() == pytest.approx(auc(p, y, w), abs=1e-6)
    assert metric.compute()["auc-t1|window_auc"].item() == 0.5  # no samples yet
    only_positive = torch.ones(BATCH)
    metric.update(predictions={"t1": torch.rand(BATCH)}, labels={"t1": only_positive}, weights=None)
    assert metric.compute()["auc-t1|window_auc"].item() == 0.5


def test_tensor_inputs_and_default_weights_equal_the_dict_form() -> None:
    steps = stream(seed=3, steps=3, batch=BATCH)
    as_dict, as_tensor = (
        _build(NEMetric, RecComputeMode.UNFUSED_TASKS_COMPUTATION),
        _build(NEMetric, RecComputeMode.UNFUSED_TASKS_COMPUTATION),
    )
    for step in steps:
        predictions, labels, _ = _task_inputs(step)
        as_dict.update(predictions=predictions, labels=labels, weights=None)
        as_tensor.update(
            predictions=torch.stack([step["p0"], step["p1"]]),
            labels=torch.stack([step["l0"], step["l1"]]),
            weights=None,
        )
    got, want = as_tensor.compute(), as_dict.compute()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    p, y = cat_steps(steps, "p1"), cat_steps(steps, "l1")
    assert want["ne-t1|lifetime_ne"].item() == pytest.approx(ne(p, y, torch.ones_like(p)), rel=1e-9)


def test_tasks_missing_from_a_batch_are_skipped_and_reset_clears_every_state() -> None:
    metric = _build(CTRMetric, RecComputeMode.UNFUSED_TASKS_COMPUTATION)
    metric.update(predictions={"t0": torch.rand(4)}, labels={"t0": torch.ones(4)}, weights=None)
    out = metric.compute()
    assert out["ctr-t0|lifetime_ctr"].item() == 1.0 and out["ctr-t1|lifetime_ctr"].item() == 0.0
    metric.reset()
    assert all(v.item() == 0.0 for v in metric.compute().values())
    metric.update(predictions={"t0": torch.rand(4)}, labels={"t0": torch.zeros(4)}, weights=None)
    assert metric.compute()["ctr-t0|window_ctr"].item() == 0.0


def test_nan_predictions_propagate_as_in_torchrec() -> None:
    """torchrec does not refuse NaN predictions (checking would cost a device sync per batch); NE reports NaN."""
    metric = _build(NEMetric, RecComputeMode.UNFUSED_TASKS_COMPUTATION)
    p = torch.full((BATCH,), math.nan)
    metric.update(predictions={"t0": p}, labels={"t0": torch.ones(BATCH)}, weights=None)
    assert math.isnan(metric.compute()["ne-t0|lifetime_ne"].item())


def test_non_reporting_rank_gets_nothing_unless_compute_on_all_ranks() -> None:
    quiet = NEMetric(world_size=2, my_rank=1, batch_size=BATCH, tasks=TASKS, window_size=WINDOW)
    loud = NEMetric(
        world_size=2, my_rank=1, batch_size=BATCH, tasks=TASKS, window_size=WINDOW, compute_on_all_ranks=True
    )
    for metric in (quiet, loud):
        metric.update(predictions={"t0": torch.rand(4)}, labels={"t0": torch.ones(4)}, weights=None)
    assert quiet.compute() == {} and quiet.local_compute()
    assert {key.replace("|", "|local_") for key in loud.compute()} == set(quiet.local_compute())


# recorded from torchrec 1.8: NEMetric(include_logloss=True).local_compute() after one update, both task layouts
TORCHREC_NE_LOCAL_KEYS = {
    f"ne-t{t}|local_{scope}_{name}" for t in range(2) for scope in ("lifetime", "window") for name in ("ne", "logloss")
}


@pytest.mark.parametrize("mode", [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION])
@pytest.mark.parametrize("name", [*sorted(CASES), "auc"])
def test_local_compute_keys_carry_torchrecs_local_prefix(name: str, mode: RecComputeMode) -> None:
    """torchrec's local_compute() puts "local_" before the window_ / lifetime_ prefix; compute() has none."""
    cls, kwargs = (AUCMetric, {}) if name == "auc" else CASES[name][:2]
    metric = _build(cls, mode, **kwargs)
    predictions, labels, weights = _task_inputs(stream(seed=5, steps=1, batch=BATCH)[0])
    metric.update(predictions=predictions, labels=labels, weights=weights)
    local, reduced = metric.local_compute(), metric.compute()
    assert set(local) == {key.replace("|", "|local_") for key in reduced}
    for key, value in reduced.items():  # one process: the same values under both keys
        torch.testing.assert_close(local[key.replace("|", "|local_")], value, rtol=0, atol=0, equal_nan=True)
    if name == "ne":
        assert set(local) == TORCHREC_NE_LOCAL_KEYS
