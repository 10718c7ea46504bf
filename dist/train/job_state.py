"""What a resumed job must find unchanged, and the job's own part of a distributed checkpoint.

:func:`data_fingerprint` lists the data config fields that decide which samples a step sees (everything but the
held-out set): resuming under another value would silently train on other samples, so :func:`check_resume` refuses
it, naming the field, as it refuses ``steps`` at or below the checkpoint's step (nothing would be trained).

:class:`JobState` is the ``extra_state`` of a DCP checkpoint (``tritonrec.dist.checkpoint``): the step, the world
size and per-rank batch size, every rank's data position, the history and the data fingerprint. Rank 0 writes it; on
load every rank reads it and takes its own data position (:meth:`JobState.data_state_for`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

JOB_STATE_FORMAT = 1
_EVAL_ONLY_FIELDS = {"num_eval_samples", "eval_paths", "eval_prefixes"}
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # step_000400.pt (one process), step_00000400/ (ranks)


def data_fingerprint(data_cfg: Any) -> dict[str, Any]:
    """The data config's fields that fix the training samples (held-out fields left out)."""
    fields = dataclasses.asdict(data_cfg)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items() if k not in _EVAL_ONLY_FIELDS}


def check_resume(path: str, saved_step: int, steps: int, saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Clear errors for a resume that would train nothing or train on other data."""
    if steps <= saved_step:
        raise ValueError(
            f"resume: {path!r} was taken after step {saved_step}, and steps={steps} leaves nothing to train: set steps "
            f"above {saved_step} to continue"
        )
    if saved is None:  # a checkpoint written before fingerprints were saved
        return
    changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if changed:
        what = ", ".join(f"data.{k}={saved.get(k)!r} in the checkpoint but {current.get(k)!r} now" for k in changed)
        raise ValueError(
            f"resume: the data changed since {path!r} was saved ({what}): the resumed steps would see other samples "
            "than the run they continue; restore the old value(s) or start a new run without resume"
        )


def optim_fingerprint(optim_cfg: Any) -> dict[str, str]:
    """The optimizer rules a checkpoint's optimizer state belongs to (their state does not carry over to others)."""
    return {"sparse": str(optim_cfg.sparse), "dense": str(optim_cfg.dense)}


def check_resume_optim(path: str, saved: dict[str, str] | None, current: dict[str, str]) -> None:
    """A clear error for resuming under other optimizer rules (``saved`` None: a checkpoint from before it was kept)."""
    if saved is None:
        return
    changed = [k for k in sorted(current) if saved.get(k) != current[k]]
    if changed:
        what = ", ".join(f"optim.{k}={saved.get(k)!r} in the checkpoint but {current[k]!r} now" for k in changed)
        raise ValueError(
            f"resume: the optimizer changed since {path!r} was saved ({what}): its saved state belongs to the old "
            "rule; restore the old optim or start a new run without resume"
        )


def built_hyperparameters(optimizers: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``{"sparse": ..., "dense": ...}`` optimizers -> each param group's hyperparameters (all but its params), taken
    as built from the config, before a resume loads the saved state (see :func:`restore_hyperparameters`)."""
    return {
        prefix: [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for prefix, optimizer in optimizers.items()
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # hydra gives lists (Adam's betas)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def restore_hyperparameters(built: dict[str, list[dict[str, Any]]], optimizers: dict[str, Any]) -> list[str]:
    """After a resume loaded the optimizers' saved state (which restores their saved hyperparameters too): the
    hyperparameters they were built with from this run's config (:func:`built_hyperparameters`: ``optim.sparse_lr``
    / ``sparse_kwargs``, ``optim.dense_lr`` / ``dense_kwargs``, and the defaults of what the config leaves out)
    replace the saved ones, so a run resumed with a lower rate trains with it, and one that drops an argument goes
    back to its default. Returns ``"optim.X=new (checkpoint: old)"`` for each value that changed."""
    changes: list[str] = []
    for prefix, optimizer in optimizers.items():
        for group, wanted in zip(optimizer.param_groups, built[prefix], strict=False):
            for key, value in wanted.items():
                if key in group and not _same(group[key], value):
                    name = f"optim.{prefix}_lr" if key == "lr" else f"optim.{prefix}_kwargs.{key}"
                    changes.append(f"{name}={value!r} (checkpoint: {group[key]!r})")
                    group[key] = value
    return list(dict.fromkeys(changes))


def later_checkpoints(out_dir: Path, start: int) -> list[str]:
    """Names of the checkpoints under ``out_dir/checkpoints`` taken after step ``start`` (an earlier run's, when a
    job resumes at ``start`` into its own folder)."""
    folder = out_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), e.name) for e in folder.iterdir() if (m := _CHECKPOINT_NAME.match(e.name))]
    return [name for step, name in sorted(found) if step > start]


def resume_note(
    name: str, resume: str, start: int, later: list[str], ne_restored: bool = True, optim_changes: list[str] = ()
) -> str:
    """The train.log line that marks where a resumed job takes over (its folder may hold the earlier run's log);
    ``ne_restored`` False: the checkpoint predates the NE state, so the lifetime NE restarts here;
    ``optim_changes``: the hyperparameters the config changed (:func:`restore_hyperparameters`)."""
    note = f"{name}: resumed from {resume} after step {start}; the lines below are this run's"
    if optim_changes:
        note += f"; from here on {', '.join(optim_changes)}"
    if not ne_restored:
        note += f"; the checkpoint holds no NE state: the lifetime NE covers the steps after {start} only"
    if later:
        note += (f"; {', '.join(later)} in this folder are from the earlier run (after step {start}): this run "
                 "overwrites those it reaches")  # fmt: skip
    return note


class JobState:
    """The job's part of a checkpoint (see module docstring); restored in place by ``load_state_dict``."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def update(self, step: int, world_size: int, batch_size: int, data_states: list[dict[str, int]],
               history: dict[str, Any], fingerprint: dict[str, Any], chunk_size: int | None,
               optim: dict[str, str] | None = None) -> None:  # fmt: skip
        self.state = {
            "format": JOB_STATE_FORMAT, "step": step, "world_size": world_size, "batch_size": batch_size,
            "data_states": data_states, "history": history, "data_fingerprint": fingerprint, "chunk_size": chunk_size,
            "optim": optim,
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != JOB_STATE_FORMAT:
            raise ValueError(f"resume: the checkpoint's job state is not format {JOB_STATE_FORMAT} (another version?)")
        self.state = state

    def data_state_for(self, rank: int, world_size: int, batch_size: int, endless_synthetic: bool) -> dict[str, int]:
        """This rank's data position: its saved one at the same world size; at another world size, derived from the
        step where the samples of each step stay the same (see README: endless synthetic data, same global batch),
        else a ValueError saying what to change."""
        saved_world, saved_batch, step = self.state["world_size"], self.state["batch_size"], self.state["step"]
        if world_size == saved_world:
            if batch_size != saved_batch:
                raise ValueError(f"resume: the checkpoint trained batch_size={saved_batch} per rank, this job has "
                                 f"batch_size={batch_size}: set batch_size={saved_batch}")  # fmt: skip
            return dict(self.state["data_states"][rank])
        if not endless_synthetic:
            raise ValueError(
                f"resume: the checkpoint was saved by {saved_world} ranks and this job has {world_size}; only the "
                f"endless synthetic stream keeps every step's samples across world sizes: resume with {saved_world} "
                "ranks"
            )
        if batch_size * world_size != saved_batch * saved_world:
            total = saved_batch * saved_world
            fix = (
                f"with {world_size} ranks set batch_size={total // world_size} per rank to keep it"
                if total % world_size == 0
                else f"{total} samples do not split evenly over {world_size} ranks: resume with a world size that "
                f"divides {total} (e.g. {saved_world} ranks)"
            )
            raise ValueError(
                f"resume: the checkpoint's global batch is {saved_batch} x {saved_world} ranks = {total} samples; {fix}"
            )
        chunk = self.state["chunk_size"]
        if chunk is None or batch_size % chunk:
            raise ValueError(
                f"resume: the checkpoint's data was drawn in chunks of {chunk} samples, which do not divide "
                f"batch_size={batch_size} per rank at {world_size} ranks; resume with {saved_world} ranks"
            )
        return {"epoch": 0, "position": step * batch_size, "batches": step}


__all__ = ["JobState", "built_hyperparameters", "check_resume", "check_resume_optim", "data_fingerprint",
           "later_checkpoints", "optim_fingerprint", "restore_hyperparameters", "resume_note"]  # fmt: skip
