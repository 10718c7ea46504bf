"""The files of a checkpoint directory: atomic publication and a manifest with checksums.

A checkpoint is written into ``<name>.partial/`` next to its final place. When every file is written (and fsynced),
each rank hashes its share of the files, rank 0 writes ``manifest.json`` (format, step, world size, per file its size
and SHA-256, and the manifest's own checksum), fsyncs it and renames the directory to ``<name>/`` - one atomic
rename, so a directory under its final name is always complete. A save killed before the rename leaves only its
``.partial`` directory, which no load reads and the next save (or :func:`sweep_partials`) removes; a save that fails
with an exception removes it at once.

Overwriting a published ``<name>/`` takes two renames (a directory cannot atomically replace a non-empty one): the old
copy first moves to ``<name>.replaced/``, which no sweep deletes, then the new one takes its place, then the old copy
is removed. Whenever the process dies, one complete copy survives: :func:`restore_replaced` (run by the next
``CheckpointManager`` and the next publish of that name) moves ``<name>.replaced/`` back when ``<name>/`` is missing
and removes it when ``<name>/`` is there.

Loading verifies first: a missing manifest, a manifest that does not parse or whose own checksum does not match, a
missing, truncated, grown or altered file (a flipped byte, a file from another checkpoint) is a
:class:`CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
FORMAT = "tritonrec-dcp-checkpoint"
FORMAT_VERSION = 1
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, foreign, or not fitting the model), or a save
    that failed (its partial files are removed)."""


@dataclass
class Manifest:
    """What ``manifest.json`` records (``files``: relative path -> ``{"bytes": int, "sha256": str}``)."""

    step: int | None
    world_size: int
    files: dict[str, dict[str, Any]]
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "files": {k: self.files[k] for k in sorted(self.files)},
            "extra": self.extra,
        }
        body["manifest_sha256"] = _sha256_text(json.dumps(body, sort_keys=True))
        return json.dumps(body, indent=1, sort_keys=True)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def data_files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory but the manifest, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST:
                out.append(relative)
    return sorted(out)


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each of ``names`` (relative to ``directory``)."""
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": file_sha256(directory / n)} for n in names}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    target = directory / MANIFEST
    with open(target, "w") as handle:
        handle.write(manifest.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_path(directory)


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def replaced_path(final: Path) -> Path:
    """Where :func:`publish` keeps the old copy of ``final`` while it puts the new one in place."""
    return final.with_name(final.name + REPLACED_SUFFIX)


def publish(staging: Path, final: Path) -> None:
    """Rename the complete ``staging`` directory to ``final``, replacing an older ``final`` so that at every instant
    one complete copy exists under ``final`` or :func:`replaced_path` (see module docstring)."""
    restore_replaced(final)  # what an overwrite killed midway left
    replaced = None
    if final.exists():
        replaced = replaced_path(final)
        os.rename(final, replaced)
        _fsync_path(final.parent)  # the old copy's new name is on disk before the new copy takes its place
    os.rename(staging, final)
    _fsync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def restore_replaced(final: Path) -> bool:
    """After an overwrite of ``final`` was killed: move the old copy back when ``final`` is missing (returns True),
    remove it when the new copy is in place (or when it is not a complete checkpoint: no manifest)."""
    replaced = replaced_path(final)
    if not replaced.is_dir():
        return False
    if not final.exists() and (replaced / MANIFEST).is_file():
        os.rename(replaced, final)
        _fsync_path(final.parent)
        return True
    shutil.rmtree(replaced, ignore_errors=True)
    return False


def restore_all_replaced(root: Path) -> list[Path]:
    """:func:`restore_replaced` for every ``*.replaced`` directory under ``root``; returns the checkpoints restored."""
    if not root.is_dir():
        return []
    finals = [e.with_name(e.name[: -len(REPLACED_SUFFIX)]) for e in root.iterdir() if e.name.endswith(REPLACED_SUFFIX)]
    return [final for final in finals if restore_replaced(final)]


def sweep_partials(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove the ``*.partial`` directories a killed save left under ``root`` (but ``keep``); returns them."""
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.name.endswith(PARTIAL_SUFFIX) and entry.is_dir() and entry != keep:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def read_manifest(directory: Path) -> dict[str, Any]:
    """The parsed, self-consistent manifest of ``directory``; :class:`CheckpointError` otherwise."""
    if not directory.is_dir():
        if replaced_path(directory).is_dir():
            raise CheckpointError(f"checkpoint {str(directory)!r} does not exist: an overwrite of it was interrupted; "
                                  f"the previous copy is {replaced_path(directory).name} (a CheckpointManager on "
                                  "its folder restores it)")  # fmt: skip
        if partial_path(directory).is_dir():
            raise CheckpointError(f"checkpoint {str(directory)!r} does not exist: its save did not finish (only "
                                  f"{partial_path(directory).name} is there)")  # fmt: skip
        raise CheckpointError(f"checkpoint {str(directory)!r} does not exist (no such directory)")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing - {str(directory)!r} is not a tritonrec checkpoint, or its save did not finish"
        )
    try:
        body = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: corrupt - not valid JSON ({err})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: foreign - not a tritonrec checkpoint manifest (format {FORMAT!r} expected)")
    claimed = body.pop("manifest_sha256", None)
    if claimed != _sha256_text(json.dumps(body, sort_keys=True)):
        raise CheckpointError(f"{path}: corrupt - its own checksum does not match its content")
    if body.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {body['format_version']} is newer than this tritonrec reads ({FORMAT_VERSION})"
        )
    return body


def check_file(directory: Path, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with one listed file (``None``: nothing)."""
    path = directory / name
    if not path.is_file():
        return f"{path}: missing (the manifest lists it)"
    size = path.stat().st_size
    if size < expected["bytes"]:
        return f"{path}: truncated - {size} bytes, the manifest says {expected['bytes']}"
    if size > expected["bytes"]:
        return f"{path}: {size} bytes, the manifest says {expected['bytes']} - appended to, or from another checkpoint"
    digest = file_sha256(path)
    if digest != expected["sha256"]:
        return (
            f"{path}: corrupt - SHA-256 {digest[:16]}... does not match the manifest's {expected['sha256'][:16]}... "
            "(altered on disk, or from another checkpoint)"
        )
    return None


def check_files(directory: Path, files: dict[str, dict[str, Any]], share: Callable[[int], bool]) -> list[str]:
    """Problems of the listed files this rank checks (``share(i)`` for the i-th file in name order), and of data
    files the manifest does not list."""
    names = sorted(files)
    problems = [p for i, n in enumerate(names) if share(i) and (p := check_file(directory, n, files[n]))]
    if share(0):
        for name in data_files(directory):
            if name not in files:
                problems.append(f"{directory / name}: foreign - not listed in the manifest")
    return problems


__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Manifest",
    "check_files",
    "data_files",
    "describe_files",
    "partial_path",
    "publish",
    "read_manifest",
    "replaced_path",
    "restore_all_replaced",
    "restore_replaced",
    "sweep_partials",
    "write_manifest",
]
