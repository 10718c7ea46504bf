"""Kernel tuning sweep: time every autotune config of every kernel an op launches over a grid of shapes, and write
the fastest per autotune key to ``tuned/<device-name>.json``, which the kernels read at their first launch on that
device (see :mod:`tritonrec.kernels.tuned`).

    python scripts/autotune.py                                            # GPU: every op, production shapes
    python scripts/autotune.py -m op=pooled,codecs autotune_shapes=small,production
    python scripts/autotune.py dry_run=true autotune_shapes=dry           # CPU: validate configs, write the structure

Per run, in the hydra run dir: ``<op>.csv`` (one row per shape, kernel, tuning key and config: median ms over
``reps`` CUDA-event-timed launches after ``warmup``, and whether it was chosen), ``<op>.png`` (time per config across
shapes, the chosen config marked) and ``tuned/<device-name>.json``; the choices are also merged into
``${tuned_dir}/<device-name>.json`` (shared by the jobs of a multirun) and, with ``install=true``, into the copy that
ships with the package. Without CUDA only ``dry_run=true`` runs: each config once under the Triton interpreter.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

if not torch.cuda.is_available():  # CPU: a dry run through the interpreter, which must be on before the kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonrec.kernels import autotune_sweep, tuned


@dataclass
class AutotuneConfig:
    """One sweep (``configs/autotune.yaml``; shape grids in ``configs/autotune_shapes/``)."""

    op: str = "all"  # one of autotune_sweep.OPS, or "all"
    shapes: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # op -> {dimension: values}, a product
    dry_run: bool = False  # run each config once (interpreter on CPU), time nothing, record the first config
    warmup: int = 5  # untimed launches per config and shape
    reps: int = 25  # timed launches per config and shape (median)
    tuned_dir: str = "outputs/autotune/tuned"  # <device-name>.json accumulates here across runs
    install: bool = False  # also merge into kernels/tuned/<device-name>.json (the shipped copy)
    plot: bool = True  # <op>.png per op (needs matplotlib; skipped in a dry run: nothing is timed)
    out_dir: str = ""  # defaults to the hydra run dir (or the current dir without hydra)


def check_config(cfg: AutotuneConfig) -> list[str]:
    """The ops to tune; raises naming the field on a bad config."""
    ops = list(autotune_sweep.OPS) if cfg.op == "all" else [cfg.op]
    unknown = [op for op in ops if op not in autotune_sweep.OPS]
    if unknown:
        raise ValueError(f"op must be 'all' or one of {list(autotune_sweep.OPS)}, got op={cfg.op!r}")
    missing = [op for op in ops if not cfg.shapes.get(op)]
    if missing:
        raise ValueError(f"shapes has no grid for {missing}; pick autotune_shapes=... or set shapes.<op>")
    if cfg.warmup < 0 or cfg.reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1, got warmup={cfg.warmup}, reps={cfg.reps}")
    if not cfg.dry_run and not torch.cuda.is_available():
        raise ValueError("timing configs needs a CUDA device; on CPU run dry_run=true")
    return ops


def shape_points(grid: dict[str, list[int]]) -> list[dict[str, int]]:
    """Every combination of the grid's values, e.g. ``{"batch": [1, 2], "dim": [8]}`` -> two shapes."""
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(grid[n] for n in names))]


def _label(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def _merge_into(path: Path, document: dict[str, Any]) -> None:
    """Merge ``document``'s kernels into the tuned file at ``path`` (created if absent): new keys added, re-tuned
    keys replaced."""
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("device") == document["device"] and old.get("version") == document["version"]:
            for name, entry in document["kernels"].items():
                previous = old["kernels"].get(name)
                if previous and previous["configs"] == entry["configs"]:
                    entry["choices"] = {**previous["choices"], **entry["choices"]}
            document = {**document, "kernels": {**old["kernels"], **document["kernels"]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = sorted({r["kernel"] for r in rows})
    fig, axes = plt.subplots(len(kernels), 1, figsize=(10, 3.2 * len(kernels)), squeeze=False)
    for ax, kernel in zip(axes[:, 0], kernels, strict=True):
        mine = [r for r in rows if r["kernel"] == kernel]
        points = list(dict.fromkeys((r["shape"], r["key"]) for r in mine))
        x_of = {p: i for i, p in enumerate(points)}
        for config in dict.fromkeys(r["config"] for r in mine):
            ran = [r for r in mine if r["config"] == config]
            ax.plot([x_of[r["shape"], r["key"]] for r in ran], [r["ms"] for r in ran], marker=".", lw=1, label=config)
        chosen = [r for r in mine if r["chosen"]]
        ax.scatter([x_of[r["shape"], r["key"]] for r in chosen], [r["ms"] for r in chosen], s=90, facecolors="none",
                   edgecolors="k", zorder=3)  # fmt: skip
        ax.set_title(f"{kernel.split(':')[1]} (circled: chosen)", fontsize=9)
        ax.set_ylabel("ms")
        ax.set_xticks(range(len(points)), [p[0] for p in points], rotation=60, fontsize=6, ha="right")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: DictConfig | AutotuneConfig) -> dict[str, Any]:
    """Tune the configured ops; returns ``{"device", "tuned_file", "kernels", "keys", "rows"}``."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    ops = check_config(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out_dir = Path(cfg.out_dir or _hydra_dir())
    table: dict[str, Any] = {}
    all_rows = []
    for op in ops:
        rows = []
        for shape in shape_points(cfg.shapes[op]):
            label = _label(shape)
            try:
                trials = autotune_sweep.tune_shape(op, shape, device, cfg.dry_run, cfg.warmup, cfg.reps)
            except torch.cuda.OutOfMemoryError:
                print(f"skipped {op} at {label}: out of GPU memory")
                torch.cuda.empty_cache()
                continue
            autotune_sweep.merge_trials(table, trials, label)
            for trial in trials:
                for i, config in enumerate(trial.configs):
                    rows.append({"op": op, "shape": label, "kernel": trial.kernel, "key": trial.key,
                                 "config": str(tuned.config_record(config)),
                                 "ms": "" if trial.ms is None else round(trial.ms[i], 6)})  # fmt: skip
        for row in rows:  # chosen: the config the merged table picked for the row's key
            choice = table[row["kernel"]]["choices"][row["key"]]
            row["chosen"] = str(table[row["kernel"]]["configs"][choice["config"]]) == row["config"]
        _write_csv(out_dir / f"{op}.csv", rows)
        if cfg.plot and not cfg.dry_run:
            _plot(rows, out_dir / f"{op}.png")
        all_rows += rows
    document = autotune_sweep.tuned_file(table, device_name, cfg.dry_run)
    file_name = tuned.device_file_name(device_name)
    _merge_into(out_dir / "tuned" / file_name, document)
    _merge_into(Path(cfg.tuned_dir) / file_name, document)
    if cfg.install:
        _merge_into(tuned.TUNED_DIR / file_name, document)
    keys = sum(len(e["choices"]) for e in table.values())
    print(f"{len(table)} kernels, {keys} tuning keys -> {Path(cfg.tuned_dir) / file_name}")
    return {"device": device_name, "tuned_file": str(out_dir / "tuned" / file_name), "kernels": len(table),
            "keys": keys, "rows": len(all_rows)}  # fmt: skip


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "shape", "kernel", "key", "config", "ms", "chosen"])
        writer.writeheader()
        writer.writerows(rows)


def _hydra_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "."


ConfigStore.instance().store(name="autotune_schema", node=AutotuneConfig)


@hydra.main(config_path="../configs", config_name="autotune", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
