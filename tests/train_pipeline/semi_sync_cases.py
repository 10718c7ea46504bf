"""Rank-side cases for TrainPipelineSemiSync (2 gloo ranks; test_semi_sync.py spawns them).

* Before ``start_batch`` it equals TrainPipelineSparseDist bit for bit (the DLRM of pipeline_cases.py: fused rowwise
  Adagrad tables, dense Adagrad under DDP).
* After it, it equals :func:`reference_run`: a plain loop on unsharded tensors (``F.embedding_bag`` on a copy of the
  tables, rowwise Adagrad written out, a copy of the dense layers) where batch ``j``'s lookup reads the tables as they
  were after batch ``j - 1``'s update if ``j <= start_batch``, else after batch ``j - 2``'s.
* The end of the data: drained, stopped 2 batches early without ``execute_all_batches`` (then resumed by a new
  iterator), uneven ends; a lookup that raises on one rank raises on every rank.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tests.train_pipeline.pipeline_cases import (
    CPU,
    DENSE,
    DIM,
    FEATURES,
    ROWS,
    _differ,
    _outcome,
    batches,
    build_model,
    make_batch,
    run_to_end,
    snapshot,
)

STEPS = 10
LR, EPS, DENSE_LR = 0.1, 1e-8, 0.05


class SemiModel(nn.Module):
    """``loss, output = model(batch)``: an EBC over the batch's features, a dense layer, an over-arch; ``head``
    is the part after the lookup, which the reference calls on its own pooled embeddings."""

    def __init__(self) -> None:
        from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

        super().__init__()
        torch.manual_seed(5)
        tables = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
                  for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
        self.ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": LR, "eps": EPS}, backend="torch")
        self.dense = nn.Linear(DENSE, 8)
        self.over = nn.Sequential(nn.Linear(len(FEATURES) * DIM + 8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        return self.head(self.ebc(batch.sparse_features).values(), batch)

    def head(self, pooled: torch.Tensor, batch: Any) -> tuple[torch.Tensor, Any]:
        from tritonrec.modules.dlrm import masked_bce_with_logits

        x = torch.cat([pooled, torch.relu(self.dense(batch.dense_features))], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_semi(kind: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, SemiModel]:
    """(DMP over a SemiModel sharded ``kind``, dense Adagrad, the sharded EBC, an unsharded copy made before)."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    model, sharder = SemiModel(), EmbeddingBagCollectionSharder()
    unsharded = copy.deepcopy(model)
    plan = {f"t_{f}": table_wise(rank=i % world) if kind == "tw" else row_wise() for i, f in enumerate(FEATURES)}
    module_plan = construct_module_sharding_plan(model.ebc, plan, sharder, world, world, "cpu")
    dmp = DistributedModelParallel(model, device=CPU, plan=ShardingPlan({"ebc": module_plan}), sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=DENSE_LR), dmp.module.ebc, unsharded


def reference_run(model: SemiModel, data: list[list[Any]], start_batch: int, stash_gradients: bool) -> dict[str, Any]:
    """The semi-sync semantics written out on one process. ``data[r][j]``: rank ``r``'s batch of step ``j``; the
    step's loss is the mean of the ranks' losses (DDP averages dense gradients, the sharded tables divide theirs
    by the world size). Returns per-rank losses, the final tables and dense parameters."""
    tables = [model.ebc.embedding_bags[f"t_{f}"].weight.detach().clone() for f in FEATURES]  # [rows, DIM] each
    momentum = [torch.zeros(t.shape[0]) for t in tables]  # rowwise Adagrad: one accumulator per row
    after: dict[int, list[torch.Tensor]] = {-1: [t.clone() for t in tables]}  # the tables after batch j's update
    head = copy.deepcopy(model)
    dense = [p for n, p in head.named_parameters() if not n.startswith("ebc.")]
    optimizer = torch.optim.Adagrad(dense, lr=DENSE_LR)
    stash: list[torch.Tensor] | None = None
    losses: list[list[float]] = [[] for _ in data]
    for j in range(len(data[0])):
        read = after[j - 1] if j <= start_batch else after[j - 2]  # the staleness: one update behind after start
        leaves = [t.clone().requires_grad_() for t in read]
        optimizer.zero_grad()
        total = torch.zeros(())
        for r, rank_data in enumerate(data):
            kjt = rank_data[j].sparse_features.to_dict()
            pooled = torch.cat([nn.functional.embedding_bag(kjt[f].values().long(), leaves[t],
                                                            kjt[f].offsets()[:-1].long(), mode="sum")
                                for t, f in enumerate(FEATURES)], dim=1)  # fmt: skip
            loss = head.head(pooled, rank_data[j])[0]
            losses[r].append(loss.item())
            total = total + loss / len(data)
        total.backward()
        grads = [p.grad.clone() for p in dense]
        if stash_gradients and j >= start_batch:  # the dense step uses the previous batch's gradients
            for p, g in zip(dense, stash or [None] * len(dense), strict=True):
                p.grad = g
            stash = grads
        if not (stash_gradients and j == start_batch):
            optimizer.step()
        for t, leaf in enumerate(leaves):  # the stale gradient updates the current tables
            g = leaf.grad
            momentum[t] += (g * g).mean(dim=1)
            tables[t] -= LR * g / (momentum[t].sqrt() + EPS)[:, None]
        after[j] = [t.clone() for t in tables]
    return {"losses": losses, "tables": tables, "dense": {n: p.detach() for n, p in head.named_parameters()
                                                          if not n.startswith("ebc.")}}  # fmt: skip


def _gathered_tables(dmp: nn.Module) -> list[torch.Tensor] | None:
    """The full tables (rank 0; None elsewhere), in FEATURES order."""
    from tritonrec.dist.sharded_state import gather_unsharded_state_dict

    state = gather_unsharded_state_dict(dmp)
    if state is None:
        return None
    return [next(v for k, v in state.items() if k.endswith(f"t_{f}.weight")) for f in FEATURES]


def semi_run(kind: str, world: int, data: Iterator[Any] | list[Iterator[Any]], **kwargs: Any) -> dict[str, Any]:
    """Train a fresh SemiModel DMP with TrainPipelineSemiSync(**kwargs) on ``data`` (several iterators: one after
    another, each until StopIteration): losses, tables, dense parameters, the unsharded copy."""
    from tritonrec.dist.train_pipeline import TrainPipelineSemiSync

    dmp, optimizer, _, unsharded = build_semi(kind, world)
    pipeline = TrainPipelineSemiSync(dmp, optimizer, CPU, **kwargs)
    losses: list[float] = []
    for part in data if isinstance(data, list) else [data]:
        losses += run_to_end(pipeline, part)
    dense = {n.removeprefix("module."): p.detach() for n, p in dmp.named_parameters() if ".ebc." not in f".{n}"}
    return {"losses": losses, "tables": _gathered_tables(dmp), "dense": dense, "unsharded": unsharded,
            "pipelined": pipeline.pipelined_modules}  # fmt: skip


def _max_diff(got: dict[str, Any], want: dict[str, Any], rank: int) -> dict[str, float]:
    """Largest absolute differences (losses of this rank, tables on rank 0, dense parameters)."""
    out = {"losses": max((abs(a - b) for a, b in zip(got["losses"], want["losses"][rank], strict=True)), default=0.0)}
    if got["tables"] is not None:
        out["tables"] = max((g - w).abs().max().item() for g, w in zip(got["tables"], want["tables"], strict=True))
    dense = [(got["dense"][n] - w).abs().max().item() for n, w in want["dense"].items() if n in got["dense"]]
    out["dense"] = max(dense) if len(dense) == len(want["dense"]) else float("inf")  # a missing name fails
    return out


# ---------------------------------------------------------------------------------------------------- the cases
def sync_cases(rank: int, world: int) -> dict[str, Any]:
    """Semi-sync vs TrainPipelineSparseDist on the pipeline_cases DLRM: bit for bit with ``start_batch`` past the
    end; with ``start_batch=4``, equal losses up to batch 4 (its lookup is the last synchronous one), then not."""
    from tritonrec.dist.train_pipeline import TrainPipelineSemiSync, TrainPipelineSparseDist

    out: dict[str, Any] = {}
    for kind in ("tw", "rw"):
        runs = {}
        for name, make in (
            ("sparse_dist", lambda m, o: TrainPipelineSparseDist(m, o, CPU)),
            ("semi_late", lambda m, o: TrainPipelineSemiSync(m, o, CPU, start_batch=STEPS)),
            ("semi_4", lambda m, o: TrainPipelineSemiSync(m, o, CPU, start_batch=4)),
        ):
            model, optimizer, sharded = build_model(kind, world)
            pipeline = make(model, optimizer)
            runs[name] = {"losses": run_to_end(pipeline, batches(rank, STEPS)), "weights": snapshot(model, sharded),
                          "pipelined": pipeline.pipelined_modules}  # fmt: skip
        base = runs["sparse_dist"]
        out[kind] = {"base": base["losses"], "late": runs["semi_late"]["losses"], "semi_4": runs["semi_4"]["losses"],
                     "differ": _differ(runs["semi_late"], base), "differ_4": _differ(runs["semi_4"], base),
                     "pipelined": runs["semi_late"]["pipelined"]}  # fmt: skip
    return out


def reference_cases(rank: int, world: int) -> dict[str, Any]:
    """Semi-sync (start_batch=3) vs :func:`reference_run`, 10 steps: TW, RW, TW with stashed gradients; and the
    largest difference between the reference and a reference without staleness (the comparison can fail)."""
    out: dict[str, Any] = {}
    data = [[make_batch(r, j) for j in range(STEPS)] for r in range(world)]
    for label, kind, stash in (("tw", "tw", False), ("rw", "rw", False), ("tw_stash", "tw", True)):
        got = semi_run(kind, world, batches(rank, STEPS), start_batch=3, stash_gradients=stash)
        want = reference_run(got["unsharded"], data, 3, stash)
        fresh = reference_run(got["unsharded"], data, STEPS, stash)  # no staleness at all
        out[label] = {"diff": _max_diff(got, want, rank), "vs_fresh": _max_diff(got, fresh, rank),
                      "steps": len(got["losses"]), "pipelined": got["pipelined"]}  # fmt: skip
    return out


def end_cases(rank: int, world: int) -> dict[str, Any]:
    """5 batches on both ranks (drain) or 6 vs 4 (uneven), start_batch=1: steps and losses against the reference
    on the batches every rank trained; without execute_all_batches, 2 batches fewer, StopIteration again on the
    same iterator, and a new iterator trains the 2 left in flight first."""
    out: dict[str, Any] = {}
    for label, count in (("drain", 5), ("uneven", 6 if rank == 0 else 4)):
        steps = 5 if label == "drain" else 4
        data = [[make_batch(r, j) for j in range(steps)] for r in range(world)]
        got = semi_run("tw", world, batches(rank, count), start_batch=1)
        want = reference_run(got["unsharded"], data, 1, False)
        stopped = semi_run("tw", world, batches(rank, count), start_batch=1, execute_all_batches=False)
        out[label] = {"steps": len(got["losses"]), "diff": _max_diff(got, want, rank)["losses"],
                      "no_drain": len(stopped["losses"])}  # fmt: skip
    out["resume"] = _resume(rank, world)
    return out


def _resume(rank: int, world: int) -> dict[str, Any]:
    """execute_all_batches=False on 5 batches, again on the same iterator, then a new iterator of 3: 3 + 0 + 3 steps,
    equal to the reference on batches 0-4 then the new 0 (one stream: its last 2 stay in flight)."""
    from tritonrec.dist.train_pipeline import TrainPipelineSemiSync

    dmp, optimizer, _, unsharded = build_semi("rw", world)
    pipeline = TrainPipelineSemiSync(dmp, optimizer, CPU, start_batch=2, execute_all_batches=False)
    first = batches(rank, 5)
    losses = run_to_end(pipeline, first)
    again = _outcome(lambda: pipeline.progress(first))["type"]
    losses += run_to_end(pipeline, batches(rank, 3))
    stream = [[make_batch(r, j) for j in itertools.chain(range(5), range(1))] for r in range(world)]
    want = reference_run(unsharded, stream, 2, False)
    diff = max(abs(a - b) for a, b in zip(losses, want["losses"][rank], strict=True)) if len(losses) == 6 else None
    return {"steps": len(losses), "again": again, "diff": diff}


def lookup_failure_cases(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's lookup of batch 10 raises: every rank raises at that step (rank 1 its error, rank 0 a
    PipelineStageError naming the stage), instead of rank 0 hanging in batch 10's output dist. Runs last.

    Batch 10: the first 8 calls of an output dist check the ranks' metadata with a blocking all-gather
    (dist/comm_consistency.py), where rank 0 would wait for rank 1 until the group's timeout."""
    from tritonrec.dist.train_pipeline import TrainPipelineSemiSync

    dmp, optimizer, sharded, _ = build_semi("tw", world)
    lookup: Callable[..., Any] = sharded.compute_and_output_dist
    calls = itertools.count()

    def failing(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 10 and rank == 1:
            raise ValueError("lookup broke on rank 1")
        return lookup(*args, **kwargs)

    sharded.compute_and_output_dist = failing
    pipeline = TrainPipelineSemiSync(dmp, optimizer, CPU, start_batch=1)
    data, steps = batches(rank, 14), []

    def train() -> None:
        while True:
            pipeline.progress(data)
            steps.append(1)

    outcome = _outcome(train)
    pipeline.close()
    return {"type": outcome["type"], "message": outcome.get("message", ""), "steps": len(steps)}
