"""The tuning sweep behind ``scripts/autotune.py``: time every autotune config of every kernel an op launches, over a
grid of shapes, and record the fastest per autotune key in the tuned-file format of :mod:`tritonrec.kernels.tuned`.

For one op and one shape: build the inputs on the device, run the op once with its launches captured
(:mod:`~tritonrec.kernels.launch_capture`), then replay each autotuned launch under every config that fits it
(:func:`~tritonrec.kernels.launch_capture.candidate_configs`), straight into the jitted kernel as Triton's own
autotuner does, timed with CUDA events (median of ``reps`` after ``warmup``). In a dry run (CPU, interpreter) every
config is replayed once through the interpreter (so a config that cannot run fails the sweep) and nothing is timed.
Replays rerun kernels that update in place (the fused optimizer): only their time is used.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tritonrec import kernels as K
from tritonrec.kernels import backend, tuned
from tritonrec.kernels.embedding import OptimType, PoolingMode, TableBatchedLayout, TableSpec
from tritonrec.kernels.launch_capture import Launch, candidate_configs, capture_launches, kernel_name

T = "triton"
Shape = dict[str, int]


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _bags(batch: int, features: int, pooling: int, device: torch.device) -> torch.Tensor:
    """``[F * B + 1]`` int64 offsets of bags with lengths uniform in ``[0, 2 * pooling]``."""
    lengths = torch.randint(0, 2 * pooling + 1, (features * batch,), device=device, generator=_gen(device))
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def op_pooled(shape: Shape, device: torch.device) -> None:
    """Pooled lookup forward, dense backward and a fused rowwise-Adagrad step (T features of 64K-row tables)."""
    rows, features = shape.get("rows", 1 << 16), shape["features"]
    specs = [TableSpec(rows, shape["dim"], PoolingMode.SUM, f"t{i}") for i in range(features)]
    layout = TableBatchedLayout(specs, list(range(features)), [f"f{i}" for i in range(features)])
    offsets = _bags(shape["batch"], features, shape["pooling"], device)
    indices = torch.randint(0, rows, (int(offsets[-1]),), device=device, generator=_gen(device))
    weights = torch.randn(layout.num_weights, device=device, generator=_gen(device)).requires_grad_()
    K.pooled_embedding_lookup(weights, layout, indices, offsets, backend=T).sum().backward()
    state = K.create_fused_optimizer_state(layout, OptimType.EXACT_ROWWISE_ADAGRAD, device, lr=0.01)
    K.pooled_embedding_lookup(weights.detach(), layout, indices, offsets, fused=state, backend=T).sum().backward()


def op_sequence(shape: Shape, device: torch.device) -> None:
    rows, dim = 1 << 16, shape["dim"]
    layout = TableBatchedLayout([TableSpec(rows, dim, PoolingMode.SUM, "t")], [0], ["f"])
    indices = torch.randint(0, rows, (shape["values"],), device=device, generator=_gen(device))
    weights = torch.randn(layout.num_weights, device=device, generator=_gen(device)).requires_grad_()
    K.sequence_embedding_lookup(weights, layout, indices, [0, indices.numel()], backend=T).sum().backward()


def op_jagged(shape: Shape, device: torch.device) -> None:
    offsets = _bags(shape["batch"], 1, shape["max_len"] // 2, device)
    values = torch.randn(int(offsets[-1]), shape["dim"], device=device, generator=_gen(device))
    dense = K.jagged_to_padded_dense(values, offsets, shape["max_len"], backend=T)
    K.dense_to_jagged(dense, offsets, values.shape[0], backend=T)


def op_codecs(shape: Shape, device: torch.device) -> None:
    x = torch.randn(shape["rows"], shape["cols"], device=device, generator=_gen(device))
    row_dim = shape["row_dim"]
    K.dequantize_half(K.quantize_half(x, backend=T), backend=T)
    K.dequantize_fp8_rowwise(K.quantize_fp8_rowwise(x, row_dim, backend=T), row_dim, backend=T)
    K.dequantize_int8_rowwise(K.quantize_int8_rowwise(x, row_dim, backend=T), row_dim, backend=T)
    if row_dim % 2 == 0:
        K.dequantize_mx4(K.quantize_mx4(x, row_dim, backend=T), row_dim, backend=T)


def op_packing(shape: Shape, device: torch.device) -> None:
    sequences, length = shape["sequences"], shape["length"]
    lengths = torch.randint(1, length + 1, (sequences,), device=device, generator=_gen(device))
    order, bin_offsets = K.bin_assignment([[2 * b, 2 * b + 1] for b in range(sequences // 2)], device=device)
    plan = K.make_packing_plan(order, bin_offsets, lengths=lengths, padded_len=length)
    values = torch.randn(sequences, length, shape["dim"], device=device, generator=_gen(device))
    K.unpack_sequences(K.pack_sequences(values, plan, backend=T).tokens, plan, backend=T)


def op_sparse(shape: Shape, device: torch.device) -> None:
    """lengths_to_offsets and the 2-D permute over a [T, B] KJT (block_bucketize has no autotuned kernel)."""
    lengths = torch.randint(0, 2 * shape["pooling"] + 1, (shape["features"], shape["batch"]), device=device)
    values = torch.arange(int(lengths.sum()), device=device)
    permute = torch.randperm(shape["features"], device=device)
    K.permute_2d_sparse_data(permute, lengths, values, backend=T)


OPS: dict[str, Callable[[Shape, torch.device], None]] = {
    "pooled": op_pooled,
    "sequence": op_sequence,
    "jagged": op_jagged,
    "codecs": op_codecs,
    "packing": op_packing,
    "sparse": op_sparse,
}


@dataclass
class Trial:
    """One autotuned launch of one shape: its kernel, tuning key, candidate configs and their median times."""

    kernel: str
    key_names: list[str]
    key: str
    configs: list[Any]
    ms: list[float] | None


def _replay(launch: Launch, config: Any) -> None:
    """Run ``launch`` with ``config`` directly (no autotuning, no tuned file): the autotuner's own benchmark call."""
    launch.kernel.fn.run(*launch.args, grid=launch.grid, warmup=False, **launch.kwargs, **config.all_kwargs())


def _median_ms(run: Callable[[], None], warmup: int, reps: int, device: torch.device) -> float:
    """Median CUDA-event time of ``run`` in ms, each repetition after an L2 flush (as ``triton.testing.do_bench``):
    the flush also keeps the GPU busy while the host enqueues the launch, so host overhead is not timed."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for _ in range(warmup):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def tune_shape(op: str, shape: Shape, device: torch.device, dry_run: bool, warmup: int, reps: int) -> list[Trial]:
    """Every autotuned launch of ``op`` at ``shape``, each config timed (or, dry, run once)."""
    backend.set_autotune(False)  # the capture run takes the first config: no autotuning inside the sweep
    try:
        with capture_launches() as launches:
            OPS[op](shape, device)
    finally:
        backend.set_autotune(None)
    trials = []
    for launch in launches:
        if not hasattr(launch.kernel, "configs"):  # a plain jitted kernel: nothing to tune
            continue
        configs = candidate_configs(launch.kernel, launch.args, launch.kwargs)
        named = {**dict(zip(launch.kernel.arg_names, launch.args, strict=False)), **launch.kwargs}
        key = tuned.tuning_key(launch.kernel.keys, named)
        if dry_run:
            for config in configs:
                _replay(launch, config)
            trials.append(Trial(kernel_name(launch.kernel), list(launch.kernel.keys), key, configs, None))
        else:
            ms = [_median_ms(lambda c=c, run=launch: _replay(run, c), warmup, reps, device) for c in configs]
            trials.append(Trial(kernel_name(launch.kernel), list(launch.kernel.keys), key, configs, ms))
    return trials


def merge_trials(table: dict[str, Any], trials: list[Trial], shape_label: str) -> None:
    """Fold ``trials`` into a tuned-file ``kernels`` table: per kernel the union of the configs tried, per tuning key
    the times summed over the shapes sharing the key and the config with the least total (the first, dry)."""
    for trial in trials:
        entry = table.setdefault(trial.kernel, {"key": trial.key_names, "configs": [], "choices": {}})
        records = [tuned.config_record(c) for c in trial.configs]
        for record in records:
            if record not in entry["configs"]:
                entry["configs"].append(record)
        index = [entry["configs"].index(r) for r in records]
        choice = entry["choices"].setdefault(trial.key, {"config": index[0], "shapes": []})
        if shape_label not in choice["shapes"]:
            choice["shapes"].append(shape_label)
        if trial.ms is not None:
            totals = {int(i): ms for i, ms in choice.get("ms", {}).items()}
            for i, ms in zip(index, trial.ms, strict=True):
                totals[i] = totals.get(i, 0.0) + ms
            choice["ms"] = {str(i): round(ms, 6) for i, ms in sorted(totals.items())}
            choice["config"] = min(totals, key=totals.__getitem__)


def tuned_file(kernels: dict[str, Any], device_name: str, dry_run: bool) -> dict[str, Any]:
    """The tuned-file document for ``kernels`` (see :mod:`tritonrec.kernels.tuned`)."""
    import triton

    return {"version": tuned.FORMAT_VERSION, "device": device_name, "triton": triton.__version__,
            "torch": torch.__version__, "dry_run": dry_run, "kernels": kernels}  # fmt: skip
