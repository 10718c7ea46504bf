"""Where the time of our GPU ops goes at small and medium sizes: per op, the wall time per call with value checks on
and off, the torch twin on the same CUDA tensors, stream syncs (``.item()``, ``.tolist()``, data-dependent output
sizes) and kernel launches per call, and the profiler's top host-side entries; with ``--train-step``, the same for
the default job's DLRM train step.

    python benchmarks/profile_gpu_ops.py [--calls 50] [--top 12] [--train-step]     # needs CUDA

Prints only (a diagnosis aid, not a benchmark of record: bench_jagged.py / bench_embedding.py are those).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from harness import mean_call_ms
from torch.profiler import ProfilerActivity, profile

from tritonrec.data import KeyedJaggedTensor
from tritonrec.kernels import (
    block_bucketize_sparse_features,
    jagged_to_padded_dense,
    lengths_to_offsets,
    permute_2d_sparse_data,
)
from tritonrec.kernels.checks import set_value_checks
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType


def cases(device: str, variants: int = 8) -> dict[str, Callable[[str], object]]:
    """name -> fn(backend), each call on the next of ``variants`` distinct inputs of a medium size (cycled, so no
    call reads what the previous one just touched)."""
    g = torch.Generator().manual_seed(0)
    tables = [EmbeddingBagConfig(num_embeddings=100_000, embedding_dim=64, name=f"t{t}", feature_names=[f"f{t}"])
              for t in range(8)]  # fmt: skip
    ebcs = {b: FusedEmbeddingBagCollection(tables, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.01}, device=device,
                                           backend=b) for b in ("triton", "torch")}  # fmt: skip
    block_sizes = torch.full((32,), -(-(10**6) // 8), dtype=torch.int64, device=device)

    def sparse() -> dict[str, torch.Tensor]:
        lengths = torch.randint(0, 40, (32, 512), generator=g, dtype=torch.int32)
        n = int(lengths.sum())
        out = {"lengths": lengths, "values": torch.randint(0, 10**6, (n,), generator=g),
               "weights": torch.rand(n, generator=g), "permute": torch.randperm(32, generator=g).int()}  # fmt: skip
        return {k: v.to(device) for k, v in out.items()}

    def jagged() -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.randint(0, 40, (512,), generator=g)
        return torch.randn(int(lengths.sum()), 64, generator=g).to(device), lengths_to_offsets(lengths).to(device)

    def kjt() -> KeyedJaggedTensor:
        lengths = torch.randint(0, 40, (8 * 512,), generator=g, dtype=torch.int32)
        ids = torch.randint(0, 100_000, (int(lengths.sum()),), generator=g)
        return KeyedJaggedTensor([f"f{t}" for t in range(8)], ids, lengths=lengths).to(device)

    sparse_in, jagged_in, kjt_in = (_cycle([make() for _ in range(variants)]) for make in (sparse, jagged, kjt))

    def permute(backend: str) -> object:
        x = sparse_in()
        return permute_2d_sparse_data(x["permute"], x["lengths"], x["values"], x["weights"], backend=backend)

    def bucketize(backend: str) -> object:
        x = sparse_in()
        return block_bucketize_sparse_features(x["lengths"].reshape(-1), x["values"], block_sizes, 8, x["weights"],
                                               True, True, backend=backend)  # fmt: skip

    def ebc_train(backend: str) -> object:
        out = ebcs[backend](kjt_in()).values()
        out.sum().backward()
        return out

    return {
        "permute_2d_sparse_data": permute,
        "jagged_to_padded_dense": lambda b: jagged_to_padded_dense(*jagged_in(), 40, backend=b),
        "block_bucketize": bucketize,
        "ebc_forward": lambda b: ebcs[b](kjt_in()).values(),
        "ebc_fwd_bwd_update": ebc_train,
        "kjt_permute": lambda b: kjt_in().permute(list(range(7, -1, -1))),
    }


def _cycle(items: list) -> Callable[[], object]:
    """A function returning ``items`` in turn, forever."""
    it = itertools.cycle(items)
    return lambda: next(it)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--train-step", action="store_true", help="also profile the default job's DLRM train step")
    args = parser.parse_args()
    for name, fn in cases("cuda").items():
        row = {}
        for label, backend, checks in (("triton", "triton", True), ("triton_nochecks", "triton", False),
                                       ("torch_twin", "torch", True)):  # fmt: skip
            set_value_checks(checks)
            try:
                row[label] = mean_call_ms(partial(fn, backend), args.calls, "cuda", warmup=3)
            except TypeError:  # an entry without a backend argument
                row[label] = (
                    mean_call_ms(partial(fn), args.calls, "cuda", warmup=3) if label == "triton" else float("nan")
                )
        set_value_checks(True)
        print(f"\n##### {name}: ms/call " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        call = partial(fn, "triton")
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        report(prof, 10, args.top)
    if args.train_step:
        profile_train_step(args.top)


def report(prof: profile, calls: int, top: int) -> None:
    """Stream syncs (``.item()``, ``.tolist()``, data-dependent sizes) and kernel launches per call, then the top
    host-side entries."""
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key == "cudaStreamSynchronize") / calls
    launches = sum(e.count for e in events if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC")) / calls  # fmt: skip
    print(f"stream syncs per call {syncs:.1f}, kernel launches per call {launches:.1f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def profile_train_step(top: int) -> None:
    """The default job's DLRM train step on CUDA (bench_train.py's ``tritonrec`` row), 10 profiled steps."""
    from hydra import compose, initialize_config_dir

    from tritonrec.data.batcher import Batcher
    from tritonrec.dist.train.builders import build_data, build_dense_optimizer, build_model
    from tritonrec.dist.train.config import as_train_config, register_configs
    from tritonrec.dist.train.loop import iterate_batches, train_step

    register_configs()
    configs = str(Path(__file__).resolve().parents[1] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = as_train_config(compose(config_name="train", overrides=["device=cuda"]))
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)  # as the job (and bench_train.py) run it
    sources = build_data(cfg.data)
    model = build_model(cfg.model, sources, cfg.optim, "cuda")
    optimizer = build_dense_optimizer(model, cfg.optim)
    stream = iterate_batches(Batcher(sources.element_spec), sources.train, cfg.batch_size, cfg.drop_remainder)
    step = lambda: train_step(model, optimizer, next(stream).to("cuda", non_blocking=True))
    ms = mean_call_ms(step, 30, "cuda", warmup=3)
    print(f"\n##### dlrm_train_step (default job, batch {cfg.batch_size}): {ms:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    report(prof, 10, top)


if __name__ == "__main__":
    main()
