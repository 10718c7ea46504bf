"""The on-disk form of a :class:`~tritonrec.data.batch_cache.DataGroup`'s cache: one memory-mapped ``.npy`` per
array for the whole group, mapped once per process, so reading a stored batch is a slice, not a file.

Layout of ``cache_location``::

    cache.json          batch size, item count, cache layouts (written last: its presence means the files exist)
    <array>.npy         [batch_count * batch_size, *shape] per cache array (created sparse, filled batch by batch;
                        key-major arrays [batch_count, F, batch_size])
    <kjt>.values.npy    per KJT array (KJTLayout): [batch_count, batch_size * max_values_per_item] ids, each batch's
                        from the start of its slot; <kjt>.lengths.npy [batch_count, F, batch_size] int32;
    <kjt>.length_per_key.npy  [batch_count, F] int64; <kjt>.weights.npy (weighted only) like the values, float32
    stored.bin          one byte per batch: 0 not stored, 1 stored, 2 stored with additional data
    additional/<b>.pkl  batch b's additional data (only when it has any)

A batch is written in place (its additional pickle first, renamed into place, then its rows of every array) and only
then marked in ``stored.bin``, so a job killed mid-write leaves the batch unmarked and it is loaded and written again.
A stored batch is never written again (the first writer wins): rewriting it in place would leave a torn batch marked
stored if the job were killed midway. Opening a cache checks every file's shape and dtype (from its header).
Files are created under a temporary name and linked into place without replacing an existing one, so ranks that open
the same new cache at once all end up with the same files.

An array named in ``key_major`` (one feature axis) is stored ``[batch_count, F, batch_size]``: each batch's block
feature by feature, as a KJT holds ids, handed out as the transposed view ``[batch_size, F]``.

A KJT is read back as values (its batch's per-key totals say how many), lengths and totals: no compaction, no
transposing copy.

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

from tritonrec.data.cache_layouts import KJTLayout, Layout, numpy_torch_dtype
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor

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


def _plain(mapped: np.memmap) -> np.ndarray:
    """A plain ndarray view of a memory map (which it keeps alive): ``np.memmap`` indexes through Python-level
    ``__getitem__`` / ``__array_finalize__`` (~20 us of the ~120 us a 2048-row KJT batch took to read)."""
    return mapped.view(np.ndarray)


def _empty_npy(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A ``.npy`` of ``shape`` whose data is a hole (no block is written until a batch is stored)."""
    header = np.lib.format.open_memmap(path, mode="w+", dtype=_numpy_dtype(dtype), shape=shape)
    header.flush()
    del header


class BatchStore:
    """Stored batches of one group (module docstring). ``layouts``: ``{name: ((batch_size, *shape), dtype)}`` for
    dense arrays, ``{name: KJTLayout}`` for KJTs."""

    def __init__(
        self,
        location: Path,
        layouts: Mapping[str, Layout],
        batch_size: int,
        num_items: int,
        readonly: bool,
        views: bool,
        key_major: frozenset[str] = frozenset(),
    ) -> None:
        self.location, self.batch_size = location, batch_size
        self.layouts = {k: v for k, v in layouts.items() if not isinstance(v, KJTLayout)}
        self.kjt_layouts = {k: v for k, v in layouts.items() if isinstance(v, KJTLayout)}
        self.num_items, self.batch_count = num_items, num_items // batch_size
        self.readonly, self.views, self.key_major = readonly, views, key_major
        self._files = self._file_layouts()
        self._read_maps: dict[str, np.ndarray] | None = None
        self._write_maps: dict[str, np.ndarray] | None = None
        self._stored: np.ndarray | None = None
        self._prepare()

    # ------------------------------------------------------------------------------------------------ files
    def array_path(self, name: str) -> Path:
        """The ``.npy`` of file ``name``: a dense array's name, or ``<kjt>.values`` / ``.lengths`` /
        ``.length_per_key`` / ``.weights``."""
        return self.location / f"{name}.npy"

    def _file_layouts(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every ``.npy`` of the cache: ``{file name: (file shape, dtype)}``."""
        files = {name: (self._file_shape(name), dtype) for name, (_, dtype) in self.layouts.items()}
        for name, kjt in self.kjt_layouts.items():
            slot, features = self.batch_size * kjt.max_values_per_item, len(kjt.keys)
            parts = {
                "values": ((self.batch_count, slot), kjt.dtype),
                "lengths": ((self.batch_count, features, self.batch_size), torch.int32),
                "length_per_key": ((self.batch_count, features), torch.int64),
            }
            if kjt.weighted:
                parts["weights"] = ((self.batch_count, slot), torch.float32)
            for part, layout in parts.items():
                if f"{name}.{part}" in files:
                    raise ValueError(f"cache array names collide: {name!r}'s {part} file is {name}.{part}.npy")
                files[f"{name}.{part}"] = layout
        return files

    def additional_path(self, index: int) -> Path:
        return self.location / "additional" / f"{index:08d}.pkl"

    def _descriptor(self) -> dict[str, Any]:
        layouts: dict[str, list[Any]] = {
            k: [list(s[1:]), str(d).removeprefix("torch.")] for k, (s, d) in self.layouts.items()
        }
        layouts |= {k: v.describe() for k, v in self.kjt_layouts.items()}
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
            for path in [self.array_path(name) for name in self._files] + [location / "stored.bin"]:
                if not path.is_file():
                    raise ValueError(f"cache_location {str(location)!r} has cache.json but lacks {path.name}")
            self._check_files()
            return
        (location / "additional").mkdir(parents=True, exist_ok=True)
        for name, (shape, dtype) in self._files.items():
            _create_exclusive(self.array_path(name), lambda p, s=shape, d=dtype: _empty_npy(p, s, d))
        _create_exclusive(location / "stored.bin", lambda p: p.write_bytes(bytes(self.batch_count)))
        self._check_files()  # a file left by a job killed before cache.json may have another group's layout
        _create_exclusive(descriptor_path, lambda p: p.write_text(json.dumps(mine, indent=1)))

    def check_writable(self) -> None:
        """For a group that will write cached batches (not read-only, persisting): the cache's files must be writable
        here, found when the group is made, not at the first ``Batch.cache`` (a raw OSError, mid-epoch). An
        ``additional/`` folder lost on the way (empty folders often are) is made again."""
        if self.readonly:
            return
        additional = self.location / "additional"
        if not additional.exists() and os.access(self.location, os.W_OK):
            additional.mkdir()
        paths = [self.location, additional, self.location / "stored.bin"]
        paths += [self.array_path(name) for name in self._files]
        blocked = next((path for path in paths if not os.access(path, os.W_OK)), None)
        if blocked is not None:
            raise ValueError(
                f"cache_location {str(self.location)!r} holds a cache this process cannot write ({blocked.name} is "
                "read-only here); open the group with cache_readonly=True to read it"
            )

    def _check_files(self) -> None:
        """Every array file has the shape and dtype this group expects (read from its header, no data read), and
        ``stored.bin`` one byte per batch; else a ValueError naming the file, what it holds and what was expected."""
        for name, (shape, dtype) in self._files.items():
            path = self.array_path(name)
            try:
                mapped = np.load(path, mmap_mode="r")
            except (ValueError, OSError) as error:  # a truncated or foreign file
                raise ValueError(f"cache file {str(path)!r} is not a readable .npy ({error}); delete it") from None
            expected = (tuple(shape), _numpy_dtype(dtype))
            if (mapped.shape, mapped.dtype) != expected:
                raise ValueError(
                    f"cache file {str(path)!r} holds shape {mapped.shape} {mapped.dtype}, but this group expects "
                    f"{expected[0]} {expected[1]} (left by another group's cache?); delete it or use another location"
                )
            del mapped
        marks = self.location / "stored.bin"
        if marks.stat().st_size != self.batch_count:
            raise ValueError(
                f"cache file {str(marks)!r} holds {marks.stat().st_size} bytes, but this group has "
                f"{self.batch_count} batches (one byte each); delete it or use another location"
            )

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
            self._stored = _plain(np.memmap(self.location / "stored.bin", dtype=np.uint8, mode="r"))
        return self._stored

    def is_stored(self, index: int) -> bool:
        return bool(self._marks()[index])

    def all_stored(self) -> bool:
        """Every batch is stored (one vectorised pass over the marks)."""
        return bool(self._marks().all())

    def read(self, index: int) -> tuple[dict[str, torch.Tensor | KeyedJaggedTensor], dict[str, list[Any]]] | None:
        """Batch ``index``'s arrays and additional data, or None when it is not stored."""
        mark = int(self._marks()[index])
        if mark == NOT_STORED:
            return None
        if self._read_maps is None:
            self._read_maps = {name: _plain(np.load(self.array_path(name), mmap_mode="c")) for name in self._files}
        arrays: dict[str, torch.Tensor | KeyedJaggedTensor] = {}
        for name in self.layouts:
            tensor = self._tensor(self._block(self._read_maps[name], name, index))
            arrays[name] = tensor.t() if name in self.key_major else tensor
        for name, kjt in self.kjt_layouts.items():
            arrays[name] = self._read_kjt(name, kjt, index)
        additional: dict[str, list[Any]] = {}
        if mark == STORED_WITH_ADDITIONAL:
            with self.additional_path(index).open("rb") as handle:
                additional = pickle.load(handle)
        return arrays, additional

    def _tensor(self, block: np.ndarray) -> torch.Tensor:
        """A view of the mapped ``block`` or, by default, a fresh tensor the consumer owns (torch's allocator reuses
        freed blocks: no page faults)."""
        if self.views:
            return torch.from_numpy(block)
        tensor = torch.empty(block.shape, dtype=numpy_torch_dtype(block.dtype))
        np.copyto(tensor.numpy(), block)
        return tensor

    def _read_kjt(self, name: str, kjt: KJTLayout, index: int) -> KeyedJaggedTensor:
        """Batch ``index``'s KJT: the first ``sum(length_per_key)`` ids of its slot, its lengths and totals (stored
        together by :meth:`write`, so consistent without a check beyond the slot's size)."""
        maps = self._read_maps
        length_per_key = maps[f"{name}.length_per_key"][index].tolist()
        total = sum(length_per_key)
        if not 0 <= total <= maps[f"{name}.values"].shape[1]:
            raise ValueError(f"{self.array_path(name + '.length_per_key')} batch {index}: {total} ids do not fit "
                             f"its slot of {maps[f'{name}.values'].shape[1]}; the cache file is damaged")  # fmt: skip
        values = self._tensor(maps[f"{name}.values"][index, :total])
        lengths = self._tensor(maps[f"{name}.lengths"][index]).view(-1)
        weights = self._tensor(maps[f"{name}.weights"][index, :total]) if kjt.weighted else None
        return KeyedJaggedTensor._trusted(
            list(kjt.keys), values, weights, lengths, self.batch_size, None, length_per_key
        )

    # ------------------------------------------------------------------------------------------------ writing
    def write(
        self, index: int, arrays: Mapping[str, torch.Tensor | KeyedJaggedTensor], additional: Mapping[str, list]
    ) -> None:
        """Store batch ``index``: its additional data, its rows of every array, then its mark."""
        assert not self.readonly
        if self.is_stored(index):  # first writer wins: rewriting in place could leave a torn batch marked stored
            return
        if self._write_maps is None:
            self._write_maps = {name: np.load(self.array_path(name), mmap_mode="r+") for name in self._files}
            marks = np.memmap(self.location / "stored.bin", dtype=np.uint8, mode="r+")
            self._write_maps["stored.bin"] = marks
        mark = STORED
        if additional:
            path = self.additional_path(index)
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            try:
                with partial.open("wb") as handle:
                    pickle.dump(dict(additional), handle)
            except Exception as error:  # nothing of the batch is written yet: leave no partial file behind
                partial.unlink(missing_ok=True)
                raise ValueError(f"batch {index}'s additional data cannot be pickled: {error}") from error
            os.replace(partial, path)  # another writer of this batch wrote the same data
            mark = STORED_WITH_ADDITIONAL
        maps = self._write_maps
        for name in self.layouts:
            values = arrays[name].detach().cpu().numpy()
            self._block(maps[name], name, index)[...] = values.T if name in self.key_major else values
        for name, layout in self.kjt_layouts.items():
            kjt = arrays[name]
            lengths = kjt.lengths().detach().cpu().reshape(len(layout.keys), self.batch_size).numpy()
            total = int(lengths.sum())  # values past the last bag (a KJT may carry a slack tail) are not stored
            maps[f"{name}.values"][index, :total] = kjt.values()[:total].detach().cpu().numpy()
            if layout.weighted:
                maps[f"{name}.weights"][index, :total] = kjt.weights()[:total].detach().cpu().numpy()
            maps[f"{name}.lengths"][index] = lengths
            maps[f"{name}.length_per_key"][index] = lengths.sum(1)
        maps["stored.bin"][index] = mark
