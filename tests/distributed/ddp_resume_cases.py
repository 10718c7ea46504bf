"""Rank side of the fresh-DDP resume check (run by test_three_ranks.py at 3 ranks, where the order of a sum of three
gradients is not fixed by commutativity).

A DMP over a dense-only model trains 6 steps; a second DMP, built fresh from the first one's weights after step 3,
trains steps 3-5 on the same batches, as a resumed job does. DDP reduces a fresh wrapper's first iterations in its
initial bucket layout and the uninterrupted one's in the rebuilt layout; with bucket all-reduces the gradients of the
two then differ in the last bit; with the deterministic all-reduce (all-gather, sum in rank order: the default
for gloo above 2 ranks) they are equal.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

STEPS, RESUME_AT = 6, 3
# each case: DefaultDataParallelWrapper arguments
RESUME_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "bucketed": {"deterministic_allreduce": False},
    "bf16": {"allreduce_comm_precision": "bf16"},
}


def _model() -> nn.Module:
    torch.manual_seed(0)  # several parameters, so the initial and the rebuilt bucket layouts differ in order
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 1))


def _batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=generator) * (1.0 + rank / 3) * (-1) ** step


def _train(model: nn.Module, steps: range, rank: int, wrapper_args: dict[str, Any]) -> tuple[list[Any], Any]:
    """Per step: the reduced gradients and the weights after the step; and the state before step ``RESUME_AT``."""
    from tritonrec.dist import DefaultDataParallelWrapper, DistributedModelParallel

    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), data_parallel_wrapper=DefaultDataParallelWrapper(**wrapper_args)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trace, snapshot = [], None
    for step in steps:
        if step == RESUME_AT:
            snapshot = copy.deepcopy(model.state_dict())
        dmp(_batch(step, rank)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        trace.append((grads, [p.detach().clone() for p in model.parameters()]))
    return trace, snapshot


def run_fresh_ddp_resume(rank: int, world: int) -> dict[str, float]:
    """Largest gradient / weight difference between the uninterrupted and the resumed steps, per case."""
    out = {}
    for name, args in RESUME_CASES.items():
        whole, snapshot = _train(_model(), range(STEPS), rank, args)
        resumed_model = _model()
        resumed_model.load_state_dict(snapshot)
        resumed, _ = _train(resumed_model, range(RESUME_AT, STEPS), rank, args)
        out[name] = max(
            (a - b).abs().max().item()
            for (grads_a, weights_a), (grads_b, weights_b) in zip(whole[RESUME_AT:], resumed, strict=True)
            for a, b in zip(grads_a + weights_a, grads_b + weights_b, strict=True)
        )
    return out


def run_job_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """The training job at this world size: 6 steps, and 3 steps resumed from its step-3 checkpoint (rank 0's
    reports; the other ranks return None)."""
    from pathlib import Path

    from tests.train.dist_job_cases import tiny_config
    from tritonrec.dist.train.run import run_rank

    base = Path(root) / "job_resume"
    full = run_rank(tiny_config(base / "full"))
    checkpoint = base / "full" / "checkpoints" / "step_00000003"
    resumed = run_rank(tiny_config(base / "resumed", resume=str(checkpoint)))
    return {"full": full, "resumed": resumed} if rank == 0 else {}


class _SparseModel(nn.Module):
    """A dense part with a sparse-gradient embedding: its DDP bucket is sparse."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Embedding(10, 3, sparse=True)
        self.linear = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(ids))


def run_sparse_gradient(rank: int, world: int) -> dict[str, float]:
    """The default (deterministic) wrapper over a sparse-gradient parameter reduces it as DDP does without a hook
    (the all-gather cannot take a sparse bucket): largest difference of the averaged gradients, per parameter."""
    from tritonrec.dist import DefaultDataParallelWrapper, DistributedModelParallel

    grads = []
    for args in ({}, {"deterministic_allreduce": False}):
        model = _SparseModel()
        dmp = DistributedModelParallel(
            model, device=torch.device("cpu"), data_parallel_wrapper=DefaultDataParallelWrapper(**args)
        )
        dmp(torch.tensor([rank, rank + 1, 7])).sum().backward()
        grads.append({n: p.grad.to_dense() for n, p in model.named_parameters()})
    return {n: (grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]}
