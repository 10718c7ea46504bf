"""Train a DLRM (hydra-configured): one process, or model-parallel over several ranks.

    python scripts/train.py                                   # the default experiment: DLRM on synthetic data
    python scripts/train.py experiment=synthetic_dcn          # another experiment (configs/experiment/)
    python scripts/train.py steps=2000 data.zipf_alpha=1.3    # any field of configs/ from the command line
    python scripts/train.py resume=outputs/.../checkpoints/step_000200.pt
    torchrun --nproc_per_node 2 scripts/train.py experiment=dlrm_2ranks   # 2 ranks: sharded tables, train pipeline
    python scripts/train.py experiment=dlrm_2ranks            # the same 2 ranks, spawned by the job (dist.nproc=2)
    python scripts/train.py -m experiment=synthetic_dlrm,synthetic_dcn   # a sweep: one folder, one summary table

Results land in the hydra run dir: ``metrics.json``, ``curves.png``, ``train.log`` and checkpoints. The job itself
is ``tritonrec.dist.train.run(cfg)``, which tests and notebooks call without hydra.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from tritonrec.dist.train import as_train_config, register_configs, run
from tritonrec.dist.train.run import RESULT_NAMES

__all__ = ["as_train_config", "main", "run"]

register_configs()


def _hydra_files() -> set[str]:
    """Names hydra itself writes into a run folder: its config folder (.hydra) and its job log's file name."""
    hydra_cfg = HydraConfig.get()
    names = {str(hydra_cfg.output_subdir)} if hydra_cfg.output_subdir else set()
    handlers = (hydra_cfg.job_logging or {}).get("handlers") or {}
    names |= {Path(str(h["filename"])).name for h in handlers.values() if h and h.get("filename")}
    return names


def _remove_if_unused(run_dir: Path) -> None:
    """Remove the hydra run folder of a job that failed before writing anything of its own, so a bad config does not
    leave an empty-looking outputs/<name>/<date>/ behind. Kept as soon as the job wrote anything: a non-empty
    train.log (a step line, or the line saying why the job stopped), checkpoints, metrics, series. An empty file
    named like the job's (hydra's log handler may be configured onto train.log) holds nothing to keep either.
    A multirun job's folder always stays: the sweep's summary has a row for it."""
    if HydraConfig.get().mode == RunMode.MULTIRUN or not run_dir.is_dir():
        return
    ours = set(RESULT_NAMES)
    for entry in run_dir.iterdir():
        empty_file = entry.is_file() and entry.stat().st_size == 0
        if entry.name in ours and not empty_file:
            return
        if entry.name not in _hydra_files() and not empty_file:
            return  # something neither hydra's nor empty: not ours to delete
    shutil.rmtree(run_dir)


def _keep_config_with_results(run_dir: Path, out_dir: Path) -> None:
    """With an explicit ``output_dir`` the results land there, not in hydra's run folder: hydra's record of the
    composed config (``.hydra/``) is copied next to them, and hydra's run folder, then holding only hydra's own
    files, is removed (it was left as an ``outputs/<name>/<date>/`` with nothing of the job's in it)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN or not run_dir.is_dir() or run_dir.resolve() == out_dir.resolve():
        return
    subdir = HydraConfig.get().output_subdir
    if subdir and (run_dir / str(subdir)).is_dir():
        shutil.copytree(run_dir / str(subdir), out_dir / str(subdir), dirs_exist_ok=True)
    _remove_if_unused(run_dir)


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.output_dir is None:
        cfg.output_dir = str(run_dir)
    try:
        metrics = run(cfg)
    except Exception:  # whatever failed, the folder goes only if the job wrote nothing into it
        _remove_if_unused(run_dir)
        raise
    if metrics is None:  # a rank other than 0 of a torchrun job: rank 0 reports
        return
    _keep_config_with_results(run_dir, Path(cfg.output_dir))
    held_out, window = metrics["eval_auroc"], metrics["loss_window"]
    print(
        f"{metrics['name']}: loss {metrics['first_loss']:.4f} (first {window} steps) -> {metrics['final_loss']:.4f} "
        f"(last {window}), held-out AUROC {held_out if held_out is None else round(held_out, 4)}, "
        f"{metrics['samples_per_s']:,.0f} samples/s over {metrics['world_size']} rank(s); results in {cfg.output_dir}"
    )
    if metrics.get("stopped_by"):
        print(f"stopped by {metrics['stopped_by']} at step {metrics['steps']}: resume={metrics['checkpoint']}")
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # exiting here would skip hydra's job-end callback: the sweep's summary would miss this job's row.
            # The callback (tritonrec.dist.train.sweep.SweepSummary) writes it, then ends the sweep with 143.
            return metrics
        sys.exit(143)
    return None


def _refuse_sweep_under_torchrun() -> None:
    """A sweep (``-m``) under torchrun is refused before hydra starts: every rank would run hydra's sweep loop, the
    second job's process group then hung at its rendezvous (past dist.timeout_s), and ranks other than 0 wrote sweep
    folders and summaries of their own (or over rank 0's). ``dist.nproc=N`` without torchrun spawns fresh ranks
    for every job of a sweep."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        return
    if any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in sys.argv[1:]):
        sys.exit(
            "scripts/train.py: a sweep (-m) cannot run under torchrun (each rank would run the whole sweep); run it "
            "without torchrun and let each job spawn its ranks: python scripts/train.py -m dist.nproc="
            f"{os.environ['WORLD_SIZE']} ..."
        )


def _quiet_other_ranks() -> None:
    """Under torchrun only rank 0 keeps a hydra run folder (its path is broadcast to the others by ``run``): the
    other ranks' hydra writes its files into a scratch folder instead of a second outputs/<name>/<date>/."""
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0 and "WORLD_SIZE" in os.environ:
        scratch = Path(tempfile.gettempdir()) / f"tritonrec-hydra-rank{rank}"
        sys.argv = [a for a in sys.argv if not a.startswith(("hydra.run.dir=", "hydra.output_subdir="))]
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=disabled"]


if __name__ == "__main__":
    _refuse_sweep_under_torchrun()
    _quiet_other_ranks()
    main()
