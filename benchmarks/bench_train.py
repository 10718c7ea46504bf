"""Training throughput of the default job (configs/train.yaml): samples/s of one train step, batch production
included, for tritonrec's DLRM (fused EmbeddingBagCollection, optimizer inside the backward) and, in the same run,
the anchor: the same DLRM whose tables are plain ``torch.nn.EmbeddingBag`` s (sparse gradients) updated by a torch
optimizer. A third row times batch production alone (synthetic source + Batcher).

    python benchmarks/bench_train.py [--repeats 30] [--out train_dlrm.csv] [overrides ...]
    python benchmarks/bench_train.py --out train_dlrm_cuda.csv device=cuda      # both models on the GPU

Overrides are hydra overrides of the job (e.g. ``batch_size=2048 experiment=synthetic_dcn``). With ``device=cuda``
each step copies its host batch to the GPU (as the job does) and is timed with CUDA events.

Throughput (``samples_per_s``, ``speedup_vs_anchor``) comes from ``mean_ms``: the wall time of ``--mean-calls``
consecutive calls, divided by their count. Per-call costs are lumpy by design - the synthetic source generates its
rows in chunks, so one batch in eight costs ~14 ms more on this VM - and a median drops that cost, which a job pays in
full (it overstated batch production alone ~5x and the step's speedup over the anchor by 3-6%). The median, p10
and p90 of single calls stay in the row as the distribution.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from harness import append_csv, mean_call_ms, measure, print_table
from hydra import compose, initialize_config_dir
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.data.batch import Batch
from tritonrec.data.batcher import Batcher
from tritonrec.dist.train.builders import DENSE_OPTIMIZERS, build_data, build_dense_optimizer, build_model, build_tables
from tritonrec.dist.train.config import TrainConfig, as_train_config, register_configs
from tritonrec.dist.train.loop import iterate_batches, train_step
from tritonrec.modules import EmbeddingBagConfig
from tritonrec.modules.dlrm import DLRM, DLRM_DCN, DLRMTrain

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class TorchEmbeddingBagCollection(nn.Module):
    """The anchor's tables: one ``nn.EmbeddingBag`` (sparse gradients) per table, same configs and output layout."""

    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self._configs = tables
        self.embedding_bags = nn.ModuleDict(
            {t.name: nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling.value.lower(), sparse=True)
             for t in tables}
        )  # fmt: skip
        self._features = [(t.name, f) for t in tables for f in t.feature_names]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        by_key = features.to_dict()
        pooled = [
            self.embedding_bags[table](by_key[f].values(), by_key[f].offsets()[:-1]) for table, f in self._features
        ]
        return KeyedTensor([f for _, f in self._features], [p.shape[1] for p in pooled], torch.cat(pooled, dim=1))


def anchor_model(
    cfg: TrainConfig, num_embeddings: dict[str, int], dense_in: int, device: str = "cpu"
) -> tuple[DLRMTrain, Callable]:
    """The default DLRM over torch EmbeddingBags; tables and dense layers share the configured torch optimizer
    rule (sparse-gradient capable: Adagrad, SGD; Adam becomes SparseAdam on the tables)."""
    collection = TorchEmbeddingBagCollection(build_tables(num_embeddings, cfg.model))
    layers = dict(embedding_bag_collection=collection, dense_in_features=dense_in,
                  dense_arch_layer_sizes=list(cfg.model.dense_arch_layer_sizes),
                  over_arch_layer_sizes=list(cfg.model.over_arch_layer_sizes))  # fmt: skip
    if cfg.model.arch == "dlrm":
        dlrm: DLRM = DLRM(**layers)
    else:
        dlrm = DLRM_DCN(**layers, dcn_num_layers=cfg.model.dcn_num_layers, dcn_low_rank_dim=cfg.model.dcn_low_rank_dim)
    model = DLRMTrain(dlrm).to(device)  # before the optimizers: Adagrad makes its state where the parameters are
    table_params = list(collection.parameters())
    dense_params = [p for p in model.parameters() if all(p is not t for t in table_params)]
    table_rule = torch.optim.SparseAdam if cfg.optim.dense == "adam" else DENSE_OPTIMIZERS[cfg.optim.dense]
    optimizers = [
        table_rule(table_params, lr=cfg.optim.sparse_lr),
        DENSE_OPTIMIZERS[cfg.optim.dense](dense_params, lr=cfg.optim.dense_lr),
    ]

    def step(batch: Batch) -> None:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss, _ = model(batch)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    return model, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--mean-calls", type=int, default=96, help="consecutive calls timed for the mean")
    parser.add_argument("--out", default="train_dlrm.csv", help="CSV under benchmarks/results/ ('' to skip)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of the training job")
    args = parser.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = as_train_config(compose(config_name="train", overrides=args.overrides))
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)  # as run(cfg) does: ours and the anchor get the job's thread count
    torch.manual_seed(cfg.seed)
    sources = build_data(cfg.data)
    batch_size = cfg.batch_size

    def batches() -> Iterator[Batch]:
        return iterate_batches(Batcher(sources.element_spec), sources.train, batch_size, cfg.drop_remainder)

    device = cfg.device
    ours = build_model(cfg.model, sources, cfg.optim, device)
    dense_optimizer = build_dense_optimizer(ours, cfg.optim)
    _, anchor_step = anchor_model(cfg, dict(sources.num_embeddings), sources.element_spec.dense_dim, device)
    stream_ours, stream_anchor, stream_data = batches(), batches(), batches()

    def on_device(batch: Batch) -> Batch:
        return batch if device == "cpu" else batch.to(device, non_blocking=True)

    impls = {
        "tritonrec DLRM (FusedEmbeddingBagCollection)": lambda: train_step(
            ours, dense_optimizer, on_device(next(stream_ours))
        ),
        "anchor: same DLRM, nn.EmbeddingBag + torch optimizer": lambda: anchor_step(on_device(next(stream_anchor))),
        "batch production only (source + Batcher)": lambda: next(stream_data),
    }
    print(f"device: {device}; anchor: the same DLRM over nn.EmbeddingBag tables, measured in this run")
    rows = []
    for name, fn in impls.items():
        timing = measure(fn, warmup=5, repeats=args.repeats, min_time_s=2.0, device=device)
        mean = mean_call_ms(fn, args.mean_calls, device)
        rows.append({
            "bench": "train_step", "experiment": cfg.name, "impl": name, "model": cfg.model.arch,
            "data": cfg.data.kind, "batch_size": batch_size, "backend": cfg.model.backend, **timing, "mean_ms": mean,
            "samples_per_s": batch_size / (mean * 1e-3),
            "load_1min": os.getloadavg()[0],  # other processes on the machine skew CPU timings: say so in the row
        })  # fmt: skip
    rows[0]["speedup_vs_anchor"] = rows[1]["mean_ms"] / rows[0]["mean_ms"]
    rows[1]["speedup_vs_anchor"] = 1.0
    rows[2]["speedup_vs_anchor"] = float("nan")
    columns = ["impl", "batch_size", "mean_ms", "median_ms", "p10_ms", "p90_ms", "samples_per_s", "speedup_vs_anchor"]
    print_table(rows, columns)
    if args.out:
        print("appended to", append_csv(args.out, rows, device=device))  # device column: the GPU's name


if __name__ == "__main__":
    main()
