"""Rank-side cases of the distributed job under ``pipeline=semi_sync`` (2 gloo ranks, one spawn for all): the tiny
DLRM job of :mod:`tests.train.dist_job_cases` resumed from one of its checkpoints and run without checkpoints, with
and without ``stash_gradients``, and the same job under ``pipeline=sparse_dist``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.train.dist_job_cases import tiny_config

# name -> (start_batch, stash_gradients, checkpoint_every, step resumed from): one resume after start_batch, one
# before it whose run crosses start_batch and a later checkpoint (the stash applied before it is saved)
RESUMES = {"after_start": (2, False, 4, 4), "before_start_stashed": (4, True, 3, 3)}
STEPS = 8


def semi_sync_config(output_dir: Path, start_batch: int, stash_gradients: bool, **changes: Any) -> Any:
    from tritonrec.dist.train.job_config import PipelineConfig

    pipeline = PipelineConfig(kind="semi_sync", start_batch=start_batch, stash_gradients=stash_gradients)
    changes = {"steps": STEPS, "log_every": 4, "eval_every": 4, "pipeline": pipeline, **changes}
    return tiny_config(output_dir, **changes)


def run_suite(rank: int, world: int, root: str) -> dict[str, Any]:
    from tritonrec.dist.train.job_config import PipelineConfig
    from tritonrec.dist.train.run import run_rank

    base, out = Path(root), {}
    for name, (start_batch, stash, every, resumed_from) in RESUMES.items():
        out[name] = run_rank(semi_sync_config(base / name, start_batch, stash, checkpoint_every=every))
        checkpoint = base / name / "checkpoints" / f"step_{resumed_from:08d}"
        out[f"{name}_resumed"] = run_rank(
            semi_sync_config(base / f"{name}_resumed", start_batch, stash, checkpoint_every=every,
                             resume=str(checkpoint))
        )  # fmt: skip
        out[f"{name}_no_checkpoints"] = run_rank(
            semi_sync_config(base / f"{name}_no_checkpoints", start_batch, stash, checkpoint_every=0)
        )
    # held-out evaluations between steps (every 4 above) run the model's own forward: training stays the same
    start_batch, stash, _, _ = RESUMES["after_start"]
    out["no_evaluations"] = run_rank(semi_sync_config(base / "no_evaluations", start_batch, stash, checkpoint_every=0,
                                                      eval_every=0))  # fmt: skip
    sparse_dist = PipelineConfig(kind="sparse_dist")
    out["sparse_dist"] = run_rank(tiny_config(base / "sparse_dist", steps=4, eval_every=0, checkpoint_every=0,
                                              pipeline=sparse_dist))  # fmt: skip
    return out
