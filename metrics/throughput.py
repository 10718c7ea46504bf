"""Throughput: examples trained over all ranks per second (``torchrec.metrics.throughput``). Every ``update()`` is
one step of ``batch_size x world_size`` examples; the first ``warmup_steps`` steps are counted but not timed. The
lifetime value is the post-warm-up examples over the post-warm-up time (checkpointed: it survives a restart), the
attempt value the same since this process started, the window value over the steps of the last ``window_seconds``.

Keys: ``throughput-throughput|{lifetime_,window_,attempt_}throughput``, ``throughput-throughput|total_examples`` and
``...|attempt_examples``. The rates appear only once a step after warm-up has been timed."""

from __future__ import annotations

import math
import time
from collections import deque

import torch
from torch import nn

from tritonrec.metrics._checks import check_int
from tritonrec.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix, compose_metric_key

MAX_WINDOW_TS: int = 2 * 60 * 60  # torchrec caps the window at two hours so window_throughput never goes stale


class ThroughputMetric(nn.Module):
    _namespace: MetricNamespace = MetricNamespace.THROUGHPUT
    _metric_name: MetricName = MetricName.THROUGHPUT

    def __init__(
        self,
        *,
        batch_size: int,
        world_size: int,
        window_seconds: int,
        warmup_steps: int = 100,
        batch_size_stages: object = None,
    ) -> None:
        super().__init__()
        self._batch_size = check_int(batch_size, "batch_size", 1)
        self._world_size = check_int(world_size, "world_size", 1)
        self._window_seconds = min(check_int(window_seconds, "window_seconds", 1), MAX_WINDOW_TS)
        self._warmup_steps = check_int(warmup_steps, "warmup_steps", 1)
        if batch_size_stages is not None:
            raise ValueError("batch_size_stages is not supported")
        self.register_buffer("total_examples", torch.tensor(0, dtype=torch.long))
        self.register_buffer("warmup_examples", torch.tensor(0, dtype=torch.long))
        self.register_buffer("time_lapse_after_warmup", torch.tensor(0, dtype=torch.double))
        self.register_buffer("attempt_examples", torch.tensor(0, dtype=torch.long), persistent=False)
        self.register_buffer("attempt_warmup_examples", torch.tensor(0, dtype=torch.long), persistent=False)
        self.register_buffer("attempt_time_lapse_after_warmup", torch.tensor(0, dtype=torch.double), persistent=False)
        self._window_time_lapse_buffer: deque[float] = deque(maxlen=MAX_WINDOW_TS)
        self._window_time_lapse = 0.0
        self._previous_ts = 0.0
        self._steps = 0
        own = str(self._namespace)
        self._lifetime_throughput_key = compose_metric_key(
            self._namespace, own, self._metric_name, MetricPrefix.LIFETIME
        )
        self._window_throughput_key = compose_metric_key(self._namespace, own, self._metric_name, MetricPrefix.WINDOW)
        self._attempt_throughput_key = compose_metric_key(self._namespace, own, self._metric_name, MetricPrefix.ATTEMPT)
        self._total_examples_key = compose_metric_key(self._namespace, own, MetricName.TOTAL_EXAMPLES)
        self._attempt_examples_key = compose_metric_key(self._namespace, own, MetricName.ATTEMPT_EXAMPLES)

    def _batch_examples(self) -> int:
        return self._batch_size * self._world_size

    def update(self) -> None:
        """One step done (call once per trained batch, on every rank)."""
        ts = time.monotonic()
        self._steps += 1
        examples = self._batch_examples()
        self.total_examples += examples
        self.attempt_examples += examples
        if self._steps <= self._warmup_steps:
            self.warmup_examples += examples
            self.attempt_warmup_examples += examples
            if self._steps == self._warmup_steps:
                self._previous_ts = ts
            return
        lapse = ts - self._previous_ts
        self.time_lapse_after_warmup += lapse
        self.attempt_time_lapse_after_warmup += lapse
        self._window_time_lapse += lapse
        self._window_time_lapse_buffer.append(lapse)
        while self._window_time_lapse > self._window_seconds:
            self._window_time_lapse -= self._window_time_lapse_buffer.popleft()
        self._previous_ts = ts

    def compute(self) -> dict[str, torch.Tensor]:
        ret = {self._total_examples_key: self.total_examples, self._attempt_examples_key: self.attempt_examples}
        if self._steps <= self._warmup_steps or math.isclose(self.time_lapse_after_warmup.item(), 0):
            return ret
        lifetime = (self.total_examples - self.warmup_examples) / self.time_lapse_after_warmup
        attempt = (self.attempt_examples - self.attempt_warmup_examples) / self.attempt_time_lapse_after_warmup
        window = 0.0
        if not math.isclose(self._window_time_lapse, 0):
            window = len(self._window_time_lapse_buffer) * self._batch_examples() / self._window_time_lapse
        if not math.isclose(lifetime.item(), 0):
            ret[self._lifetime_throughput_key] = lifetime.clone().detach()
            ret[self._window_throughput_key] = torch.tensor(window, dtype=torch.double)
        if not math.isclose(attempt.item(), 0):
            ret[self._attempt_throughput_key] = attempt.clone().detach()
        return ret
