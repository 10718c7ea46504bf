"""The on-disk form of a :class:`~tritonrec.data.batch_cache.DataGroup`'s cache: one memory-mapped ``.npy`` per
array for the whole group, mapped once per process, so reading a stored batch is a slice, not a file.

Layout of ``cache_location``::

    cache.json          batch size, item count, cache layouts (written last: its presence means the files exist)
    <array>.npy         [batch_count * batch_size, *shape] per cache array (created sparse, filled batch by batch;
                        key-major arrays [batch_count, F, batch_size])
    stored.bin          one byte per batch: 0 not stored, 1 stored, 2 stored with additional data
    additional/<b>.pkl  batch b's additional data (only when it has any)

A batch is written in place (its additional pickle first, renamed into place, then its rows of every array) and only
then marked in ``stored.bin``, so a job killed mid-write leaves the batch unmarked and it is loaded and written again.
Files are created under a temporary name and linked into place without replacing an existing one, so ranks that open
the same new cache at once all end up with the same files.

An array named in ``key_major`` (one feature axis) is stored ``[batch_count, F, batch_size]``: each batch's block
feature by feature, as a KJT holds ids, handed out as the transposed view ``[batch_size, F]``.

Reading maps every array once (copy-on-write, ``mmap_mode="c"``): after the first epoch its pages stay mapped, so a
batch costs one copy of its rows into fresh tensors, or nothing with ``views=True`` (tensors that are views of the
mapping: in-place writes to them stay in this process, and later epochs of this process see them).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "tritonrec-batch-cache-2"
NOT_STORED, STORED, STORED_WITH_ADDITIONAL = 0, 1, 2


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _create_exclusive(path: Path, make: Any) -> None:
    """Create ``path`` with ``make(temporary_path)`` unless it exists; never replaces a file another process made."""
    if path.exists():
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    make(partial)
    try:
        os.link(partial, path)
    except FileExistsError:  # another process made it first: theirs is the same (empty) file
        pass
    finally:
        partial.unlink()


def _empty_npy(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A ``.npy`` of ``shape`` whose data is a hole (no block is written until a batch is stored)."""
    header = np.lib.format.open_memmap(path, mode="w+", dtype=_numpy_dtype(dtype), shape=shape)
    header.flush()
    del header


class BatchStore:
    """Stored batches of one group (module docstring). ``layouts``: ``{name: ((batch_size, *shape), dtype)}``."""

    def __init__(
        self,
        location: Path,
        layouts: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        batch_size: int,
        num_items: int,
        readonly: bool,
        views: bool,
        key_major: frozenset[str] = frozenset(),
    ) -> None:
        self.location, self.layouts, self.batch_size = location, dict(layouts), batch_size
        self.num_items, self.batch_count = num_items, num_items // batch_size
        self.readonly, self.views, self.key_major = readonly, views, key_major
        self._read_maps: dict[str, np.ndarray] | None = None
        self._write_maps: dict[str, np.ndarray] | None = None
        self._stored: np.ndarray | None = None
        self._prepare()

    # ------------------------------------------------------------------------------------------------ files
    def array_path(self, name: str) -> Path:
        return self.location / f"{name}.npy"

    def additional_path(self, index: int) -> Path:
        return self.location / "additional" / f"{index:08d}.pkl"

    def _descriptor(self) -> dict[str, Any]:
        layouts = {k: [list(s[1:]), str(d).removeprefix("torch.")] for k, (s, d) in self.layouts.items()}
        return {
            "format": FORMAT, "batch_size": self.batch_size, "num_items": self.num_items, "cache_layouts": layouts,
            "key_major": sorted(self.key_major),
        }  # fmt: skip

    def _prepare(self) -> None:
        location, descriptor_path = self.location, self.location / "cache.json"
        if self.readonly and not descriptor_path.is_file():
            raise ValueError(f"cache_location {str(location)!r} holds no cache (no cache.json) and is read-only")
        mine = self._descriptor()
        if descriptor_path.is_file():
            theirs = json.loads(descriptor_path.read_text())
            for key, value in mine.items():
                if theirs.get(key) != value:
                    raise ValueError(
                        f"cache_location {str(location)!r} holds a cache with {key}={theirs.get(key)!r}, but this "
                        f"group has {key}={value!r}; use another location or delete the old cache"
                    )
            for path in [self.array_path(name) for name in self.layouts] + [location / "stored.bin"]:
                if not path.is_file():
                    raise ValueError(f"cache_location {str(location)!r} has cache.json but lacks {path.name}")
            return
        (location / "additional").mkdir(parents=True, exist_ok=True)
        for name, (_, dtype) in self.layouts.items():
            shape = self._file_shape(name)
            _create_exclusive(self.array_path(name), lambda p, s=shape, d=dtype: _empty_npy(p, s, d))
        _create_exclusive(location / "stored.bin", lambda p: p.write_bytes(bytes(self.batch_count)))
        _create_exclusive(descriptor_path, lambda p: p.write_text(json.dumps(mine, indent=1)))

    def _file_shape(self, name: str) -> tuple[int, ...]:
        """Row-major arrays: ``[batch_count * batch_size, *shape]``; key-major ones ``[batch_count, F, batch_size]``."""
        shape = self.layouts[name][0]
        if name in self.key_major:
            return (self.batch_count, shape[1], self.batch_size)
        return (self.batch_count * self.batch_size, *shape[1:])

    def _block(self, mapped: np.ndarray, name: str, index: int) -> np.ndarray:
        """Batch ``index``'s part of array ``name``: ``[batch_size, *shape]`` rows, or the ``[F, batch_size]`` block
        of a key-major array."""
        if name in self.key_major:
            return mapped[index]
        return mapped[index * self.batch_size : (index + 1) * self.batch_size]

    def __getstate__(self) -> dict[str, Any]:  # a copy in another process maps the files itself
        return {**self.__dict__, "_read_maps": None, "_write_maps": None, "_stored": None}

    # ------------------------------------------------------------------------------------------------ reading
    def _marks(self) -> np.ndarray:
        if self._stored is None:  # a read-only shared mapping sees other processes' marks as they land
            self._stored = np.memmap(self.location / "stored.bin", dtype=np.uint8, mode="r")
        return self._stored

    def is_stored(self, index: int) -> bool:
        return bool(self._marks()[index])

    def read(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]] | None:
        """Batch ``index``'s arrays and additional data, or None when it is not stored."""
        mark = int(self._marks()[index])
        if mark == NOT_STORED:
            return None
        if self._read_maps is None:
            self._read_maps = {name: np.load(self.array_path(name), mmap_mode="c") for name in self.layouts}
        arrays = {}
        for name, mapped in self._read_maps.items():
            block = self._block(mapped, name, index)
            if self.views:
                tensor = torch.from_numpy(block)
            else:  # a fresh tensor the consumer owns (torch's allocator reuses freed blocks: no page faults)
                tensor = torch.empty(block.shape, dtype=self.layouts[name][1])
                np.copyto(tensor.numpy(), block)
            arrays[name] = tensor.t() if name in self.key_major else tensor
        additional: dict[str, list[Any]] = {}
        if mark == STORED_WITH_ADDITIONAL:
            with self.additional_path(index).open("rb") as handle:
                additional = pickle.load(handle)
        return arrays, additional

    # ------------------------------------------------------------------------------------------------ writing
    def write(self, index: int, arrays: Mapping[str, torch.Tensor], additional: Mapping[str, list]) -> None:
        """Store batch ``index``: its additional data, its rows of every array, then its mark."""
        assert not self.readonly
        if self._write_maps is None:
            self._write_maps = {name: np.load(self.array_path(name), mmap_mode="r+") for name in self.layouts}
            marks = np.memmap(self.location / "stored.bin", dtype=np.uint8, mode="r+")
            self._write_maps["stored.bin"] = marks
        mark = STORED
        if additional:
            path = self.additional_path(index)
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            with partial.open("wb") as handle:
                pickle.dump(dict(additional), handle)
            os.replace(partial, path)  # another writer of this batch wrote the same data
            mark = STORED_WITH_ADDITIONAL
        for name in self.layouts:
            values = arrays[name].detach().cpu().numpy()
            self._block(self._write_maps[name], name, index)[...] = values.T if name in self.key_major else values
        self._write_maps["stored.bin"][index] = mark
