"""Time-adjusted compute intervals (``min_compute_interval`` / ``max_compute_interval``): on the same pinned clock
the adjusted ``compute_interval_steps`` equals torchrec 1.8's (its ``time`` patched, its all-reduce an identity for
a world of one); where torchrec fails (an interval inside the range, a step count rounding to 0, a clock that did not
advance) the steps are kept or raised to 1; bad ranges are refused naming the argument and value."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from tests.metrics.reference import stream
from tritonrec.metrics import (
    MetricsConfig,
    NEMetric,
    RecMetricDef,
    RecMetricEnum,
    RecMetricList,
    RecMetricModule,
    RecTaskInfo,
    ThroughputMetric,
    generate_metric_module,
)

TASK = RecTaskInfo(name="t0", label_name="l0", prediction_name="p0", weight_name="w0")
BATCH = 4


def ours(steps: int, low: float, high: float, clock: list[float], world: int = 1, rank: int = 0) -> RecMetricModule:
    """A NE module computing once per ``clock`` reading (``steps`` batches before each, as a training loop would)."""
    metric = NEMetric(world_size=world, my_rank=rank, batch_size=BATCH, tasks=[TASK], window_size=100)
    module = RecMetricModule(
        BATCH,
        world,
        rec_tasks=[TASK],
        rec_metrics=RecMetricList([metric]),
        compute_interval_steps=steps,
        min_compute_interval=low,
        max_compute_interval=high,
    )
    batch = stream(seed=rank, steps=1, batch=BATCH, tasks=1)[0]
    for now in clock:
        module._current_time = lambda now=now: now
        while True:
            module.update(batch)
            if module.should_compute():
                break
        module.compute()
    return module


def torchrec_steps(steps: int, low: float, high: float, clock: list[float]) -> int:
    """torchrec 1.8's compute_interval_steps after the same computes on the same clock."""
    import torchrec.metrics.metric_module as trm
    from torchrec.metrics import metrics_config as trc

    task = trc.RecTaskInfo(name="t0", label_name="l0", prediction_name="p0", weight_name="w0")
    cfg = trc.MetricsConfig(rec_tasks=[task], rec_metrics={trc.RecMetricEnum.NE: trc.RecMetricDef(rec_tasks=[task])},
                            throughput_metric=None, state_metrics=[], compute_interval_steps=steps,
                            min_compute_interval=low, max_compute_interval=high)  # fmt: skip
    module = trm.generate_metric_module(trm.RecMetricModule, cfg, BATCH, 1, 0, {}, torch.device("cpu"))
    batch = {"p0": torch.rand(BATCH), "l0": torch.ones(BATCH), "w0": torch.ones(BATCH)}
    fake_time = mock.Mock()
    with mock.patch.object(trm, "time", fake_time), mock.patch.object(trm.dist, "all_reduce"):  # one rank: identity
        for now in clock:
            fake_time.time.return_value = now
            while True:
                module.update(batch)
                if module.should_compute():
                    break
            module.compute()
    return module.compute_interval_steps


# (compute_interval_steps, min, max, clock at each compute): the interval between the first two computes lies
# outside the range, so both adjust once and keep the result at the third compute
MATCHING = [
    (10, 5.0, math.inf, [100.0, 101.0, 102.0]),  # too fast, no max: aim at min + 1 s
    (10, 0.0, 3.0, [100.0, 110.0, 111.0]),  # too slow, min 0: aim at max - 1 s
    (10, 0.0, 0.9, [100.0, 105.0, 106.0]),  # max <= 1 s: aim at max itself
    (10, 2.0, 6.0, [100.0, 120.0, 121.0]),  # both bounds: aim at their midpoint
    (10, 2.0, 6.0, [100.0, 100.5, 101.0]),
    (7, 0.5, 0.8, [1000.0, 1000.1, 1000.2]),
    (100, 0.0, 30.0, [50.0, 90.0, 130.0]),
    (3, 4.0, 4.0, [10.0, 10.7]),  # min == max
]


def formula_steps(steps: int, low: float, high: float, clock: list[float]) -> int:
    """torchrec's rule written out: the seconds between the first two computes over ``steps`` batches give the
    seconds per batch; aim at min + 1 (no max), max - 1 (no min; max - 0 when max <= 1) or the midpoint."""
    per_batch = (clock[1] - clock[0]) / steps
    if high == float("inf"):
        return int((low + 1) / per_batch)
    if low == 0.0:
        return int((high - (1 if high > 1 else 0)) / per_batch)
    return int((high + low) / 2 / per_batch)


@pytest.mark.parametrize(("steps", "low", "high", "clock"), MATCHING)
def test_adjusted_steps_equal_torchrecs_on_the_same_clock(steps: int, low: float, high: float, clock: list) -> None:
    """Ours against the rule written out (in CI, without torchrec) and, where torchrec 1.8 is installed, the rule
    against torchrec's module on the same pinned clock."""
    want = formula_steps(steps, low, high, clock)
    try:
        import torchrec  # noqa: F401
    except ImportError:
        pass
    else:
        assert torchrec_steps(steps, low, high, clock) == want
    assert want != steps
    module = ours(steps, low, high, clock)
    assert module.compute_interval_steps == want
    if len(clock) > 2:  # the third compute came at the next multiple of the new steps (should_compute's modulo)
        assert module.trained_batches == (2 * steps // want + 1) * want


@pytest.mark.parametrize(
    ("steps", "low", "high", "clock", "want"),
    [
        (10, 2.0, 6.0, [100.0, 104.0, 150.0], 10),  # inside the range: kept (torchrec sets 0, should_compute fails)
        (10, 0.0, 0.5, [100.0, 110.0], 1),  # int(0.5 s / 1 s per batch) = 0: raised to 1 (torchrec sets 0)
        (10, 5.0, math.inf, [100.0, 100.0, 100.5], 10),  # the clock did not advance: kept (torchrec divides by 0)
        (10, 5.0, math.inf, [100.0, 99.0, 100.5], 10),  # nor when it went back
        (10, 0.0, math.inf, [100.0, 200.0, 201.0], 10),  # the defaults: never adjusted (torchrec's)
    ],
    ids=["inside", "rounds-to-0", "still-clock", "clock-back", "defaults"],
)
def test_steps_are_kept_or_raised_to_1_where_torchrec_fails(
    steps: int, low: float, high: float, clock: list, want: int
) -> None:
    module = ours(steps, low, high, clock)
    assert module.compute_interval_steps == want
    module._current_time = lambda: 1e9
    module.compute()  # adjusted once only, as torchrec
    assert module.compute_interval_steps == want


def test_first_compute_at_clock_zero_is_a_measurement_start() -> None:
    """A first compute at clock 0 starts the measurement (torchrec takes a reading of 0 for "no compute yet", its
    -1.0 sentinel tested with > 0, and measures one compute later: an epoch clock never reads 0)."""
    assert ours(10, 0.0, 3.0, [0.0, 10.0]).compute_interval_steps == 2


def test_a_module_without_rec_metrics_never_adjusts() -> None:
    """As torchrec: only a compute() with rec metrics measures the interval."""
    throughput = ThroughputMetric(batch_size=BATCH, world_size=1, window_seconds=100)
    module = RecMetricModule(BATCH, 1, throughput_metric=throughput, compute_interval_steps=9, min_compute_interval=5.0)
    for now in (100.0, 101.0, 102.0):
        module._current_time = lambda now=now: now
        module.compute()
    assert module.compute_interval_steps == 9


@pytest.mark.parametrize(
    ("low", "high", "error", "message"),
    [
        (-1.0, 3.0, ValueError, "min_compute_interval must be a finite number of seconds >= 0, got -1.0"),
        (math.inf, math.inf, ValueError, "min_compute_interval must be a finite number of seconds >= 0, got inf"),
        (math.nan, 3.0, ValueError, "min_compute_interval must be a finite number of seconds >= 0, got nan"),
        (1.0, 0.0, ValueError, r"max_compute_interval must be > 0 seconds \(inf for no bound\), got 0.0"),
        (0.0, -2.0, ValueError, r"max_compute_interval must be > 0 seconds \(inf for no bound\), got -2.0"),
        (1.0, math.nan, ValueError, r"max_compute_interval must be > 0 seconds \(inf for no bound\), got nan"),
        (5.0, 1.0, ValueError, "min_compute_interval 5.0 must be <= max_compute_interval 1.0"),
        ("1", 3.0, TypeError, "min_compute_interval must be a float, got str '1'"),
        (0.0, None, TypeError, "max_compute_interval must be a float, got NoneType None"),
        (True, 3.0, TypeError, "min_compute_interval must be a float, got bool True"),
    ],
)
def test_bad_interval_ranges_are_refused_naming_the_argument_and_value(
    low: object, high: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        RecMetricModule(BATCH, 1, min_compute_interval=low, max_compute_interval=high)
    cfg = MetricsConfig(rec_tasks=[TASK], rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[TASK])},
                        min_compute_interval=low, max_compute_interval=high)  # fmt: skip
    with pytest.raises(error, match=message):
        generate_metric_module(RecMetricModule, cfg, BATCH, 1, 0, {}, torch.device("cpu"))


def test_a_non_default_step_count_with_both_bounds_is_the_first_guess() -> None:
    """torchrec takes compute_interval_steps with both bounds: the measurement runs over that many batches."""
    cfg = MetricsConfig(rec_tasks=[TASK], rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[TASK])},
                        compute_interval_steps=4, min_compute_interval=1.0, max_compute_interval=2.0)  # fmt: skip
    module = generate_metric_module(RecMetricModule, cfg, BATCH, 1, 0, {}, torch.device("cpu"))
    assert (module.compute_interval_steps, module.min_compute_interval, module.max_compute_interval) == (4, 1.0, 2.0)
    want = formula_steps(4, 1.0, 2.0, [10.0, 10.5])
    assert want == 12  # 0.125 s per batch, aiming at 1.5 s
    assert ours(4, 1.0, 2.0, [10.0, 10.5]).compute_interval_steps == want
