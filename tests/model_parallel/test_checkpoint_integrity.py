"""Checkpoint integrity in one process (no process group): the manifest catches a flipped byte (which DCP alone
loads silently), a truncated, missing, foreign or unlisted file and a corrupt or foreign manifest, each error naming
the file; saves are atomic - a writer killed mid-save or between writing and publishing leaves no checkpoint under
its final name and its ``*.partial`` directory is swept; a failing save leaves nothing; keep_last prunes."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.model_parallel.checkpoint_cases import DataPosition
from tests.model_parallel.dlrm_cases import SHARDED_PATH, build_dlrm, dense_optimizer
from tritonrec.dist import checkpoint_files
from tritonrec.dist.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    load_unsharded_checkpoint,
    read_extra_entry,
    save_checkpoint,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
T0 = f"{SHARDED_PATH}.embedding_bags.t0.weight"


def _save(path: Path, seed: int = 3, step: int = 1) -> torch.nn.Module:
    model = build_dlrm(seed=seed)
    save_checkpoint(path, model, {"dense": dense_optimizer(model.named_parameters())}, {"data": 4}, step=step)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint and a second one of the same model with other values (the source of foreign files)."""
    root = tmp_path_factory.mktemp("checkpoints")
    _save(root / "good")
    _save(root / "other", seed=4)
    return root / "good", root / "other"


@pytest.fixture
def copy_of(saved: tuple[Path, Path], tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved[0], target)
    return target


def _load(path: Path) -> None:
    model = build_dlrm(seed=9)
    load_checkpoint(path, model, {"dense": dense_optimizer(model.named_parameters())}, {"data": 0})


def _data_file(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def test_intact_checkpoint_verifies_and_loads(saved: tuple[Path, Path]) -> None:
    manifest = verify_checkpoint(saved[0])
    assert manifest["step"] == 1 and manifest["world_size"] == 1 and ".metadata" in manifest["files"]
    model = build_dlrm(seed=9)
    loaded = load_checkpoint(saved[0], model, {"dense": dense_optimizer(model.named_parameters())}, {"data": 0})
    assert loaded.step == 1 and loaded.extra_state == {"data": 4}
    assert torch.equal(model.state_dict()[T0], build_dlrm(seed=3).state_dict()[T0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_flipped_byte_is_caught(copy_of: Path) -> None:
    data = _data_file(copy_of)
    weight = build_dlrm(seed=3).state_dict()[T0].numpy().tobytes()
    blob = bytearray(data.read_bytes())
    offset = blob.find(weight)
    assert offset >= 0, "the table's bytes are not stored verbatim: pick another way to flip a weight"
    blob[offset + 2] ^= 0x40
    data.write_bytes(bytes(blob))
    # DCP alone loads the flipped weight without a word: what the manifest is for
    target = {"model": build_dlrm(seed=9).state_dict()}
    dcp.load(target, checkpoint_id=str(copy_of), no_dist=True)
    assert not torch.equal(target["model"][T0], build_dlrm(seed=3).state_dict()[T0])
    with pytest.raises(CheckpointError, match=rf"{data.name}: corrupt - SHA-256 .* does not match the manifest"):
        _load(copy_of)
    model = build_dlrm(seed=9)  # verify=False skips the hashing: the flipped weight loads, as with DCP alone
    load_checkpoint(copy_of, model, {"dense": dense_optimizer(model.named_parameters())}, {"data": 0}, verify=False)
    assert torch.equal(model.state_dict()[T0], target["model"][T0])


def test_truncated_missing_foreign_and_unlisted_files(copy_of: Path, saved: tuple[Path, Path]) -> None:
    data = _data_file(copy_of)
    original = data.read_bytes()
    data.write_bytes(original[:-100])
    with pytest.raises(CheckpointError, match=rf"{data.name}: truncated - {len(original) - 100} bytes, the manifest"):
        _load(copy_of)
    shutil.copy(_data_file(saved[1]), data)  # same size, another checkpoint's values
    with pytest.raises(CheckpointError, match=rf"{data.name}: corrupt .* from another checkpoint"):
        _load(copy_of)
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"{data.name}: missing \(the manifest lists it\)"):
        _load(copy_of)
    data.write_bytes(original)
    (copy_of / "__7_0.distcp").write_bytes(b"stray")
    with pytest.raises(CheckpointError, match=r"__7_0.distcp: foreign - not listed in the manifest"):
        _load(copy_of)
    (copy_of / "__7_0.distcp").unlink()
    metadata = copy_of / ".metadata"
    blob = bytearray(metadata.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    metadata.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"\.metadata: corrupt - SHA-256"):
        _load(copy_of)


def test_manifest_problems(copy_of: Path, tmp_path: Path) -> None:
    manifest = copy_of / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"step": 1', '"step": 2'))
    with pytest.raises(CheckpointError, match=r"manifest.json: corrupt - its own checksum does not match"):
        _load(copy_of)
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"manifest.json: corrupt - not valid JSON"):
        _load(copy_of)
    manifest.write_text(json.dumps({"format": "someone-else", "files": {}}))
    with pytest.raises(CheckpointError, match=r"manifest.json: foreign - not a tritonrec checkpoint manifest"):
        _load(copy_of)
    manifest.unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json: missing - .* is not a tritonrec checkpoint"):
        _load(copy_of)
    with pytest.raises(CheckpointError, match=r"does not exist \(no such directory\)"):
        _load(tmp_path / "nowhere")
    (tmp_path / "half.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"its save did not finish \(only half.partial is there\)"):
        _load(tmp_path / "half")


def test_checkpoint_of_another_model_is_an_error(saved: tuple[Path, Path]) -> None:
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from tritonrec.modules.dlrm import DLRM

    tables = [EmbeddingBagConfig(num_embeddings=99, embedding_dim=8, name=n, feature_names=[f"f_{n}"])
              for n in ("t0", "t1", "t2", "t3")]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1})
    other = DLRM(ebc, 5, [16, 8], [16, 1])
    with pytest.raises(CheckpointError, match=r"does not fit this model / optimizers: .*Size mismatch"):
        load_checkpoint(saved[0], other)


def test_bad_arguments(tmp_path: Path) -> None:
    model = build_dlrm()
    with pytest.raises(ValueError, match=r"step must be a non-negative int or None, got step=-1"):
        save_checkpoint(tmp_path / "a", model, step=-1)
    with pytest.raises(TypeError, match=r"async_save must be a bool, got async_save='yes'"):
        save_checkpoint(tmp_path / "a", model, async_save="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict"):
        save_checkpoint(tmp_path / "a", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"extra_state must be a dict of name -> value, got list"):
        save_checkpoint(tmp_path / "a", model, extra_state=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizers\['dense'\] must be a torch.optim.Optimizer, got str"):
        save_checkpoint(tmp_path / "a", model, {"dense": "adam"})
    with pytest.raises(TypeError, match=r"verify must be a bool, got verify=1"):
        load_checkpoint(tmp_path / "a", model, verify=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keep_last must be a positive int or None, got keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(CheckpointError, match=r"no checkpoint under"):
        CheckpointManager(tmp_path / "empty").load(model)
    # the argument and its value are named (pathlib's own errors name neither; a str step failed to format)
    for call, message in [
        (lambda: save_checkpoint(None, model), r"path must be a non-empty str or os.PathLike, got path=None"),
        (lambda: load_checkpoint(None, model), r"path must be a non-empty str or os.PathLike, got path=None"),
        (lambda: verify_checkpoint(5), r"path must be a non-empty str or os.PathLike, got path=5"),
        (lambda: load_unsharded_checkpoint(""), r"path must be a non-empty str or os.PathLike, got path=''"),
        (lambda: read_extra_entry(None, "job"), r"path must be a non-empty str or os.PathLike, got path=None"),
        (lambda: read_extra_entry(tmp_path, 3), r"name must be a non-empty str, got name=3"),
        (lambda: CheckpointManager(None), r"root must be a non-empty str or os.PathLike, got root=None"),
    ]:
        with pytest.raises(TypeError, match=message):
            call()
    manager = CheckpointManager(tmp_path / "m")
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got step='5'"):
        manager.save("5", model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got step='x'"):
        manager.load(model, step="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got step=True"):
        manager.path(True)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_read_extra_entry_names_what_is_missing(saved: tuple[Path, Path], tmp_path: Path) -> None:
    assert torch.load(io.BytesIO(read_extra_entry(saved[0], "data")), weights_only=False) == 4
    # DCP's own error is a BaseException, which `except Exception` (a job's resume) and this do not catch
    with pytest.raises(Exception) as caught:  # the type and message are checked below
        read_extra_entry(saved[0], "job")
    assert isinstance(caught.value, CheckpointError)
    assert str(caught.value) == (
        f"checkpoint {str(saved[0])!r} (step 1) has no extra state entry 'job' (it has ['data']): it was saved "
        "without extra_state['job']"
    )
    with pytest.raises(CheckpointError, match=r"nowhere' does not exist \(no such directory\)"):
        read_extra_entry(tmp_path / "nowhere", "job")


def test_failed_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", fail)
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step_1' failed: OSError: disk full"):
        _save(tmp_path / "step_1")
    assert list(tmp_path.iterdir()) == []


def test_keep_last_and_overwrite(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    model = build_dlrm()
    for step in (1, 2, 3, 3):
        manager.save(step, model, extra_state={"data": DataPosition(step)})
    assert manager.steps() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    data = DataPosition()
    assert manager.load(build_dlrm(seed=1), extra_state={"data": data}).step == 3 and data.position == 3


# a writer killed at a chosen point of its save: after the data files (mid-save), or after the manifest, just
# before the rename that publishes it
_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import torch.distributed.checkpoint as dcp
import tritonrec.dist.checkpoint as checkpoint
from tests.model_parallel.dlrm_cases import build_dlrm
manager = checkpoint.CheckpointManager({root!r})
manager.save(1, build_dlrm())
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if {where!r} == "mid-save":
    dcp.FileSystemWriter.finish = die
else:
    checkpoint.publish = die
manager.save(2, build_dlrm(seed=4))
"""


@pytest.mark.parametrize("where", ["mid-save", "before-rename"])
def test_killed_writer_leaves_no_checkpoint_and_no_partial(tmp_path: Path, where: str) -> None:
    code = _KILLED_WRITER.format(repo=str(REPO), root=str(tmp_path), where=where)
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_00000001", "step_00000002.partial"], names  # nothing under the final name
    if where == "before-rename":
        assert (tmp_path / "step_00000002.partial" / "manifest.json").is_file()
    manager = CheckpointManager(tmp_path)  # sweeps what the killed save left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert manager.latest_step() == 1
    model = build_dlrm(seed=9)
    assert manager.load(model).step == 1
    assert torch.equal(model.state_dict()[T0], build_dlrm().state_dict()[T0])


class _Killed(BaseException):
    """The process dying at a chosen point of ``publish`` (nothing after it runs, as with SIGKILL)."""


@pytest.mark.parametrize("dies", ["between-the-renames", "before-removing-the-old-copy"])
def test_overwrite_killed_midway_keeps_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dies: str
) -> None:
    """Re-saving a step moves the old copy aside, then the new one in: at every instant one complete copy exists."""
    manager = CheckpointManager(tmp_path)
    final = manager.save(1, build_dlrm(seed=3))  # the old copy
    save_checkpoint(tmp_path / "new", build_dlrm(seed=4), step=1)
    staging = checkpoint_files.partial_path(final)
    os.rename(tmp_path / "new", staging)  # the new copy, complete, as publish finds it
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(src: object, dst: object) -> None:
        real_rename(src, dst)
        if Path(str(src)) == final:
            raise _Killed

    def rmtree(path: object, *args: object, **kwargs: object) -> None:
        if ".replaced" in Path(str(path)).name:
            raise _Killed
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    if dies == "between-the-renames":
        monkeypatch.setattr(os, "rename", rename)
    else:
        monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(_Killed):
        checkpoint_files.publish(staging, final)
    monkeypatch.undo()
    if dies == "between-the-renames":  # only the old copy is complete, and it is not under the final name
        assert not final.exists()
        with pytest.raises(CheckpointError, match=r"an overwrite of it was interrupted; the previous copy is"):
            load_checkpoint(final, build_dlrm(seed=9))
    manager = CheckpointManager(tmp_path)  # restores the old copy, or removes it when the new one is in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    model = build_dlrm(seed=9)
    assert manager.load(model).step == 1
    survivor = 3 if dies == "between-the-renames" else 4
    assert torch.equal(model.state_dict()[T0], build_dlrm(seed=survivor).state_dict()[T0])
