"""Metrics of the distributed job over all ranks: each rank buffers its steps' losses and predictions, and at each log
point the ranks combine them (one all-reduce of the per-step loss sums and sample counts, one all-gather of the
predictions) so every rank records the same global history: the loss of a step is the mean over every rank's real
samples, the AUROC is over every rank's predictions, samples/s counts every rank's samples. Held-out evaluation does
the same over each rank's shard of the eval data (ranks with fewer batches feed empty, fully masked ones, so every
rank runs the same number of forwards).

These collectives run on a gloo side group (CPU tensors, apart from the model's collectives on the main group).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.data.elements import ElementSource, ElementSpec
from tritonrec.dist.train.loop import TrainHistory
from tritonrec.dist.train.metrics import auroc
from tritonrec.dist.train.ne import held_out_ne
from tritonrec.modules.dlrm import masked_bce_with_logits


@dataclass
class _Step:
    step: int
    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    num_valid: int
    seconds: float


class BatchFeed:
    """The training batches, remembering for each one handed out the data position after it and its valid rows,
    so the loop knows which batch a pipelined step trained (steps train batches in the order they were read).
    Safe to read from a background thread: ``next`` appends, the loop pops."""

    def __init__(self, batches: Iterator[Batch], batcher: Batcher) -> None:
        self._batches = batches
        self._batcher = batcher
        self._read: deque[tuple[dict[str, int], torch.Tensor, int]] = deque()

    def __iter__(self) -> BatchFeed:
        return self

    def __next__(self) -> Batch:
        batch = next(self._batches)
        self._read.append((self._batcher.get_state(), batch.valid_mask, batch.num_valid()))
        return batch

    def pop(self) -> tuple[dict[str, int], torch.Tensor, int]:
        """(data position after, valid mask, real rows) of the oldest batch not popped yet."""
        return self._read.popleft()


class RankMetrics:
    """Buffers this rank's steps; :meth:`sync` records them, combined over the ranks, into ``history``."""

    def __init__(self, history: TrainHistory, group: dist.ProcessGroup | None) -> None:
        self.history = history
        self._group = group
        self._pending: list[_Step] = []

    def record(self, step: int, output: Any, mask: torch.Tensor, num_valid: int, seconds: float) -> None:
        loss, logits, labels = output
        self._pending.append(_Step(step, loss.detach(), logits.detach(), labels.detach(), mask, num_valid, seconds))

    def sync(self) -> None:
        """Combine the buffered steps over the ranks (collective) and record them."""
        steps, self._pending = self._pending, []
        if not steps:
            return
        local = torch.tensor([[float(s.loss) * s.num_valid, float(s.num_valid)] for s in steps], dtype=torch.float64)
        parts = [(s.logits.float().cpu(), s.labels.float().cpu(), s.mask.cpu()) for s in steps]
        gathered: list[Any] = [parts]
        if self._group is not None:
            dist.all_reduce(local, group=self._group)
            gathered = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(gathered, parts, group=self._group)
        for i, s in enumerate(steps):
            loss_sum, count = local[i].tolist()
            scores = torch.cat([rank_parts[i][0] for rank_parts in gathered])
            labels = torch.cat([rank_parts[i][1] for rank_parts in gathered])
            weights = torch.cat([rank_parts[i][2] for rank_parts in gathered])
            loss = loss_sum / count if count else math.nan
            self.history.record_values(s.step, loss, scores, labels, weights.float(), int(count), s.seconds)


def empty_batch(spec: ElementSpec, batch_size: int) -> Batch:
    """A batch of ``batch_size`` padding rows (no real sample): dense zeros, empty bags, valid_mask all False."""
    keys = list(spec.sparse_keys)
    kjt = KeyedJaggedTensor(keys, torch.zeros(0, dtype=torch.int64),
                            lengths=torch.zeros(len(keys) * batch_size, dtype=torch.int32))  # fmt: skip
    return Batch(torch.zeros(batch_size, spec.dense_dim), kjt, torch.zeros(batch_size),
                 torch.zeros(batch_size, dtype=torch.bool))  # fmt: skip


def _agreed_has_batch(has_batch: bool, group: dist.ProcessGroup | None) -> bool:
    flag = torch.tensor([int(has_batch)])
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@torch.no_grad()
def evaluate_over_ranks(
    model: nn.Module, source: ElementSource, batch_size: int, device: torch.device, group: dist.ProcessGroup | None
) -> dict[str, float]:
    """One pass over each rank's shard of ``source``: ``{"auroc", "logloss", "ne", "samples"}`` over every rank's
    real samples (the same numbers on every rank). ``model`` returns ``loss, (loss, logits, labels)``."""
    model.eval()
    batches = Batcher(source.element_spec).process(source, batch_size)
    padding = empty_batch(source.element_spec, batch_size)
    scores, labels, weights = [], [], []
    loss_sum = 0.0
    while True:
        batch = next(batches, None)
        if not _agreed_has_batch(batch is not None, group):
            break
        batch = (batch if batch is not None else padding).to(device)
        _, (_, logits, _) = model(batch)
        valid = int(batch.valid_mask.sum())
        loss_sum += float(masked_bce_with_logits(logits, batch.labels, batch.valid_mask)) * valid
        scores.append(logits.float().cpu())
        labels.append(batch.labels.float().cpu())
        weights.append(batch.valid_mask.float().cpu())
    model.train()
    local = (torch.cat(scores), torch.cat(labels), torch.cat(weights), loss_sum) if scores else None
    gathered: list[Any] = [local]
    if group is not None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    parts = [g for g in gathered if g is not None]
    if not parts:
        return {"auroc": math.nan, "logloss": math.nan, "ne": math.nan, "samples": 0.0}
    all_scores, all_labels, all_weights = (torch.cat([p[i] for p in parts]) for i in range(3))
    count = float(all_weights.sum())
    logloss = sum(p[3] for p in parts) / count if count else math.nan
    return {"auroc": auroc(all_scores, all_labels, all_weights), "logloss": logloss,
            "ne": held_out_ne(all_scores, all_labels, all_weights), "samples": count}  # fmt: skip


__all__ = ["BatchFeed", "RankMetrics", "empty_batch", "evaluate_over_ranks"]
