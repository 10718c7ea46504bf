"""Distributed checkpoints of a sharded model: ``torch.distributed.checkpoint`` (DCP) files that load under another
plan and world size, published atomically, with a manifest of checksums.

What is saved (:mod:`tritonrec.dist.checkpoint_state`): the model's state dict (sharded tables as ShardedTensors),
the fused optimizers' state per table, every dense optimizer's state and hyperparameters, and any extra state (a data
position, a history). How files are published and verified: :mod:`tritonrec.dist.checkpoint_files`; the readers that
need no process group: :mod:`tritonrec.dist.checkpoint_read`; the collectives they run on:
:mod:`tritonrec.dist.checkpoint_ranks`.

Every rank calls each function at the same point (they are collectives over ``pg``, default the world; without an
initialised process group they run in this process alone)::

    manager = CheckpointManager("outputs/run/checkpoints", keep_last=3)
    manager.save(step, dmp, {"dense": dense_optimizer}, {"data": batcher})   # -> .../step_00000100
    loaded = manager.load(dmp, {"dense": dense_optimizer}, {"data": batcher})  # the latest; loaded.step

A checkpoint saved by 2 ranks under a table-wise plan loads into 4 ranks under a row-wise plan (DCP reads each
shard's region of the saved tables), into an unsharded model in a notebook (:func:`load_checkpoint` without a
process group), or as plain tensors (:func:`load_unsharded_checkpoint`). :func:`gather_unsharded_state_dict`
assembles a live sharded model's unsharded state dict on one rank (export for serving).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan

from tritonrec.dist.checkpoint_files import (
    CheckpointError,
    Manifest,
    check_files,
    data_files,
    describe_files,
    partial_path,
    publish,
    read_manifest,
    restore_all_replaced,
    sweep_partials,
    write_manifest,
)
from tritonrec.dist.checkpoint_ranks import Ranks as _Ranks
from tritonrec.dist.checkpoint_ranks import async_group as _async_group
from tritonrec.dist.checkpoint_read import as_path as _as_path
from tritonrec.dist.checkpoint_read import check_step as _check_step
from tritonrec.dist.checkpoint_read import dcp_quietly as _dcp_quietly
from tritonrec.dist.checkpoint_read import load_unsharded_checkpoint, read_extra_entry
from tritonrec.dist.checkpoint_read import reason as _reason
from tritonrec.dist.checkpoint_state import apply_loaded_state, build_state
from tritonrec.dist.model_parallel import DistributedModelParallel
from tritonrec.dist.sharded_state import gather_unsharded_state_dict
from tritonrec.kernels.checks import check_optional_int

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "PendingCheckpoint",
    "gather_unsharded_state_dict",
    "load_checkpoint",
    "load_unsharded_checkpoint",
    "read_extra_entry",
    "save_checkpoint",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _manifest_extra(model: nn.Module) -> dict[str, Any]:
    extra: dict[str, Any] = {"torch": torch.__version__}
    if isinstance(model, DistributedModelParallel):
        extra["plan"] = str(model.plan)
    return extra


def _finalize(staging: Path, final: Path, step: int | None, ranks: _Ranks, extra: dict[str, Any]) -> Path:
    """Hash the written files (each rank a share), write the manifest, publish (rank 0). Collective."""
    names = ranks.broadcast(data_files(staging) if ranks.rank == 0 else None)
    mine = describe_files(staging, [n for i, n in enumerate(names) if i % ranks.world == ranks.rank])
    described = ranks.gather(mine)

    def write_and_publish() -> None:
        files = {k: v for part in described for k, v in part.items()}
        write_manifest(staging, Manifest(step, ranks.world, files, extra=extra))
        publish(staging, final)

    ranks.on_rank0(write_and_publish)
    return final


def _prepare(final: Path, ranks: _Ranks) -> Path:
    staging = partial_path(final)

    def make() -> None:
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed save of this same checkpoint
        staging.mkdir(parents=True)

    ranks.on_rank0(make)
    return staging


def _discard(staging: Path, ranks: _Ranks) -> None:
    if ranks.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class PendingCheckpoint:
    """An asynchronous save: the files are being written in the background; :meth:`wait` (every rank, at the same
    point) finishes it - manifest and atomic publication - and returns the checkpoint's path."""

    future: Any
    staging: Path
    final: Path
    step: int | None
    ranks: _Ranks
    extra: dict[str, Any]
    done: bool = False

    def wait(self) -> Path:
        if self.done:
            return self.final
        upload = getattr(self.future, "upload_completion", self.future)
        try:
            try:
                upload.result()
            except CheckpointException as err:
                raise CheckpointError(f"saving checkpoint {str(self.final)!r} failed: {_reason(err)}") from err
            _finalize(self.staging, self.final, self.step, self.ranks, self.extra)
        except BaseException:
            _discard(self.staging, self.ranks)
            raise
        finally:
            self.done = True
        return self.final


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    pg: dist.ProcessGroup | None = None,
    async_save: bool = False,
) -> Path | PendingCheckpoint:
    """Save ``model`` (a DMP or any module), ``optimizers`` (name -> optimizer; fused ones are saved per table from
    the model) and ``extra_state`` into the directory ``path`` (see module docstring). Collective. ``async_save``:
    return a :class:`PendingCheckpoint` once the state is copied (``dcp.async_save``); its ``wait()`` publishes."""
    step = check_optional_int(step, "step", 0)
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be a bool, got async_save={async_save!r}")
    final = _as_path(path, "path")
    ranks = _Ranks(pg)
    state = build_state(model, optimizers, extra_state)
    staging = _prepare(final, ranks)
    extra = _manifest_extra(model)
    writer = dcp.FileSystemWriter(str(staging))
    try:
        if async_save:
            group = _async_group(pg) if ranks.distributed else None
            with _dcp_quietly():
                future = dcp.async_save(state, storage_writer=writer, process_group=group,
                                        no_dist=not ranks.distributed)  # fmt: skip
            return PendingCheckpoint(future, staging, final, step, ranks, extra)
        with _dcp_quietly():
            dcp.save(state, storage_writer=writer, process_group=ranks.pg, no_dist=not ranks.distributed)
        return _finalize(staging, final, step, ranks, extra)
    except CheckpointException as err:  # a BaseException: make it one that `except Exception` sees
        _discard(staging, ranks)
        raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {_reason(err)}") from err
    except BaseException:
        _discard(staging, ranks)
        raise


def verify_checkpoint(path: str | Path, pg: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest (each rank hashes a share); returns the manifest.
    Raises :class:`CheckpointError` naming the file and what is wrong. Collective."""
    directory = _as_path(path, "path")
    ranks = _Ranks(pg)
    manifest = ranks.on_rank0(lambda: read_manifest(directory))
    problems = check_files(directory, manifest["files"], lambda i: i % ranks.world == ranks.rank)
    found = [p for part in ranks.gather(problems) for p in part]
    found = ranks.broadcast(sorted(found))
    if found:
        more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
        raise CheckpointError(found[0] + more)
    return manifest  # type: ignore[no-any-return]


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner without its guess that a checkpoint holding keys this rank does not load was
    written by torch 2.3 (which then reads the keys in the old layout): a rank legitimately loads a subset, e.g. no
    optimizer step counter for a table of which it holds no row."""

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored: the step it was saved at, the extra state (objects restored in place,
    other values as loaded) and the manifest."""

    step: int | None
    extra_state: dict[str, Any]
    manifest: dict[str, Any]


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    *,
    pg: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Verify, then load a :func:`save_checkpoint` directory into ``model`` / ``optimizers`` / ``extra_state``, in
    place, whatever plan and world size saved it. Collective. ``verify=False`` skips hashing the files (the manifest
    is still read): for a checkpoint just verified, or storage with its own checksums."""
    path = _as_path(path, "path")
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got verify={verify!r}")
    ranks = _Ranks(pg)
    manifest = verify_checkpoint(path, pg) if verify else ranks.on_rank0(lambda: read_manifest(path))
    reader = dcp.FileSystemReader(str(path))
    state = build_state(model, optimizers, extra_state, set(reader.read_metadata().state_dict_metadata))
    try:
        with _dcp_quietly():
            dcp.load(state, storage_reader=reader, planner=_LoadPlanner(),
                     process_group=ranks.pg, no_dist=not ranks.distributed)  # fmt: skip
    except (Exception, CheckpointException) as err:  # DCP reports a missing key or another size like this
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model / optimizers: {_reason(err)}") from err
    extra = apply_loaded_state(state, model, optimizers, extra_state)
    return LoadedCheckpoint(manifest.get("step"), extra, manifest)


class CheckpointManager:
    """Checkpoints of one job under ``root``: ``step_<8 digits>/`` each (the train loop's API).

    Args:
        root: the directory holding the checkpoints (created on the first save).
        pg: the process group (default: the world; none in a single process).
        keep_last: keep only the newest ``keep_last`` checkpoints (``None``: keep all).
        async_save: save in the background (``dcp.async_save``); a save is published at the next :meth:`save`,
            :meth:`wait` or :meth:`load` (every rank calls them at the same points).
    """

    def __init__(
        self,
        root: str | Path,
        pg: dist.ProcessGroup | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> None:
        keep_last = check_optional_int(keep_last, "keep_last", 1)
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be a bool, got async_save={async_save!r}")
        self.root = _as_path(root, "root")
        self._pg = pg
        self._ranks = _Ranks(pg)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: PendingCheckpoint | None = None

        def clean_up() -> None:  # what a killed save left behind: first the old copy an overwrite moved aside
            restore_all_replaced(self.root)
            sweep_partials(self.root)

        self._ranks.on_rank0(clean_up)

    def path(self, step: int) -> Path:
        return self.root / f"step_{_check_step(step):08d}"

    def steps(self) -> list[int]:
        """Steps of the published checkpoints (directories with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        matches = [(_STEP_DIR.match(e.name), e) for e in self.root.iterdir()]
        return sorted(int(m.group(1)) for m, e in matches if m and (e / "manifest.json").is_file())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizers: Mapping[str, Any] | torch.optim.Optimizer | None = None,
        extra_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save after ``step`` steps; returns the checkpoint's path (async: where it will be published)."""
        _check_step(step)
        self.wait()
        result = save_checkpoint(self.path(step), model, optimizers, extra_state, step=step, pg=self._pg,
                                 async_save=self.async_save)  # fmt: skip
        if isinstance(result, PendingCheckpoint):
            self._pending = result
            return result.final
        self._prune()
        return result

    def wait(self) -> Path | None:
        """Finish a pending asynchronous save (collective); returns its path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        final = pending.wait()
        self._prune()
        return final

    def load(
        self,
        model: nn.Module,
        optimizers: Mapping[str, Any] | torch.optim.Optimizer | None = None,
        extra_state: Mapping[str, Any] | None = None,
        step: int | None = None,
        verify: bool = True,
    ) -> LoadedCheckpoint:
        """Load the checkpoint of ``step`` (default: the latest); ``verify``: as :func:`load_checkpoint`."""
        if step is not None:
            _check_step(step)
        self.wait()
        if step is None:
            step = self._ranks.broadcast(self.latest_step())
            if step is None:
                raise CheckpointError(f"no checkpoint under {str(self.root)!r}")
        return load_checkpoint(self.path(step), model, optimizers, extra_state, pg=self._pg, verify=verify)

    def _prune(self) -> None:
        if self.keep_last is None:
            return

        def prune() -> None:
            for step in self.steps()[: -self.keep_last]:
                shutil.rmtree(self.path(step), ignore_errors=True)

        self._ranks.on_rank0(prune)
