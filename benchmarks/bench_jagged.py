"""Jagged ops on CPU: our torch twin (the CPU path) vs FBGEMM's CPU op (when ``fbgemm-gpu-cpu`` is installed) or a
torch built-in, measured in the same run; with CUDA, the Triton kernel vs the device copy bandwidth.

    python benchmarks/bench_jagged.py [--repeats 20] [--out jagged_cpu.csv] [--plot]

Every row reports milliseconds and GB/s (bytes read + written by the op) for ours and the anchor, and their ratio
(anchor time / our time: > 1 means we are faster).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from harness import append_csv, copy_bandwidth_gbps, device_name, gbps, measure, print_table, tensor_bytes

from tritonrec.kernels import (
    block_bucketize_sparse_features,
    jagged_to_padded_dense,
    lengths_to_offsets,
    permute_2d_sparse_data,
)

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    HAS_FBGEMM = True
except Exception:  # the anchor is optional; any import failure means "not installed"
    HAS_FBGEMM = False


@dataclass
class Case:
    op: str
    shape: str
    ours: Callable[[], object]
    anchor: Callable[[], object]
    anchor_name: str
    num_bytes: int


def _lengths(num_keys: int, batch: int, max_len: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, max_len, (num_keys, batch), generator=gen, dtype=torch.int32)


def permute_cases(device: str, gen: torch.Generator) -> list[Case]:
    cases = []
    for num_keys, batch, max_len in ((8, 64, 10), (32, 512, 40), (100, 2048, 40)):
        lengths = _lengths(num_keys, batch, max_len, gen).to(device)
        n = int(lengths.sum())
        values = torch.randint(0, 10**6, (n,), generator=gen).to(device)
        weights = torch.rand(n, generator=gen).to(device)
        permute = torch.randperm(num_keys, generator=gen).to(device=device, dtype=torch.int32)
        ours = partial(permute_2d_sparse_data, permute, lengths, values, weights)
        if HAS_FBGEMM and device == "cpu":
            anchor = partial(torch.ops.fbgemm.permute_2D_sparse_data, permute, lengths, values, weights, None)
            name = "fbgemm.permute_2D_sparse_data"
        else:
            index = _permute_gather_index(permute, lengths)
            anchor = lambda v=values, w=weights, i=index: (v.index_select(0, i), w.index_select(0, i))
            name = "torch.index_select (index precomputed)"
        cases.append(Case("permute_2d_sparse_data", f"T={num_keys} B={batch} L~U[0,{max_len})", ours, anchor, name,
                          2 * tensor_bytes(values, weights, lengths)))  # fmt: skip
    return cases


def _permute_gather_index(permute: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    key_len = lengths.sum(1, dtype=torch.int64)
    starts = lengths_to_offsets(key_len, backend="torch")[:-1]
    spans = [torch.arange(starts[k], starts[k] + key_len[k], device=lengths.device) for k in permute.tolist()]
    return torch.cat(spans)


def jagged_to_dense_cases(device: str, gen: torch.Generator) -> list[Case]:
    cases = []
    for batch, max_len, dim in ((64, 10, 3), (512, 40, None), (512, 40, 64), (4096, 40, 16)):
        lengths = torch.randint(0, max_len, (batch,), generator=gen)
        offsets = lengths_to_offsets(lengths).to(device)
        n = int(lengths.sum())
        values = torch.randn((n,) if dim is None else (n, dim), generator=gen).to(device)
        ours = lambda v=values, o=offsets, m=max_len: jagged_to_padded_dense(v, o, m)
        if HAS_FBGEMM and device == "cpu":
            anchor = lambda v=values, o=offsets, m=max_len: torch.ops.fbgemm.jagged_to_padded_dense(v, [o], [m], 0.0)
            name = "fbgemm.jagged_to_padded_dense"
        else:
            nested = torch.nested.nested_tensor_from_jagged(values if dim else values[:, None], offsets)
            anchor = lambda nt=nested, m=max_len, b=batch: nt.to_padded_tensor(0.0, (b, m, nt.shape[-1]))
            name = "torch.nested to_padded_tensor"
        out_bytes = batch * max_len * (dim or 1) * values.element_size()
        cases.append(Case("jagged_to_padded_dense", f"B={batch} L~U[0,{max_len}) D={dim or '-'}", ours, anchor, name,
                          tensor_bytes(values, offsets) + out_bytes))  # fmt: skip
    return cases


def bucketize_cases(device: str, gen: torch.Generator) -> list[Case]:
    cases = []
    for num_keys, batch, max_len, buckets in ((8, 64, 10, 2), (32, 512, 40, 8), (26, 2048, 40, 32)):
        lengths = _lengths(num_keys, batch, max_len, gen).reshape(-1).to(device)
        n = int(lengths.sum())
        rows = 10**6
        indices = torch.randint(0, rows, (n,), generator=gen).to(device)
        weights = torch.rand(n, generator=gen).to(device)
        block_sizes = torch.full((num_keys,), -(-rows // buckets), dtype=torch.int64, device=device)
        ours = partial(block_bucketize_sparse_features, lengths, indices, block_sizes, buckets, weights, True, True)
        if HAS_FBGEMM and device == "cpu":
            anchor = partial(
                torch.ops.fbgemm.block_bucketize_sparse_features, lengths, indices, True, True, block_sizes, buckets,
                weights,
            )  # fmt: skip
            name = "fbgemm.block_bucketize_sparse_features"
        else:
            anchor = lambda i=indices, b=block_sizes: torch.sort(torch.div(i, b[0], rounding_mode="floor"), stable=True)
            name = "torch.sort of buckets (lower bound of a sort-based approach)"
        moved = 2 * tensor_bytes(lengths, indices, weights) + 3 * indices.numel() * 8  # + positions, permutation
        shape = f"T={num_keys} B={batch} L~U[0,{max_len}) W={buckets}"
        cases.append(Case("block_bucketize_sparse_features", shape, ours, anchor, name, moved))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="CSV file under benchmarks/results/ (default: jagged_<device>.csv)")
    parser.add_argument("--plot", action="store_true", help="also write a PNG of the ratios next to the CSV")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = (
        permute_cases(args.device, gen) + jagged_to_dense_cases(args.device, gen) + bucketize_cases(args.device, gen)
    )
    copy_gbps = copy_bandwidth_gbps(64 << 20, args.device)
    print(f"device: {args.device}; anchor: {'FBGEMM CPU ops' if HAS_FBGEMM else 'torch built-ins'}; "
          f"same-run copy bandwidth {copy_gbps:.1f} GB/s")  # fmt: skip
    rows = []
    for case in cases:
        ours = measure(case.ours, repeats=args.repeats, device=args.device)
        anchor = measure(case.anchor, repeats=args.repeats, device=args.device)
        rows.append({
            "op": case.op, "shape": case.shape, "ours_ms": ours["median_ms"], "ours_p10_ms": ours["p10_ms"],
            "ours_p90_ms": ours["p90_ms"], "ours_gbps": gbps(case.num_bytes, ours["median_ms"]),
            "anchor": case.anchor_name, "anchor_ms": anchor["median_ms"],
            "anchor_gbps": gbps(case.num_bytes, anchor["median_ms"]),
            "speedup_vs_anchor": anchor["median_ms"] / ours["median_ms"],
            "ours_pct_of_copy_bw": 100 * gbps(case.num_bytes, ours["median_ms"]) / copy_gbps,
        })  # fmt: skip
    print_table(rows, ["op", "shape", "ours_ms", "anchor_ms", "speedup_vs_anchor", "ours_gbps", "anchor"])
    path = append_csv(args.out or f"jagged_{args.device}.csv", rows, device=args.device)
    print(f"appended {len(rows)} rows to {path}")
    if args.plot:
        _plot(rows, path.with_suffix(".png"), device_name(args.device))


def _plot(rows: list[dict], path: object, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op'].split('_')[0]}\n{r['shape']}" for r in rows]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.bar(range(len(rows)), [float(r["speedup_vs_anchor"]) for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("anchor time / our time (>1: ours faster)")
    anchors = "FBGEMM's ops" if rows[0]["anchor"].startswith("fbgemm") else "torch built-ins"
    ax.set_title(f"tritonrec jagged ops vs {anchors} on {device} (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
