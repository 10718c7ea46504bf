"""A one-process sharded module (no process group: its input and output dists are no-ops) and small models around
it, to test tracing, pipelining and the pipelines' input checks without spawning ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.dist.awaitable import LazyNoWait, NoWait
from tritonrec.dist.types import NullShardedModuleContext, ShardedModule
from tritonrec.modules.dlrm import masked_bce_with_logits

ROWS, DIM, DENSE, BATCH = 30, 4, 3, 6


class ToySharded(ShardedModule):
    """Sum-pooled lookup of one feature; records the order of its input dists and lookups in ``events``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(ROWS, DIM))
        self.events: list[str] = []

    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(self, ctx: NullShardedModuleContext, features: KeyedJaggedTensor) -> NoWait:
        self.events.append("input_dist")
        return NoWait(NoWait(features))

    def compute(self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor) -> torch.Tensor:
        self.events.append("compute")
        offsets = dist_input.offsets()[:-1].long()
        return nn.functional.embedding_bag(dist_input.values(), self.weight, offsets, mode="sum")

    def output_dist(self, ctx: NullShardedModuleContext, output: torch.Tensor) -> LazyNoWait:
        return LazyNoWait(output)


def _loss(embedded: torch.Tensor, batch: Batch, linear: nn.Linear) -> tuple:
    logits = linear(torch.cat([embedded, batch.dense_features], dim=1)).squeeze(-1)
    loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
    return loss, (loss.detach(), logits.detach(), batch.labels)


class ToyModel(nn.Module):
    """``losses, output = model(batch)`` over a ToySharded fed from ``batch.sparse_features`` (pipelineable)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sharded = ToySharded()
        self.linear = nn.Linear(DIM + DENSE, 1)

    def forward(self, batch: Batch) -> tuple:
        embedded = self.sharded(batch.sparse_features)
        out = _loss(embedded, batch, self.linear)
        if batch.labels.sum() > 0:  # data-dependent branch after the lookup: tracing stops here, harmlessly
            return out
        return out


class ComputedInputModel(ToyModel):
    """The sharded module's input is computed from the batch (a KJT method call): not pipelineable."""

    def forward(self, batch: Batch) -> tuple:
        return _loss(self.sharded(batch.sparse_features.permute([0])), batch, self.linear)


class TwiceModel(ToyModel):
    def forward(self, batch: Batch) -> tuple:
        embedded = self.sharded(batch.sparse_features) + self.sharded(batch.sparse_features)
        return _loss(embedded, batch, self.linear)


class BranchFirstModel(ToyModel):
    """A data-dependent branch before the lookup: tracing stops before it."""

    def forward(self, batch: Batch) -> tuple:
        scale = 2.0 if batch.labels.sum() > 0 else 1.0
        return _loss(self.sharded(batch.sparse_features) * scale, batch, self.linear)


def toy_batches(count: int, start: int = 0) -> Iterator[Batch]:
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (BATCH,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(["f"], values, lengths=lengths.int())
        yield Batch(torch.randn(BATCH, DENSE, generator=g), kjt, (torch.rand(BATCH, generator=g) < 0.5).float(),
                    torch.ones(BATCH, dtype=torch.bool))  # fmt: skip


def progress_losses(pipeline: object, data: Iterator[Batch]) -> list[float]:
    """The losses of ``pipeline.progress(data)`` until it raises StopIteration (the pipeline is left open)."""
    losses = []
    while True:
        try:
            losses.append(pipeline.progress(data)[0].item())  # type: ignore[attr-defined]
        except StopIteration:
            return losses


def staged_losses(
    pipeline: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterator[Any],
    after_step: Callable[[Any, list[float]], None] | None = None,
) -> list[float]:
    """The caller's half of a StagedTrainPipeline: forward, backward and step on every batch ``progress`` hands out,
    until it returns None (the data is over); the losses. ``after_step(batch, losses)`` runs after each step (a
    flush request, a detach, a record of what trained)."""
    losses: list[float] = []
    while (batch := pipeline.progress(data)) is not None:
        optimizer.zero_grad()
        loss = model(batch)[0]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(batch, losses)
    return losses


class OwnGroupSharded(ToySharded):
    """Claims its input dists run on a group of their own, as the real collections' do on a side group: the sparse-
    dist pipeline may then read the ranks' agreement after the forward (a no-op agreement in one process)."""

    @property
    def input_dist_on_own_group(self) -> bool:
        return True


class OwnGroupModel(ToyModel):
    """ToyModel over an OwnGroupSharded (pipelined, agreement deferred)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.sharded = OwnGroupSharded()


class OwnGroupPlusComputedModel(OwnGroupModel):
    """A pipelined OwnGroupSharded plus a second one fed a computed input (so it runs its own input dist in the
    forward, on the input-dist group the pipelined one's launch ahead uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.other = OwnGroupSharded()
        self.linear = nn.Linear(2 * DIM + DENSE, 1)

    def forward(self, batch: Batch) -> tuple:
        embedded = torch.cat([self.sharded(batch.sparse_features), self.other(batch.sparse_features.permute([0]))], 1)
        return _loss(embedded, batch, self.linear)
