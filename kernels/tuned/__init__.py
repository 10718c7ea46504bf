"""Tuned launch configs per device: ``kernels/tuned/<device-name>.json``, written by ``scripts/autotune.py``.

The files live in this package's own folder and ship as its package data.

The file of the current CUDA device (``torch.cuda.get_device_name()``, lower-cased, non-alphanumerics as ``-``) is
read once, when the first autotuned kernel launches (not at import: asking for the device name initialises CUDA,
which must not happen in a process that later forks data workers). ``TRITONREC_TUNED=<path>`` reads that file
instead; ``TRITONREC_TUNED=off`` (or a missing file) keeps runtime autotuning as it was.

Format (``version`` 1)::

    {"version": 1, "device": "NVIDIA H100 80GB HBM3", "triton": "3.9.0", "dry_run": false,
     "kernels": {"<module>:<kernel>": {
         "key": ["L_BUCKET", "D_BUCKET", "BLOCK_D"],
         "configs": [{"kwargs": {"BLOCK_L": 16}, "num_warps": 4, "num_stages": 3}, ...],
         "choices": {"<tuning key>": {"config": 0, "shapes": ["..."], "ms": {"0": 0.011, "1": 0.013}}}}}}

``configs`` lists every config the sweep timed; ``choices[key].config`` indexes it and ``ms`` maps config indices
to their median times summed over the ``shapes`` that share the key (absent in a dry run, where the first config is
recorded). A tuning key is ``name=value`` for each
autotune key argument then the dtypes of the tensor arguments, as Triton keys its own cache. A launch whose key was
not tuned takes the tuned entry with the same dtypes and the same non-bucket values (flags, tile widths) whose
``*_BUCKET`` values are nearest in log2 distance; with no such entry, or when the recorded config no longer exists,
the kernel autotunes as if there were no file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

TUNED_DIR = Path(__file__).parent
FORMAT_VERSION = 1


def device_file_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3.json"``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


def tuned_path() -> Path | None:
    """The tuned file this process reads (see the module docstring), or None."""
    override = os.environ.get("TRITONREC_TUNED")
    if override is not None:
        return None if override.lower() in ("", "0", "off", "none") else Path(override)
    if not torch.cuda.is_available():
        return None
    return TUNED_DIR / device_file_name(torch.cuda.get_device_name())


@functools.cache
def _load(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    table = json.loads(path.read_text())
    if table.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: tuned file version {table.get('version')!r}, expected {FORMAT_VERSION}")
    return table.get("kernels", {})


def tuned_kernels() -> dict[str, Any]:
    """``{kernel name: entry}`` of the tuned file in effect (empty without one)."""
    return _load(tuned_path())


def tuning_key(key: Sequence[str], args: dict[str, Any]) -> str:
    """``"L_BUCKET=1024,BLOCK_D=64|torch.float32,torch.int64"``: the autotune key values, then tensor dtypes."""
    values = ",".join(f"{name}={_plain(args[name])}" for name in key if name in args)
    dtypes = ",".join(str(v.dtype) for v in args.values() if hasattr(v, "dtype") and hasattr(v, "data_ptr"))
    return f"{values}|{dtypes}"


def _plain(value: Any) -> Any:
    return int(value) if isinstance(value, bool) else value


def _parse(key: str) -> tuple[dict[str, str], str]:
    values, _, dtypes = key.partition("|")
    return dict(item.split("=", 1) for item in values.split(",") if item), dtypes


def _distance(a: dict[str, str], b: dict[str, str]) -> float | None:
    """log2 distance over ``*_BUCKET`` fields; None when another field differs."""
    if a.keys() != b.keys():
        return None
    total = 0.0
    for name, value in a.items():
        if name.endswith("_BUCKET"):
            total += abs(math.log2(max(int(value), 1)) - math.log2(max(int(b[name]), 1)))
        elif value != b[name]:
            return None
    return total


def nearest_choice(choices: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The choice recorded for ``key``, else the nearest compatible one (module docstring), else None."""
    if key in choices:
        return choices[key]
    want, dtypes = _parse(key)
    best, best_distance = None, math.inf
    for other, choice in choices.items():
        values, other_dtypes = _parse(other)
        distance = _distance(want, values) if other_dtypes == dtypes else None
        if distance is not None and distance < best_distance:
            best, best_distance = choice, distance
    return best


def config_record(config: Any) -> dict[str, Any]:
    """A ``triton.Config`` as stored in the tuned file."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def tuned_config(name: str, key: str, candidates: list[Any]) -> Any | None:
    """The candidate config the tuned file chose for kernel ``name`` at tuning ``key``, or None."""
    entry = tuned_kernels().get(name)
    if not entry:
        return None
    choice = nearest_choice(entry.get("choices", {}), key)
    if choice is None:
        return None
    record = entry["configs"][choice["config"]]
    for config in candidates:
        if config_record(config) == record:
            return config
    return None
