"""Checkpoints of a training job: everything a resumed job needs to continue bit for bit.

One ``torch.save`` file holds the step, the model's state dict (dense layers and embedding tables), the fused
optimizer's state (per-row / per-element moments, next to the tables), the dense optimizer's state, the data position
(the Batcher's state), the history so far and the torch RNG state. Files are written to a temporary name and renamed,
so a job killed mid-write never leaves a truncated checkpoint behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tritonrec.data.batcher import Batcher
from tritonrec.dist.train.builders import embedding_collection
from tritonrec.dist.train.job_state import check_resume, check_resume_optim
from tritonrec.dist.train.loop import TrainHistory
from tritonrec.modules.dlrm import DLRMTrain

CHECKPOINT_FORMAT = 1
_KEYS = {"format", "step", "model", "fused_optimizer", "dense_optimizer", "data", "history", "rng"}


def save_checkpoint(
    path: str | Path,
    step: int,
    model: DLRMTrain,
    dense_optimizer: torch.optim.Optimizer,
    batcher: Batcher,
    history: TrainHistory,
    data_fingerprint: dict[str, Any] | None = None,
    batch_size: int | None = None,
    optim: dict[str, str] | None = None,
) -> Path:
    """Write the job's state after ``step`` steps to ``path`` (atomically); returns the path. ``data_fingerprint``
    (:func:`~tritonrec.dist.train.job_state.data_fingerprint`) and ``batch_size`` let a resume refuse changed data
    or another batch size (the saved data position counts batches of that size); ``optim``
    (:func:`~tritonrec.dist.train.job_state.optim_fingerprint`) other optimizer rules."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "fused_optimizer": embedding_collection(model).fused_optimizer.state_dict(),
        "dense_optimizer": dense_optimizer.state_dict(),
        "data": {
            "batcher": batcher.get_state(),
            "fingerprint": data_fingerprint,
            "batch_size": batch_size,
            "optim": optim,
        },
        "history": history.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)
    return path


def load_checkpoint(
    path: str | Path,
    model: DLRMTrain,
    dense_optimizer: torch.optim.Optimizer,
    batcher: Batcher,
    history: TrainHistory,
    steps: int | None = None,
    data_fingerprint: dict[str, Any] | None = None,
    batch_size: int | None = None,
    optim: dict[str, str] | None = None,
) -> int:
    """Restore a :func:`save_checkpoint` file into freshly built objects; returns the step it was taken at.

    With ``steps`` (the job's total) and ``data_fingerprint``, first refuses a resume that would train nothing or
    train on other data (:func:`~tritonrec.dist.train.job_state.check_resume`); with ``batch_size``, refuses another
    batch size than the checkpoint's (as the distributed job does at the same world size); with ``optim``, other
    optimizer rules."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"resume: no checkpoint file at {str(path)!r}")
    payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or set(payload) != _KEYS or payload["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"resume: {str(path)!r} is not a tritonrec training checkpoint (format {CHECKPOINT_FORMAT})")
    if steps is not None:
        saved = payload["data"].get("fingerprint")
        check_resume(str(path), int(payload["step"]), steps, saved, data_fingerprint or {})
    if optim is not None:
        check_resume_optim(str(path), payload["data"].get("optim"), optim)
    saved_batch = payload["data"].get("batch_size")  # None in checkpoints written before it was saved
    if batch_size is not None and saved_batch is not None and saved_batch != batch_size:
        raise ValueError(
            f"resume: {str(path)!r} trained batch_size={saved_batch}, this job has batch_size={batch_size}: set "
            f"batch_size={saved_batch} (the saved data position and the steps continued count batches of that size)"
        )
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as error:  # torch reports shape and key mismatches as RuntimeError
        raise ValueError(f"resume: {str(path)!r} does not fit this model (was the config changed?): {error}") from None
    embedding_collection(model).fused_optimizer.load_state_dict(payload["fused_optimizer"])
    dense_optimizer.load_state_dict(payload["dense_optimizer"])
    batcher.set_state(payload["data"]["batcher"])
    history.load_state_dict(payload["history"])
    torch.set_rng_state(payload["rng"]["torch"])
    return int(payload["step"])
