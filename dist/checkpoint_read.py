"""Checkpoint helpers that need no process group: argument checks, DCP's error and warnings, and the readers a
single process uses - one extra-state entry (a job's step before it builds anything) and a whole checkpoint as plain
tensors (a notebook, serving). See :mod:`tritonrec.dist.checkpoint`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tritonrec.dist.checkpoint_files import CheckpointError, check_files, read_manifest
from tritonrec.kernels.checks import check_int


def as_path(value: object, argument: str) -> Path:
    """``value`` as a Path; a clear error naming ``argument`` for anything else (pathlib's names neither)."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    raise TypeError(f"{argument} must be a non-empty str or os.PathLike, got {argument}={value!r}")


def check_step(step: object, argument: str = "step") -> int:
    return check_int(step, argument, 0)


@contextlib.contextmanager
def dcp_quietly() -> Iterator[None]:
    """DCP warns that it assumes a single process whenever no process group is initialised (that is the intent),
    and that ShardedTensor is deprecated each time it meets one (the sharded tables' form: see sharded_state)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def reason(err: BaseException) -> str:
    """The first rank's error of a DCP ``CheckpointException`` (it holds every rank's, with tracebacks)."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (first, _) = min(err.failures.items(), key=lambda item: item[0])
        return f"{type(first).__name__}: {first} (rank {rank})"
    return f"{type(err).__name__}: {err}"


def read_extra_entry(path: str | Path, name: str) -> bytes:
    """One entry of a checkpoint's extra state (``extra_state[name]`` at save), read alone in this process: no
    process group and no model (a job reads its step and data fingerprint before building either)."""
    directory = as_path(path, "path")
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got name={name!r}")
    manifest = read_manifest(directory)  # a missing, unfinished or foreign checkpoint: its own clear error
    reader = dcp.FileSystemReader(str(directory))
    saved = sorted(k[len("extra.") :] for k in reader.read_metadata().state_dict_metadata if k.startswith("extra."))
    if name not in saved:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} (step {manifest.get('step')}) has no extra state entry {name!r} "
            f"(it has {saved}): it was saved without extra_state[{name!r}]"
        )
    state: dict[str, Any] = {"extra": {name: b""}}
    try:
        with dcp_quietly():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointException as err:  # a BaseException: make it one that `except Exception` sees
        raise CheckpointError(
            f"reading extra state entry {name!r} of checkpoint {str(directory)!r} failed: {reason(err)}"
        ) from err
    return state["extra"][name]  # type: ignore[no-any-return]


def load_unsharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint as plain full tensors, in this process (no process group; for a notebook or serving):
    ``{"model": {key: tensor}, "fused_optimizer": {path: {table: {state: tensor}}}, "optimizers": {...},
    "extra": {name: bytes}, ...}``, verified first."""
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    directory = as_path(path, "path")
    manifest = read_manifest(directory)
    problems = check_files(directory, manifest["files"], lambda i: True)
    if problems:
        raise CheckpointError(problems[0])
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp_metadata.TensorStorageMetadata):
            flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[fqn] = None
    with dcp_quietly():
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    state = unflatten_state_dict(flat, metadata.planner_data)
    state["fused_hyperparameters"] = {k: json.loads(v) for k, v in state.get("fused_hyperparameters", {}).items()}
    for entry in state.get("optimizers", {}).values():
        entry["param_groups"] = json.loads(entry["param_groups"])
    state["extra"] = {k: torch.load(io.BytesIO(v), weights_only=False) for k, v in state.get("extra", {}).items()}
    return state  # type: ignore[no-any-return]


__all__ = ["as_path", "check_step", "dcp_quietly", "load_unsharded_checkpoint", "read_extra_entry", "reason"]
