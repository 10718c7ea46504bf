"""``run(cfg) -> metrics``: the training job, whatever launched it (``scripts/train.py`` is a thin ``@hydra.main``
around it; tests and notebooks call it directly with a composed DictConfig or a :class:`TrainConfig`).

* one process (``dist.nproc=1``, no torchrun): the single-process job (:mod:`.single`);
* under ``torchrun --nproc_per_node N``: this process is one rank of the distributed job (:mod:`.distributed`);
  gloo on CPU, NCCL on CUDA; rank 0 owns the output folder, prints the bar and writes the results;
* ``dist.nproc=N`` without torchrun: spawns N local ranks and returns rank 0's metrics;
* resuming a distributed checkpoint (a ``checkpoints/step_<n>/`` folder) in one process runs the distributed job on
  one rank.

The output folder is created and checked writable before anything is built or trained. SIGTERM makes every rank
finish its step, write a final checkpoint and metrics.json, and return (``metrics["stopped_by"] == "SIGTERM"``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from tritonrec.dist.side_groups import group_timeout
from tritonrec.dist.train.config import TrainConfig, as_train_config, check_device
from tritonrec.dist.train.launch import (
    StopRequest,
    init_process_group,
    rank_device,
    resolve_backend,
    spawn,
    torchrun_world_size,
)

# what a job writes into its folder; any of them (a non-empty file, a folder with entries) marks an earlier run
RESULT_NAMES = ("metrics.json", "checkpoints", "series.csv", "tensorboard", "curves.png", "train.log")


def earlier_results(path: Path) -> list[str]:
    """The results of an earlier job in folder ``path`` (names from :data:`RESULT_NAMES`)."""
    found = []
    for name in RESULT_NAMES:
        entry = path / name
        if (entry.is_dir() and any(entry.iterdir())) or (entry.is_file() and entry.stat().st_size > 0):
            found.append(name)
    return found


def _continues_in(path: Path, resume: str | None) -> bool:
    """True when ``resume`` is one of ``path``'s own checkpoints (the job continues the run of that folder)."""
    return bool(resume) and Path(resume).resolve().parent == (path / "checkpoints").resolve()  # type: ignore[arg-type]


def check_output_dir(path: Path, resume: str | None = None) -> Path:
    """Create ``path`` and prove it writable now (not after hours of training). A folder holding another run's
    results is refused unless ``resume`` is one of its checkpoints: a new run there would append to that run's log
    and series and leave its later checkpoints next to the new ones (hydra gives each run a fresh folder; this
    catches an explicit ``output_dir`` used twice)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as error:
        raise ValueError(f"output_dir {str(path)!r} is not writable: {error}") from None
    found = earlier_results(path)
    if found and not _continues_in(path, resume):
        raise ValueError(
            f"output_dir {str(path)!r} already holds another run's results ({', '.join(found)}): this run would mix "
            "its log, series and checkpoints with them. Choose a new output_dir, delete those files, or continue "
            f"that run with resume=<one of {str(path / 'checkpoints')!r}/step_*>"
        )
    return path


@contextlib.contextmanager
def _threads(num_threads: int) -> Iterator[None]:
    """``num_threads`` intra-op threads while the job runs (the setting is process-wide: the caller's comes back)."""
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _is_distributed_checkpoint(resume: str | None) -> bool:
    return bool(resume) and Path(resume).is_dir()  # type: ignore[arg-type]


def run(cfg: DictConfig | TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says (see module docstring); returns the metrics (rank 0's in a distributed job, None on the
    other ranks of a torchrun job)."""
    cfg = as_train_config(cfg)
    launched = torchrun_world_size()
    if launched is not None:
        if cfg.dist.nproc > 1 and cfg.dist.nproc != launched:
            raise ValueError(
                f"dist.nproc={cfg.dist.nproc} but torchrun started {launched} rank(s): torchrun decides the ranks, "
                f"so set dist.nproc={launched} (or leave it at 1)"
            )
        if launched > 1 or _is_distributed_checkpoint(cfg.resume):
            return run_rank(cfg)  # type: ignore[return-value]
    elif cfg.dist.nproc > 1 or _is_distributed_checkpoint(cfg.resume):
        # the ranks would check these too, but here no rank has started yet (one error, no rank's traceback)
        resolve_backend(cfg.dist.backend, check_device(cfg.device))
        precheck_ranks(cfg, cfg.dist.nproc)
        if cfg.resume:
            from tritonrec.dist.train.distributed import precheck_resume

            precheck_resume(cfg, cfg.dist.nproc)
        out_dir = check_output_dir(Path(cfg.output_dir) if cfg.output_dir else Path.cwd(), cfg.resume)
        cfg.output_dir = str(out_dir.resolve())
        return spawn(run_rank, cfg.dist.nproc, cfg)  # type: ignore[no-any-return]
    out_dir = check_output_dir(Path(cfg.output_dir) if cfg.output_dir else Path.cwd(), cfg.resume)
    from tritonrec.dist.train.single import train_single

    with _threads(cfg.num_threads), StopRequest().installed() as stop:
        return train_single(cfg, out_dir, stop)


def precheck_ranks(cfg: TrainConfig, world: int) -> None:
    """What the ranks of a ``world``-rank job would otherwise find wrong only after they spawned (and planned): the
    data sources' own argument checks and files (synthetic and TSV sources are built here, which reads nothing
    ahead; of npy days only the files' presence is checked, since opening one validates all its ids, which the
    ranks do), column-wise sharding's split of ``model.embedding_dim``, and the tensorboard package of
    ``logger=tensorboard``."""
    from tritonrec.data.criteo_npy import check_day_files
    from tritonrec.dist.train.builders import build_data
    from tritonrec.dist.train.config import CriteoNPYDataConfig
    from tritonrec.dist.train.dist_builders import check_column_wise
    from tritonrec.dist.train.loggers import tensorboard_writer_class

    if isinstance(cfg.data, CriteoNPYDataConfig) and cfg.data.prefixes:
        for prefix in [*cfg.data.prefixes, *cfg.data.eval_prefixes]:
            check_day_files(prefix)
    else:
        build_data(cfg.data, rank=0, world_size=world)
    if cfg.sharding.kind == "cw":
        check_column_wise({cfg.model.embedding_dim}, world)
    if cfg.logger.kind == "tensorboard":
        tensorboard_writer_class()


def _agreed_output_dir(cfg: TrainConfig, group: dist.ProcessGroup) -> Path:
    """Rank 0's output folder (checked writable there) on every rank; rank 0's error on every rank."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            out_dir = check_output_dir(Path(cfg.output_dir) if cfg.output_dir else Path.cwd(), cfg.resume)
            message = [str(out_dir.resolve())]
        except ValueError as error:
            message = [error]
    dist.broadcast_object_list(message, src=0, group=group)
    if isinstance(message[0], Exception):
        raise ValueError(f"rank 0: {message[0]}")
    return Path(message[0])


def run_rank(cfg: TrainConfig) -> dict[str, Any] | None:
    """One rank of the distributed job: joins the group of the environment (torchrun's or :func:`spawn`'s)."""
    from tritonrec.dist.train.distributed import train_distributed

    device = rank_device(check_device(cfg.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL comes up: each rank on its own GPU
    created = not dist.is_initialized()
    init_process_group(resolve_backend(cfg.dist.backend, device), cfg.dist.timeout_s)
    try:
        # the job's own timeout (dist.timeout_s), as the model's collectives: new_group alone gives gloo's 30 minutes
        side = dist.new_group(backend="gloo", timeout=group_timeout(dist.group.WORLD))
        out_dir = _agreed_output_dir(cfg, side)
        with _threads(cfg.num_threads), StopRequest().installed() as stop:
            return train_distributed(cfg, out_dir, stop, side)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["check_output_dir", "earlier_results", "precheck_ranks", "run", "run_rank"]
