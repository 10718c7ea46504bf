"""NE (normalized entropy) of the training job, computed by ``tritonrec.metrics``' NEMetric (torchrec's formula:
the weighted cross entropy of the predictions over that of always predicting the base rate, in bits).

The job feeds it the rows of every rank, already combined (the same rows the training AUROC sees), as predictions
``sigmoid(logit)``, labels, and ``valid_mask`` as the weights, so padding rows weigh 0. The module is therefore built
for one rank (``world_size=1``) and read with ``local_compute()``: every rank holds the same rows, so no collective
runs (a ``compute()`` would sum the already-combined rows once per rank, on the model's process group).
"""

from __future__ import annotations

import math

import torch

from tritonrec.kernels.checks import check_int
from tritonrec.metrics import (
    MetricsConfig,
    RecMetricDef,
    RecMetricEnum,
    RecMetricModule,
    RecTaskInfo,
    generate_metric_module,
)
from tritonrec.metrics.computation import RecMetricComputation, WindowBuffer

TASK = RecTaskInfo(name="click", label_name="label", prediction_name="prediction", weight_name="weight")
# local_compute()'s keys: torchrec's "local_" comes before the window_ / lifetime_ prefix
WINDOW_KEY = "ne-click|local_window_ne"
LIFETIME_KEY = "ne-click|local_lifetime_ne"


def ne_module(window_samples: int, step_samples: int) -> RecMetricModule:
    """An NE metric module whose window holds the latest whole steps within ``window_samples`` rows, and at least the
    latest step (``step_samples`` rows, padding included): torchrec's window drops whole batches, and a window
    smaller than one batch would hold none. Build a new one rather than ``reset()`` it (see the count cap below)."""
    check_int(window_samples, "window_samples", 1)
    check_int(step_samples, "step_samples", 1)
    window = max(window_samples, step_samples)
    config = MetricsConfig(
        rec_tasks=[TASK], rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[TASK], window_size=window)}
    )
    module = generate_metric_module(RecMetricModule, config, batch_size=step_samples, world_size=1, my_rank=0,
                                    state_metrics_mapping={}, device=torch.device("cpu"))  # fmt: skip
    # torchrec's window also holds at most MAX_BUFFER_COUNT (1000) batches: with more steps than that in the window
    # (small batches) the window NE would cover fewer rows than the training AUROC beside it. Each step holds a row
    # at least, so a count cap of ``window`` leaves the rows bound alone (a reset() restores torchrec's cap)
    for computation in module.modules():
        if isinstance(computation, RecMetricComputation):
            names = list(computation._batch_window_buffers)
            computation._batch_window_buffers = {name: WindowBuffer(window, window) for name in names}
    return module


def update_ne(module: RecMetricModule, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
    """Add one step's rows: ``logits [N]`` (the model's scores), ``labels [N]`` (0/1), ``weights [N]`` (the valid
    mask). The sigmoid runs in float64 on the host, so the same logits always give the same predictions."""
    module.update({
        "prediction": torch.sigmoid(logits.detach().to("cpu", torch.float64)),
        "label": labels.detach().to("cpu", torch.float64),
        "weight": weights.detach().to("cpu", torch.float64),
    })  # fmt: skip


def ne_values(module: RecMetricModule) -> dict[str, float]:
    """``{"window_ne", "lifetime_ne"}`` of the rows added so far (NaN before the first real row: 0 / 0)."""
    values = module.local_compute()
    return {"window_ne": float(values[WINDOW_KEY]), "lifetime_ne": float(values[LIFETIME_KEY])}


def held_out_ne(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """NE of a whole held-out pass: ``logits``, ``labels``, ``weights`` [N] over every rank's rows (NaN when no row
    has weight)."""
    rows = logits.shape[0]
    if rows == 0:
        return math.nan
    module = ne_module(rows, rows)
    update_ne(module, logits, labels, weights)
    return ne_values(module)["lifetime_ne"]


__all__ = ["held_out_ne", "ne_module", "ne_values", "update_ne"]
