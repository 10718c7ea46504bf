"""Rank-side cases for the train pipelines (2 gloo ranks): a DLRM sharded by DistributedModelParallel (fused rowwise
Adagrad tables, dense layers under DDP with Adagrad), trained by each pipeline on the same per-rank batches and
compared with TrainPipelineBase bit for bit; drain and uneven ends. The cases where a rank's data, stage or input
dist raises are in pipeline_error_cases.py (they run last: a rank that fails may leave a collective it launched
unmatched on the main group).

Batches are deterministic per (rank, step): ``B = 8`` rows, 4 features with 0-4 ids each (some bags empty).
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.train_pipeline.toy import staged_losses

FEATURES = ["f0", "f1", "f2", "f3"]
ROWS = [40, 7, 25, 60]
DIM = 8
BATCH = 8
DENSE = 5
STEPS = 20
CPU = torch.device("cpu")


def make_batch(rank: int, step: int) -> Any:
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.data.batch import Batch

    g = torch.Generator().manual_seed(10_000 * rank + step)
    lengths = torch.randint(0, 5, (len(FEATURES), BATCH), generator=g)
    values = torch.cat([torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, r in enumerate(ROWS)])
    kjt = KeyedJaggedTensor(FEATURES, values, lengths=lengths.reshape(-1).int())
    dense = torch.randn(BATCH, DENSE, generator=g) * 2
    labels = (torch.rand(BATCH, generator=g) < 0.4).float()
    return Batch(dense, kjt, labels, torch.ones(BATCH, dtype=torch.bool))


def batches(rank: int, count: int, fail_at: int | None = None) -> Iterator[Any]:
    for step in range(count):
        if step == fail_at:
            raise ValueError(f"data source broke at batch {step} on rank {rank}")
        yield make_batch(rank, step)


def clip_dense(batch: Any) -> Any:
    """A feature-processing stage: dense features clipped to [-1, 1]."""
    return type(batch)(batch.dense_features.clamp(-1, 1), batch.sparse_features, batch.labels, batch.valid_mask)


def build_model(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over a DLRMTrain, dense optimizer, the sharded EBC inside), the same initial weights
    on every call."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, row_wise, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM, DLRMTrain
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"t_{f}", feature_names=[f])
              for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    sharder = EmbeddingBagCollectionSharder()
    plan = {f"t_{f}": table_wise(rank=i % world) if kind == "tw" else row_wise() for i, f in enumerate(FEATURES)}
    module_plan = construct_module_sharding_plan(ebc, plan, sharder, world, world, "cpu")
    model = DLRMTrain(DLRM(ebc, DENSE, [16, DIM], [16, 1]))
    dmp = DistributedModelParallel(model, device=CPU, plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection":
                                   module_plan}), sharders=[sharder])  # fmt: skip
    sharded = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05), sharded


class TwoCollections(torch.nn.Module):
    """Two EBCs: ``ebc1`` fed ``batch.sparse_features`` (pipelined), ``ebc2`` fed a KJT computed in the forward
    (``computed``: a permute, so it runs its own input dist there, on the input-dist group ebc1's launch ahead
    uses) or the batch's own KJT (pipelined too)."""

    def __init__(self, computed: bool) -> None:
        from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

        super().__init__()
        self.computed = computed

        def collection(tag: str) -> FusedEmbeddingBagCollection:
            tables = [EmbeddingBagConfig(num_embeddings=r, embedding_dim=DIM, name=f"{tag}_{f}", feature_names=[f])
                      for f, r in zip(FEATURES, ROWS, strict=True)]  # fmt: skip
            return FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")

        self.ebc1, self.ebc2 = collection("a"), collection("b")
        self.linear = torch.nn.Linear(2 * len(FEATURES) * DIM + DENSE, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        from tritonrec.modules.dlrm import masked_bce_with_logits

        second = batch.sparse_features.permute([0, 1, 2, 3]) if self.computed else batch.sparse_features
        x = torch.cat([self.ebc1(batch.sparse_features).values(), self.ebc2(second).values(), batch.dense_features], 1)
        logits = self.linear(x).squeeze(-1)
        loss = masked_bce_with_logits(logits, batch.labels, batch.valid_mask)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_two_collections(world: int, computed: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(DistributedModelParallel over TwoCollections, table-wise; dense optimizer; ebc1's sharded module)."""
    from tritonrec.dist import ShardingPlan, construct_module_sharding_plan, table_wise
    from tritonrec.dist.embeddingbag import EmbeddingBagCollectionSharder
    from tritonrec.dist.model_parallel import DistributedModelParallel
    from tritonrec.optim.keyed import in_backward_optimizer_filter

    torch.manual_seed(3)
    model, sharder = TwoCollections(computed), EmbeddingBagCollectionSharder()
    plans = {name: construct_module_sharding_plan(getattr(model, name), {f"{tag}_{f}": table_wise(rank=i % world)
                                                  for i, f in enumerate(FEATURES)}, sharder, world, world, "cpu")
             for name, tag in (("ebc1", "a"), ("ebc2", "b"))}  # fmt: skip
    dmp = DistributedModelParallel(model, device=CPU, plan=ShardingPlan(plans), sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05), dmp.module.ebc1


def snapshot(model: torch.nn.Module, sharded: Any) -> dict[str, torch.Tensor]:
    """Every local parameter and the fused optimizer's per-row state."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param, state in sharded.fused_optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(param)]}:{key}"] = value.detach().clone()
    return out


def record_order(sharded: Any) -> list[str]:
    """Log of the sharded module's input dists and lookups: ``in<k>`` / ``compute<k>`` in call order."""
    events: list[str] = []
    input_dist, compute = sharded.input_dist, sharded.compute_and_output_dist

    def logged_input_dist(*args: Any, **kwargs: Any) -> Any:
        events.append(f"in{sum(e.startswith('in') for e in events)}")
        return input_dist(*args, **kwargs)

    def logged_compute(*args: Any, **kwargs: Any) -> Any:
        events.append(f"compute{sum(e.startswith('compute') for e in events)}")
        return compute(*args, **kwargs)

    sharded.input_dist, sharded.compute_and_output_dist = logged_input_dist, logged_compute
    return events


def train(
    make: Callable[..., Any], kind: str, world: int, data: Iterator[Any], build: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """Train with ``make(model, optimizer)`` until StopIteration: losses, final weights, call order, the pipeline.
    ``build()`` makes (model, optimizer, sharded module) instead of ``build_model(kind, world)``."""
    model, optimizer, sharded = build() if build is not None else build_model(kind, world)
    events = record_order(sharded)
    pipeline = make(model, optimizer)
    losses = run_to_end(pipeline, data)
    return {"losses": losses, "weights": snapshot(model, sharded), "events": events, "pipeline": pipeline}


def run_to_end(pipeline: Any, data: Iterator[Any]) -> list[float]:
    """``pipeline.progress(data)`` until StopIteration, then close it: the losses."""
    losses = []
    while True:
        try:
            loss, _, _ = pipeline.progress(data)
        except StopIteration:
            break
        losses.append(loss.item())
    pipeline.close()
    return losses


def train_staged(kind: str, world: int, data: Iterator[Any], extra_stage: bool = False) -> dict[str, Any]:
    from tritonrec.dist.train_pipeline import PipelineStage, SparseDataDistUtil, StagedTrainPipeline

    model, optimizer, sharded = build_model(kind, world)
    events = record_order(sharded)
    sdd = SparseDataDistUtil(model)
    stages = [PipelineStage("data_copy", lambda b: b.to(CPU))]
    if extra_stage:
        stages.append(PipelineStage("clip_dense", clip_dense))
    stages.append(PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist,
                                fill_callback=sdd.wait_sdd_fill_callback))  # fmt: skip
    pipeline = StagedTrainPipeline(stages, host_prefetch=1)
    losses = staged_losses(pipeline, model, optimizer, data)
    pipeline.close()
    return {"losses": losses, "weights": snapshot(model, sharded), "events": events, "pipelined": sdd.pipelined_modules,
            "defers": pipeline.defers_agreement}  # fmt: skip


def train_staged_skip_then_new_iterator(rank: int, world: int) -> dict[str, Any]:
    """A 3-stage pipeline (copy, a stage that returns None for the 4th batch, the input dist) trained on 10 batches,
    then on a new iterator of 5 after the end: the losses and final weights."""
    from tritonrec.dist.train_pipeline import PipelineStage, SparseDataDistUtil, StagedTrainPipeline

    model, optimizer, sharded = build_model("tw", world)
    sdd = SparseDataDistUtil(model)
    calls = itertools.count()
    pipeline = StagedTrainPipeline([
        PipelineStage("data_copy", lambda b: b.to(CPU)),
        PipelineStage("drop", lambda b: None if next(calls) == 3 else b),
        sdd.start_sparse_data_dist_stage(),
    ])  # fmt: skip
    losses = [
        loss
        for data in (batches(rank, 10), batches(rank, 5))
        for loss in staged_losses(pipeline, model, optimizer, data)
    ]
    pipeline.close()
    return {"losses": losses, "weights": snapshot(model, sharded)}


def _differ(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [k for k, v in want["weights"].items() if not torch.equal(got["weights"][k], v)]


def _prefetched(events: list[str]) -> bool:
    """True when every batch ``k+1``'s input dist started before batch ``k``'s lookup."""
    computes = sum(e.startswith("compute") for e in events)
    return computes > 1 and all(events.index(f"in{k + 1}") < events.index(f"compute{k}") for k in range(computes - 1))


# ---------------------------------------------------------------------------------------------------- the cases
def exact_cases(rank: int, world: int) -> dict[str, Any]:
    """Every pipeline vs TrainPipelineBase, TW and RW, 20 steps: losses, weights, whether inputs were prefetched."""
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    out: dict[str, Any] = {}
    for kind in ("tw", "rw"):
        base = train(lambda m, o: TrainPipelineBase(m, o, CPU), kind, world, batches(rank, STEPS))
        runs = {
            "sparse_dist": train(lambda m, o: TrainPipelineSparseDist(m, o, CPU), kind, world, batches(rank, STEPS)),
            "sparse_dist_no_thread": train(
                lambda m, o: TrainPipelineSparseDist(m, o, CPU, host_prefetch=0), kind, world, batches(rank, STEPS)
            ),
            "staged": train_staged(kind, world, batches(rank, STEPS)),
        }
        for name, run in runs.items():
            pipelined = run["pipeline"].pipelined_modules if "pipeline" in run else run["pipelined"]
            defers = run["pipeline"].defers_agreement if "pipeline" in run else run["defers"]
            out[f"{kind}-{name}"] = {"losses": run["losses"], "base_losses": base["losses"],
                                     "differ": _differ(run, base), "prefetched": _prefetched(run["events"]),
                                     "pipelined": pipelined, "defers": defers}  # fmt: skip
        out[f"{kind}-base"] = {"prefetched": _prefetched(base["events"]), "steps": len(base["losses"])}
    # a user stage (clip the dense features) equals the base pipeline on clipped batches
    base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, map(clip_dense, batches(rank, STEPS)))
    staged = train_staged("tw", world, batches(rank, STEPS), extra_stage=True)
    out["tw-staged_extra_stage"] = {"losses": staged["losses"], "base_losses": base["losses"],
                                    "differ": _differ(staged, base), "prefetched": _prefetched(staged["events"]),
                                    "pipelined": staged["pipelined"], "defers": staged["defers"]}  # fmt: skip
    # a stage that returns None for batch 3 (skipped), then a new iterator after the end: equals the base pipeline on
    # the other batches (before the fix, the batch after the skipped one reached the model without its input dist,
    # and after the end progress gave None for good)
    try:  # (a failure here fails its own test, not the suite's others)
        skipped = train_staged_skip_then_new_iterator(rank, world)
    except Exception as error:
        skipped = {"losses": [f"{type(error).__name__}: {error}"], "weights": {}}
    kept = itertools.chain((b for k, b in enumerate(batches(rank, 10)) if k != 3), batches(rank, 5))
    base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, kept)
    out["tw-staged_skip_new_iterator"] = {
        "losses": skipped["losses"],
        "base_losses": base["losses"],
        "differ": _differ(skipped, base) if skipped["weights"] else ["(raised)"],
    }
    # two collections, the second fed a computed KJT (or the batch's own): pipelined training still equals base, and
    # the ranks agree before the forward only when the second runs its own input dist there
    for computed in (True, False):
        build = lambda: build_two_collections(world, computed)  # noqa: B023 (called within the iteration)
        base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, batches(rank, 8), build)
        run = train(lambda m, o: TrainPipelineSparseDist(m, o, CPU), "tw", world, batches(rank, 8), build)
        out[f"two_collections-{'computed' if computed else 'batch'}"] = {
            "losses": run["losses"], "base_losses": base["losses"], "differ": _differ(run, base),
            "pipelined": run["pipeline"].pipelined_modules, "deferred": run["pipeline"].defers_agreement,
        }  # fmt: skip
    return out


def end_cases(rank: int, world: int) -> dict[str, Any]:
    """Steps run per pipeline when the data ends: 5 batches on both ranks (drain), 6 vs 4 (uneven ends)."""
    from tritonrec.dist.train_pipeline import EvalPipelineSparseDist, TrainPipelineBase, TrainPipelineSparseDist

    out: dict[str, Any] = {}
    for label, count in (("drain", 5), ("uneven", 6 if rank == 0 else 4)):
        base = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, batches(rank, count))
        drained = train(lambda m, o: TrainPipelineSparseDist(m, o, CPU), "tw", world, batches(rank, count))
        no_drain = lambda m, o: TrainPipelineSparseDist(m, o, CPU, execute_all_batches=False)
        stopped = train(no_drain, "tw", world, batches(rank, count))
        resumed = no_drain_resume(rank, world, count, 5 if label == "drain" else 4)
        staged = train_staged("rw", world, batches(rank, count))
        out[label] = {"base": base["losses"], "sparse_dist": drained["losses"], "no_drain": stopped["losses"],
                      "staged": len(staged["losses"]), "differ": _differ(drained, base),
                      "no_drain_resume": resumed}  # fmt: skip
        model, _, _ = build_model("rw", world)
        model.eval()
        pipeline = EvalPipelineSparseDist(model, None, CPU)
        data = batches(rank, count)
        logits = []
        while True:
            try:
                logits.append(pipeline.progress(data)[1])
            except StopIteration:
                break
        pipeline.close()
        pipeline.detach()
        with torch.no_grad():  # the unpipelined model on the same batches (forward only: nothing changes)
            direct = [model(make_batch(rank, k))[1][1] for k in range(len(logits))]
        out[label]["eval_steps"] = len(logits)
        out[label]["eval_equal"] = all(torch.equal(a, b) for a, b in zip(logits, direct, strict=True))
    return out


def no_drain_resume(rank: int, world: int, count: int, steps: int) -> dict[str, Any]:
    """``execute_all_batches=False`` on ``count`` batches (``steps`` agreed): the model's forwards until
    StopIteration, the next call on the same iterator, then a new iterator run to its end. It must train like
    TrainPipelineBase on the first ``steps`` batches then the new iterator's first ``steps - 2``: the 2 batches in
    flight at the stop train first, and the new data's last 2 are in flight at its end."""
    from tritonrec.dist.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    model, optimizer, sharded = build_model("tw", world)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU, execute_all_batches=False)
    data = batches(rank, count)
    losses = run_to_end(pipeline, data)
    out: dict[str, Any] = {"forwards": len(forwards), "again": _outcome(lambda: pipeline.progress(data))["type"]}
    losses += run_to_end(pipeline, batches(rank, count))
    trained = itertools.chain(itertools.islice(batches(rank, count), steps), itertools.islice(batches(rank, count),
                                                                                                steps - 2))  # fmt: skip
    reference = train(lambda m, o: TrainPipelineBase(m, o, CPU), "tw", world, trained)
    out["equal"] = losses == reference["losses"]
    out["differ"] = _differ({"weights": snapshot(model, sharded)}, reference)
    return out


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    try:
        steps = run()
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}
    return {"type": None, "steps": steps}
