"""RecMetricModule built from a MetricsConfig: update from model outputs, keys, checkpoint round trip (lifetime
states survive, the window restarts), throughput on a fake clock, and every refused input naming its argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.metrics.reference import cat_steps, ctr, ne, stream
from tritonrec.metrics import (
    AUCMetric,
    MetricsConfig,
    NEMetric,
    RecMetricDef,
    RecMetricEnum,
    RecMetricModule,
    RecTaskInfo,
    ThroughputDef,
    ThroughputMetric,
    generate_metric_module,
)
from tritonrec.metrics import throughput as throughput_module

TASKS = [RecTaskInfo(name=f"t{t}", label_name=f"l{t}", prediction_name=f"p{t}", weight_name=f"w{t}") for t in range(2)]
BATCH = 8


def _module(window: int = 16, **config: object) -> RecMetricModule:
    cfg = MetricsConfig(
        rec_tasks=TASKS,
        rec_metrics={
            RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0, 1], window_size=window),
            RecMetricEnum.CTR: RecMetricDef(rec_tasks=[TASKS[1]], window_size=window),
            RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0], window_size=window),
        },
        **config,
    )
    return generate_metric_module(RecMetricModule, cfg, BATCH, 1, 0, {}, torch.device("cpu"))


def test_module_reports_every_configured_key_and_checkpoints_lifetime_states() -> None:
    steps = stream(seed=5, steps=6, batch=BATCH)
    module = _module()
    for step in steps[:4]:
        module.update(step)
    assert set(module.compute()) == {
        "ne-t0|lifetime_ne", "ne-t0|window_ne", "ne-t1|lifetime_ne", "ne-t1|window_ne",
        "ctr-t1|lifetime_ctr", "ctr-t1|window_ctr", "auc-t0|window_auc",
    }  # fmt: skip
    restored = _module()
    restored.load_state_dict(module.state_dict())
    for step in steps[4:]:
        restored.update(step)
    out = restored.compute()
    p, y, w = (cat_steps(steps, f"{role}0") for role in "plw")
    assert out["ne-t0|lifetime_ne"].item() == pytest.approx(ne(p, y, w), rel=2e-6)  # all 6 steps
    p, y, w = (cat_steps(steps[4:], f"{role}0") for role in "plw")
    assert out["ne-t0|window_ne"].item() == pytest.approx(ne(p, y, w), rel=2e-6)  # only the steps since the restore
    p, y, w = (cat_steps(steps, f"{role}1") for role in "plw")
    assert out["ctr-t1|lifetime_ctr"].item() == pytest.approx(ctr(p, y, w), rel=2e-6)


def test_should_compute_follows_compute_interval_steps() -> None:
    module = _module(compute_interval_steps=2)
    seen = []
    for step in stream(seed=6, steps=4, batch=BATCH):
        module.update(step)
        seen.append(module.should_compute())
    assert seen == [False, True, False, True]


def test_throughput_counts_examples_and_times_steps_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 11.0, 11.5, 13.5])
    monkeypatch.setattr(throughput_module.time, "monotonic", lambda: next(clock))
    metric = ThroughputMetric(batch_size=4, world_size=3, window_seconds=2, warmup_steps=1)
    for _ in range(4):
        metric.update()
    out = metric.compute()
    assert out["throughput-throughput|total_examples"].item() == 48
    # after warm-up: 3 steps of 12 examples in 3.5 s; the 2 s window holds only the last step (2 s)
    assert out["throughput-throughput|lifetime_throughput"].item() == pytest.approx(36 / 3.5)
    assert out["throughput-throughput|window_throughput"].item() == pytest.approx(12 / 2.0)
    restored = ThroughputMetric(batch_size=4, world_size=3, window_seconds=2, warmup_steps=1)
    restored.load_state_dict(metric.state_dict())
    assert restored.total_examples.item() == 48 and restored.time_lapse_after_warmup.item() == 3.5


def test_throughput_from_config() -> None:
    module = _module(throughput_metric=ThroughputDef(window_size=100, warmup_steps=2))
    module.update(stream(seed=7, steps=1, batch=BATCH)[0])
    assert module.compute()["throughput-throughput|total_examples"].item() == BATCH


def _ne(**kwargs: object) -> NEMetric:
    args: dict = {"world_size": 1, "my_rank": 0, "batch_size": BATCH, "tasks": TASKS, "window_size": 16}
    return NEMetric(**{**args, **kwargs})


def _auc_grouped() -> AUCMetric:
    return AUCMetric(world_size=1, my_rank=0, batch_size=2, tasks=TASKS, grouped_auc=True)


@pytest.mark.parametrize(
    ("make", "error", "names"),
    [
        (lambda: _ne(window_size=0), ValueError, "window_size"),
        (lambda: _ne(window_size=-5), ValueError, "window_size"),
        (lambda: _ne(window_size=4), ValueError, "window_size"),  # local window below the batch size
        (lambda: _ne(batch_size=0), ValueError, "batch_size"),
        (lambda: _ne(my_rank=1), ValueError, "my_rank"),
        (lambda: _ne(tasks=[]), TypeError, "tasks"),
        (lambda: _ne(fused_update_limit=4), ValueError, "fused_update_limit"),
        (lambda: _ne(should_validate_update=True), ValueError, "should_validate_update"),
        (lambda: _ne(enable_pt2_compile=True), ValueError, "enable_pt2_compile"),
        (lambda: _ne(threshold=0.5), ValueError, "threshold"),
        (lambda: _ne(include_logloss="yes"), TypeError, "include_logloss"),
        (
            lambda: AUCMetric(world_size=1, my_rank=0, batch_size=2, tasks=TASKS, grouped_auc=True),
            ValueError,
            "grouped",
        ),
        (
            lambda: _module_config(rec_metrics={RecMetricEnum.AUPRC: RecMetricDef(rec_task_indices=[0])}),
            ValueError,
            "auprc",
        ),
        (lambda: _module_config(rec_metrics={"nonsense": RecMetricDef(rec_task_indices=[0])}), ValueError, "nonsense"),
        (
            lambda: MetricsConfig(rec_tasks=TASKS, rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_task_indices=[2])}),
            ValueError,
            "rec_task_indices",
        ),
        (lambda: _module_config(min_compute_interval=-1.0), ValueError, "min_compute_interval"),
        (lambda: _module_config(max_compute_interval=0.0), ValueError, "max_compute_interval"),
    ],
)
def test_bad_construction_is_refused_naming_the_argument(
    make: Callable[[], object], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        make()


def _module_config(**config: object) -> RecMetricModule:
    return generate_metric_module(RecMetricModule, MetricsConfig(rec_tasks=TASKS, **config), BATCH, 1, 0, {}, "cpu")


@pytest.mark.parametrize(
    ("update", "error", "names"),
    [
        (dict(predictions={"t0": torch.rand(4)}, labels={"t0": torch.ones(5)}, weights=None), ValueError, "labels"),
        (
            dict(predictions={"t0": torch.rand(4)}, labels={"t0": torch.ones(4)}, weights={"t0": torch.ones(3)}),
            ValueError,
            "weights",
        ),
        (dict(predictions={"t0": torch.rand(4)}, labels={"t1": torch.ones(4)}, weights=None), ValueError, "labels"),
        (dict(predictions=torch.rand(3, 4), labels=torch.ones(3, 4), weights=None), ValueError, "predictions"),
        (dict(predictions={"t0": [0.5]}, labels={"t0": torch.ones(1)}, weights=None), TypeError, "predictions"),
        (dict(predictions={"t0": torch.rand(4)}, labels=None, weights=None), TypeError, "labels"),
    ],
)
def test_bad_update_is_refused_naming_the_argument(update: dict, error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=names):
        _ne().update(**update)


def test_module_update_refuses_model_outputs_without_a_task_tensor() -> None:
    step = stream(seed=8, steps=1, batch=BATCH)[0]
    del step["w1"]
    with pytest.raises(ValueError, match="w1"):
        _module().update(step)
    step = stream(seed=8, steps=1, batch=BATCH)[0]
    step["p0"] = step["p0"][:3]
    with pytest.raises(ValueError, match="p0"):
        _module().update(step)


def test_moving_a_module_moves_the_window_contributions_and_kept_samples() -> None:
    """``.to()`` reached the buffers only: the window's per-batch contributions (subtracted later) and AUC's kept
    samples stayed behind, so on CUDA the next eviction mixed devices; an AUC without samples made its empty state on
    the CPU whatever the module's device. ``.double()`` stands in for a device move here (no GPU in CI)."""
    steps = stream(seed=7, steps=3, batch=BATCH)
    module = _module(window=2 * BATCH)
    for step in steps[:2]:
        module.update(step)
    module = module.double()
    computations = [m for m in module.modules() if hasattr(m, "_batch_window_buffers")]
    window_parts = [t for c in computations for b in c._batch_window_buffers.values() for t in b.buffers]
    assert window_parts and all(t.dtype == torch.float64 for t in window_parts)
    kept = [t for c in computations if isinstance(getattr(c, "predictions", None), list) for t in c.predictions]
    assert kept and all(t.dtype == torch.float64 for t in kept)
    empty = _module().double()
    auc = next(c for c in empty.modules() if isinstance(getattr(c, "predictions", None), list))
    assert auc._local_list_state("predictions").device == auc._device_anchor.device
    module.update(steps[2])  # evicts the oldest batch from the window: must not fail
    assert set(module.compute()) >= {"ne-t0|window_ne", "auc-t0|window_auc"}
