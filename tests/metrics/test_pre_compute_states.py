"""torchrec's pre-compute states API and sync()/unsync() in one process (the 2-rank cases live in
test_metrics_dist.py): the states written out as sums over the stream, the load round trip, AUC's kept samples after
a load, and every refused input naming its argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.metrics.reference import auc, cat_steps, ctr, ne, stream
from tritonrec.metrics import (
    MetricsConfig,
    RecComputeMode,
    RecMetricDef,
    RecMetricEnum,
    RecMetricException,
    RecMetricModule,
    RecTaskInfo,
    ThroughputDef,
    generate_metric_module,
)

TASKS = [RecTaskInfo(name=f"t{t}", label_name=f"l{t}", prediction_name=f"p{t}", weight_name=f"w{t}") for t in range(2)]
BATCH, WINDOW, STEPS = 4, 12, 5  # the window holds the last 3 batches
MODES = [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION]


UNFUSED = RecComputeMode.UNFUSED_TASKS_COMPUTATION


def _module(mode: RecComputeMode = UNFUSED, throughput: bool = False) -> RecMetricModule:
    cfg = MetricsConfig(
        rec_tasks=TASKS,
        rec_metrics={
            m: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW)
            for m in (RecMetricEnum.NE, RecMetricEnum.CTR, RecMetricEnum.AUC)
        },
        rec_compute_mode=mode,
        throughput_metric=ThroughputDef(window_size=10, warmup_steps=2) if throughput else None,
    )
    return generate_metric_module(RecMetricModule, cfg, BATCH, 1, 0, {}, torch.device("cpu"))


def _fed(mode: RecComputeMode, throughput: bool = False) -> tuple[RecMetricModule, list[dict[str, torch.Tensor]]]:
    steps = stream(seed=11, steps=STEPS, batch=BATCH)
    module = _module(mode, throughput)
    for step in steps:
        module.update(step)
    return module, steps


def _task(states: dict, namespace: str, t: int, mode: RecComputeMode) -> tuple[dict, int]:
    """A task's state dict and its row: fused computations hold every task's row under the first task's name."""
    if mode == RecComputeMode.FUSED_TASKS_COMPUTATION:
        return states[namespace]["t0"], t
    return states[namespace][f"t{t}"], 0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pre_compute_states_are_the_streams_sums(mode: RecComputeMode) -> None:
    module, steps = _fed(mode)
    states = module.get_pre_compute_states()
    assert set(states) == {"ne", "ctr", "auc"}
    expected_tasks = {"t0"} if mode == RecComputeMode.FUSED_TASKS_COMPUTATION else {"t0", "t1"}
    assert all(set(per_task) == expected_tasks for per_task in states.values())
    for t in range(2):
        p, y, w = (cat_steps(steps, f"{role}{t}").double() for role in "plw")
        window = slice(-WINDOW, None)
        ctr_states, row = _task(states, "ctr", t, mode)
        # CTR's states written out: sum(w * y) and sum(w), lifetime and over the window's last 12 samples
        assert float(ctr_states["ctr_num"][row]) == pytest.approx(float((w * y).sum()), rel=1e-6)
        assert float(ctr_states["ctr_denom"][row]) == pytest.approx(float(w.sum()), rel=1e-6)
        assert float(ctr_states["window_ctr_num"][row]) == pytest.approx(float((w * y)[window].sum()), rel=1e-6)
        ne_states, row = _task(states, "ne", t, mode)
        assert set(ne_states) == {
            f"{prefix}{name}"
            for prefix in ("", "window_")
            for name in ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")
        }
        assert float(ne_states["pos_labels"][row]) == pytest.approx(float((w * y).sum()), rel=1e-6)
        assert float(ne_states["neg_labels"][row]) == pytest.approx(float((w * (1 - y)).sum()), rel=1e-6)
        auc_states, row = _task(states, "auc", t, mode)
        for name, values in (("predictions", p), ("labels", y), ("weights", w)):
            assert len(auc_states[name]) == 1  # one tensor [n_tasks, kept samples], as torchrec's reduction gives
            assert torch.equal(auc_states[name][0][row].double(), values[window])


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_loaded_states_report_the_formulas_over_the_stream(mode: RecComputeMode) -> None:
    module, steps = _fed(mode, throughput=True)
    states = module.get_pre_compute_states()
    loaded = _module(mode, throughput=True)
    loaded.load_pre_compute_states(states)
    out = loaded.local_compute()
    for t in range(2):
        p, y, w = (cat_steps(steps, f"{role}{t}") for role in "plw")
        wp, wy, ww = p[-WINDOW:], y[-WINDOW:], w[-WINDOW:]
        assert out[f"ne-t{t}|local_lifetime_ne"].item() == pytest.approx(ne(p, y, w), rel=2e-6)
        assert out[f"ctr-t{t}|local_window_ctr"].item() == pytest.approx(ctr(wp, wy, ww), rel=2e-6)
        assert out[f"auc-t{t}|local_window_auc"].item() == pytest.approx(auc(wp, wy, ww), abs=1e-6)
    assert int(loaded.throughput_metric.total_examples) == STEPS * BATCH
    # copies: updating the loaded module leaves the source states as they were
    before = states["ctr"]["t0"]["ctr_denom"].clone()
    loaded.update(steps[0])
    assert torch.equal(states["ctr"]["t0"]["ctr_denom"], before)


def test_loaded_auc_samples_stay_in_the_window_after_an_update() -> None:
    # torchrec 1.8 drops the loaded samples at the next update (its sample counter restarts at 0); ours keeps them
    # and trims the window to its last WINDOW samples as usual
    module, steps = _fed(RecComputeMode.UNFUSED_TASKS_COMPUTATION)
    loaded = _module()
    loaded.load_pre_compute_states(module.get_pre_compute_states())
    extra = stream(seed=12, steps=1, batch=BATCH)[0]
    loaded.update(extra)
    p, y, w = (cat_steps([*steps, extra], f"{role}0")[-WINDOW:] for role in "plw")
    assert loaded.local_compute()["auc-t0|local_window_auc"].item() == pytest.approx(auc(p, y, w), abs=1e-6)


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "used"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_loaded_window_sums_leave_the_window_at_the_next_update(mode: RecComputeMode, used: bool) -> None:
    # torchrec 1.8 never evicts a loaded window sum (its per-batch buffer does not hold it): the window then covers
    # the loaded rows plus WINDOW new ones forever; and loading into a used module later subtracted batches the
    # loaded sum never held. A sum cannot be split back into batches, so the next update replaces it whole
    module, steps = _fed(mode)
    loaded = _module(mode)
    if used:
        for step in stream(seed=13, steps=STEPS, batch=BATCH):
            loaded.update(step)
    loaded.load_pre_compute_states(module.get_pre_compute_states())
    assert loaded.local_compute()["ctr-t1|local_window_ctr"] == module.local_compute()["ctr-t1|local_window_ctr"]
    extra = stream(seed=12, steps=WINDOW // BATCH - 1, batch=BATCH)
    for step in extra:
        loaded.update(step)
    out = loaded.local_compute()
    for t in range(2):
        p, y, w = (cat_steps(extra, f"{role}{t}") for role in "plw")  # the window: the new batches only
        assert out[f"ctr-t{t}|local_window_ctr"].item() == pytest.approx(ctr(p, y, w), rel=2e-6)
        assert out[f"ne-t{t}|local_window_ne"].item() == pytest.approx(ne(p, y, w), rel=2e-6)
        p, y, w = (cat_steps([*steps, *extra], f"{role}{t}") for role in "plw")  # the lifetime: loaded + new
        assert out[f"ctr-t{t}|local_lifetime_ctr"].item() == pytest.approx(ctr(p, y, w), rel=2e-6)


def test_sync_without_torch_distributed_is_a_no_op() -> None:
    module, _ = _fed(RecComputeMode.FUSED_TASKS_COMPUTATION)
    before = module.local_compute()
    module.sync()
    module.sync()  # torchmetrics': nothing was synced, so nothing to refuse
    module.unsync()
    after = module.local_compute()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_async_compute_is_refused_as_in_torchrec() -> None:
    with pytest.raises(RecMetricException, match="async_compute is not supported"):
        _module().async_compute()


def _states() -> dict:
    return _fed(RecComputeMode.UNFUSED_TASKS_COMPUTATION)[0].get_pre_compute_states()


def _drop_namespace(states: dict) -> dict:
    del states["ctr"]
    return states


def _drop_task(states: dict) -> dict:
    del states["ne"]["t1"]
    return states


def _rename_state(states: dict) -> dict:
    states["ne"]["t0"]["entropy"] = states["ne"]["t0"].pop("pos_labels")
    return states


def _reshape_state(states: dict) -> dict:
    states["ctr"]["t0"]["ctr_num"] = torch.zeros(3, dtype=torch.double)
    return states


def _tensor_for_list(states: dict) -> dict:
    states["auc"]["t0"]["labels"] = torch.zeros(1, 4)
    return states


@pytest.mark.parametrize(
    ("edit", "error", "names"),
    [
        (lambda s: [s], TypeError, "source must be"),
        (_drop_namespace, KeyError, "namespace 'ctr'"),
        (_drop_task, KeyError, "task 't1'"),
        (_rename_state, ValueError, "no state 'entropy'"),
        (_reshape_state, ValueError, r"states\['ctr_num'\] must be a tensor of shape \(1,\), got \(3,\)"),
        (_tensor_for_list, ValueError, r"states\['labels'\] must be a list of tensors \[n_tasks=1, n\]"),
    ],
    ids=["not-a-dict", "namespace", "task", "state-name", "state-shape", "list-state"],
)
def test_bad_source_is_refused_naming_what_is_wrong(
    edit: Callable[[dict], object], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        _module().load_pre_compute_states(edit(_states()))


def test_bad_process_group_is_refused() -> None:
    with pytest.raises(TypeError, match="pg must be a ProcessGroup, a DeviceMesh or None, got int"):
        _module().get_pre_compute_states(pg=3)  # type: ignore[arg-type]


def test_nan_auc_predictions_are_refused_by_position() -> None:
    """A NaN has no place in the sorted curve (torchrec's value then depends on its sort): refused, naming where."""
    from tritonrec.metrics import AUCMetric

    metric = AUCMetric(world_size=1, my_rank=0, batch_size=4, tasks=TASKS[:1], window_size=12)
    labels, weights = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4)
    with pytest.raises(ValueError, match=r"NaN at predictions\[0, 2\]"):
        metric.update(predictions=torch.tensor([0.1, 0.2, float("nan"), 0.4]), labels=labels, weights=weights)
