"""A hydrax-style batch cache: features that are expensive to produce and fixed across epochs (a frozen encoder's
outputs, hashed ids) are computed once, stored per batch, and read back in later epochs.

A :class:`DataGroup` holds the items (any sequence of descriptors), the batch size and two array layouts, each
``{name: (per-item shape, dtype)}``: ``loader_layouts`` are the arrays the loader function fills item by item,
``cache_layouts`` the arrays stored in the cache, where a :class:`~tritonrec.data.cache_layouts.KJTLayout` entry
holds a KeyedJaggedTensor (hashed ids stored as the KJT holds them, read back with no compaction). The
:class:`~tritonrec.data.group_loader.GroupLoader` yields :class:`Batch` es: an *uncached* batch holds loader arrays;
the training code turns it into its cached form with :meth:`Batch.cache` (for example after running the frozen
encoder), which also writes it to ``cache_location`` unless the group is ``cache_readonly``, ``persist=False`` or
the call says ``persist=False``. Later epochs read the stored batch instead of calling the loader: every cache array
is one memory-mapped ``.npy`` for the whole group, so a stored batch is a slice of it, copied into fresh tensors
(or, with ``cache_views=True``, handed out as views); see :mod:`tritonrec.data.batch_store` for the files.

Batch ``b`` of a group always holds items ``[b * batch_size, (b + 1) * batch_size)`` (a partial last batch is not
produced, as in hydrax), so a stored batch stays valid across epochs; shuffling reorders batches, not their items.
A ``cache.json`` descriptor in ``cache_location`` records the batch size, the item count and the cache layouts; a
group that disagrees with an existing cache is refused. A batch is marked stored only after all of it is written, so
a job killed mid-write leaves no half batch behind.
"""

from __future__ import annotations

import numbers
import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from tritonrec.data.batch_store import BatchStore
from tritonrec.data.cache_layouts import KJTLayout, Layout, Layouts, check_layouts
from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor
from tritonrec.kernels.checks import check_int


class DataGroup:
    """Items of one kind with a batch size, loader layouts, cache layouts and a cache location (module docstring).

    Args:
        batch_size: items per batch.
        data: the item descriptors (a sequence, or an iterable that is materialised).
        loader_layouts: arrays the loader function fills, ``{name: (per-item shape, dtype)}``; ``None`` for a group
            read only from an existing cache.
        cache_layouts: arrays of a cached batch, ``{name: (per-item shape, dtype)}`` or ``{name: KJTLayout(keys,
            max_values_per_item, dtype, weighted)}`` for a KeyedJaggedTensor of stride ``batch_size``; ``None``:
            batches are never cached.
        cache_location: directory of the cache (created unless ``cache_readonly``); ``None``: cached batches live
            only as long as the Batch object.
        cache_readonly: read an existing cache, never write to it.
        persist: write cached batches to ``cache_location`` (the default of :meth:`Batch.cache`'s ``persist``).
        cache_views: batches read from the cache hold views of the memory-mapped files instead of copies (no copy
            per batch; in-place writes to them stay in this process, and its later epochs see them).
        cache_key_major: cache arrays with one feature axis (per-item shape ``(F,)``) stored feature by feature
            within each batch, the way a KJT holds them: ``get_array`` returns the same ``[batch_size, F]`` values as
            a transposed view, so :func:`~tritonrec.data.batcher.kjt_from_id_matrix` needs no transposing copy.
    """

    def __init__(
        self,
        batch_size: int,
        data: Sequence[Any] | Iterable[Any],
        loader_layouts: Layouts | None = None,
        cache_layouts: Layouts | None = None,
        cache_location: str | os.PathLike | None = None,
        cache_readonly: bool = False,
        persist: bool = True,
        cache_views: bool = False,
        cache_key_major: Iterable[str] = (),
    ) -> None:
        batch_size = check_int(batch_size, "batch_size", 1)
        if not isinstance(data, Iterable):
            raise TypeError(f"data must be a sequence or iterable of item descriptors, got {type(data).__name__}")
        self.data: Sequence[Any] = data if isinstance(data, Sequence) else list(data)
        if len(self.data) < batch_size:
            raise ValueError(f"data holds {len(self.data)} items, fewer than batch_size={batch_size}: no batch")
        self.batch_size = batch_size
        for name, flag in (("cache_readonly", cache_readonly), ("persist", persist)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {name}={flag!r}")
        self._loader_layouts = check_layouts(loader_layouts, "loader_layouts", storable=False)
        self._cache_layouts = check_layouts(
            cache_layouts, "cache_layouts", storable=cache_location is not None, kjt_allowed=True
        )
        if not self._loader_layouts and not self._cache_layouts:
            raise ValueError("loader_layouts and cache_layouts are both None: a group needs one of them")
        if not self._loader_layouts and cache_location is None:
            raise ValueError("a group without loader_layouts is read from its cache, so it needs a cache_location")
        self.cache_readonly = cache_readonly or not self._loader_layouts
        self.persist = persist
        if cache_location is not None and not isinstance(cache_location, (str, os.PathLike)):
            kind = type(cache_location).__name__
            raise TypeError(
                f"cache_location must be a str, a path or None, got {kind}: cache_location={cache_location!r}"
            )
        self.cache_location = Path(cache_location) if cache_location is not None else None
        if not isinstance(cache_views, bool):
            raise TypeError(f"cache_views must be a bool, got cache_views={cache_views!r}")
        key_major = [cache_key_major] if isinstance(cache_key_major, str) else list(cache_key_major)
        one_axis = [k for k, v in self._cache_layouts.items() if not isinstance(v, KJTLayout) and len(v[0]) == 1]
        for name in key_major:
            if name not in one_axis:
                raise ValueError(
                    f"cache_key_major names {name!r}, which is not a dense cache array with one feature axis "
                    f"(per-item shape (F,)); those are {one_axis}"
                )
        self.cache_key_major = frozenset(key_major)
        self._store: BatchStore | None = None
        if self.cache_location is not None:
            if not self._cache_layouts:
                raise ValueError("cache_location is set but cache_layouts is None: there is nothing to cache")
            self._store = BatchStore(
                self.cache_location, self.cache_layouts, batch_size, len(self.data), self.cache_readonly, cache_views,
                self.cache_key_major,
            )  # fmt: skip
            if self.persist:  # a group that never persists never writes the cache
                self._store.check_writable()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]

    @property
    def batch_count(self) -> int:
        """Batches per epoch: ``len(data) // batch_size`` (no partial batch)."""
        return len(self.data) // self.batch_size

    @property
    def loader_layouts(self) -> MappingProxyType[str, tuple[tuple[int, ...], torch.dtype]]:
        """Loader arrays with the leading batch dimension: ``{name: ((batch_size, *shape), dtype)}``."""
        return MappingProxyType({k: ((self.batch_size, *s), d) for k, (s, d) in self._loader_layouts.items()})

    @property
    def cache_layouts(self) -> MappingProxyType[str, Layout]:
        """Cached arrays with the leading batch dimension, KJTs as their :class:`KJTLayout` (empty when the group
        does not cache)."""

        def batched(layout: Layout) -> Layout:
            return layout if isinstance(layout, KJTLayout) else ((self.batch_size, *layout[0]), layout[1])

        return MappingProxyType({name: batched(layout) for name, layout in self._cache_layouts.items()})

    @property
    def store(self) -> BatchStore | None:
        """The stored batches (None without a cache location)."""
        return self._store

    def read_batch(self, index: int) -> tuple[dict[str, torch.Tensor | KeyedJaggedTensor], dict[str, list[Any]]] | None:
        """Stored batch ``index`` (its arrays and additional data), or None when it is not stored."""
        return None if self._store is None else self._store.read(index)

    def write_batch(
        self, index: int, arrays: Mapping[str, torch.Tensor | KeyedJaggedTensor], additional: Mapping[str, list]
    ) -> None:
        """Store batch ``index`` (its rows of the group's array files, then its mark)."""
        assert self._store is not None
        self._store.write(index, arrays, additional)


class Batch:
    """One batch of a :class:`DataGroup`, as yielded by :class:`~tritonrec.data.group_loader.GroupLoader`.

    ``arrays`` holds the loader arrays while the batch is :attr:`uncached`, the cache arrays after :meth:`cache` or
    when read from the cache; ``additional`` maps each key the loader returned to one value per item (``None`` where
    an item did not return it). The batch holds one of the loader's ``depth`` slots until :meth:`release` (or a
    ``with`` block, or garbage collection) frees it.
    """

    def __init__(
        self,
        group: DataGroup,
        group_index: int,
        epoch: int,
        is_validation: bool,
        arrays: dict[str, torch.Tensor | KeyedJaggedTensor],
        additional: dict[str, list[Any]],
        uncached: bool,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._group, self._group_index, self._epoch = group, group_index, epoch
        self._is_validation = is_validation
        self._arrays, self._additional, self._uncached = arrays, additional, uncached
        self._release = weakref.finalize(self, on_release) if on_release is not None else None

    def __len__(self) -> int:
        return self._group.batch_size

    def release(self) -> None:
        """Free this batch's depth slot (idempotent); the producer may then load the next batch."""
        if self._release is not None:
            self._release()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def group(self) -> DataGroup:
        return self._group

    @property
    def group_index(self) -> int:
        """The index of this batch within :attr:`group` (its items are ``group_index * batch_size + i``)."""
        return self._group_index

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def is_validation(self) -> bool:
        return self._is_validation

    @property
    def is_training(self) -> bool:
        return not self._is_validation

    @property
    def indices(self) -> range:
        """The items' indices in :attr:`group`."""
        start = self._group_index * self._group.batch_size
        return range(start, start + self._group.batch_size)

    @property
    def data(self) -> list[Any]:
        """The items' descriptors."""
        return [self._group[i] for i in self.indices]

    def get_data(self, index: int) -> Any:
        """Item ``index``'s descriptor (``-len(self) <= index < len(self)``, as for a list)."""
        return self._group[self.indices[self._check_index(index)]]

    def _check_index(self, index: object) -> int:
        if not isinstance(index, numbers.Integral) or isinstance(index, bool):  # numpy ints are Integral too
            raise TypeError(f"index must be an int, got index={index!r}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for a batch of {len(self)} items")
        return int(index)

    @property
    def uncached(self) -> bool:
        """True while :attr:`arrays` are in the loader layouts, False once cached (or read from the cache)."""
        return self._uncached

    @property
    def layouts(self) -> MappingProxyType[str, Layout]:
        """The layouts of :attr:`arrays`: the group's loader layouts while uncached, its cache layouts after."""
        return self._group.loader_layouts if self._uncached else self._group.cache_layouts

    @property
    def arrays(self) -> MappingProxyType[str, torch.Tensor | KeyedJaggedTensor]:
        return MappingProxyType(self._arrays)

    def get_array(self, name: str) -> torch.Tensor | KeyedJaggedTensor:
        """Array ``name``: a tensor, or a KeyedJaggedTensor for a cache array with a :class:`KJTLayout`."""
        if name not in self._arrays:
            raise KeyError(f"this batch has no array {name!r}; it has {sorted(self._arrays)}")
        return self._arrays[name]

    @property
    def additional(self) -> MappingProxyType[str, list[Any]]:
        return MappingProxyType(self._additional)

    def get_additional(self, key: str, index: int | None = None, default: Any = None) -> Any:
        """Item ``index``'s value for ``key`` (``default`` where absent), or the list of every item's value."""
        values = self._additional.get(key, [None] * len(self))
        if index is None:
            return [default if v is None else v for v in values]
        index = self._check_index(index)
        return default if values[index] is None else values[index]

    def cache(
        self,
        arrays: Mapping[str, torch.Tensor | KeyedJaggedTensor],
        additional: Mapping[str, Sequence[Any]] | None = None,
        persist: bool = True,
    ) -> None:
        """Turn this uncached batch into its cached form; store it unless the group or ``persist`` says not to.

        ``arrays`` must match the group's cache layouts exactly (names, ``(batch_size, *shape)`` shapes, dtypes; a
        :class:`KJTLayout` array a KJT of its keys, stride ``batch_size``, id dtype, weights and at most
        ``max_values_per_item`` ids per item); ``additional`` (one value per item for each key) replaces the
        loader's additional data when given.
        """
        if not isinstance(persist, bool):
            raise TypeError(f"persist must be a bool, got persist={persist!r}")
        if not self._uncached:
            raise RuntimeError(f"batch {self._group_index} is already cached")
        layouts = self._group.cache_layouts
        if not layouts:
            raise RuntimeError("this batch's group has no cache_layouts, so its batches cannot be cached")
        if not isinstance(arrays, Mapping):
            raise TypeError(f"arrays must be a mapping name -> tensor, got {type(arrays).__name__}")
        missing, extra = sorted(set(layouts) - set(arrays)), sorted(set(arrays) - set(layouts))
        if missing or extra:
            raise ValueError(f"arrays must match cache_layouts exactly: missing {missing}, unexpected {extra}")
        for name, layout in layouts.items():
            if isinstance(layout, KJTLayout):
                layout.check(name, arrays[name], len(self))
                continue
            shape, dtype = layout
            tensor = arrays[name]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor)
                raise ValueError(f"array {name!r} must be a tensor of shape {shape} and dtype {dtype}, got {got}")
        if additional is not None:
            if not isinstance(additional, Mapping):
                raise TypeError(f"additional must be a mapping key -> values, got {type(additional).__name__}")
            for key, values in additional.items():
                if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(self):
                    got = f"a {type(values).__name__} of length {len(values)}" if isinstance(values, Sized) else values
                    raise ValueError(
                        f"additional[{key!r}] must hold one value per item ({len(self)}) in a sequence, got {got}"
                    )
        new_arrays = dict(arrays)
        new_additional = self._additional if additional is None else {k: list(v) for k, v in additional.items()}
        group = self._group
        if persist and group.persist and not group.cache_readonly and group.cache_location is not None:
            # Written before the batch changes form: a failed write (unpicklable additional data) leaves it uncached,
            # so the call can be retried. A batch another writer stored first keeps its stored copy.
            group.write_batch(self._group_index, new_arrays, new_additional)
        self._arrays, self._additional, self._uncached = new_arrays, new_additional, False
