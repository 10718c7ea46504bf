"""``KeyedJaggedTensor``: the sparse batch every layer passes around (torchrec semantics and names).

Layout, key-major (torchrec's example)::

    #              sample 0   sample 1   sample 2
    # "Feature0"   [V0, V1]   []         [V2]
    # "Feature1"   [V3]       [V4]       [V5, V6, V7]
    keys    = ["Feature0", "Feature1"]
    values  = [V0, V1, V2, V3, V4, V5, V6, V7]       # [N, *]; optional weights [N]
    lengths = [2, 0, 1, 1, 1, 3]                     # [T * B], bag (key t, sample b) at t * B + b
    offsets = [0, 2, 2, 3, 4, 5, 8]                  # [T * B + 1]
    offset_per_key = [0, 3, 8]

Variable batch per key (VBE): ``stride_per_key_per_rank[t]`` lists key ``t``'s batch size from each rank; key ``t``
then has ``sum(stride_per_key_per_rank[t])`` bags and ``stride()`` is the largest of those (or, with
``inverse_indices``, its width).

Per-key metadata (``length_per_key``, ``offset_per_key``) is computed on first use with one host sync and cached;
``sync()`` computes it eagerly. Results of ``permute``/``split``/``concat`` are built without re-validation (they are
valid by construction); user-built tensors are checked (see :mod:`tritonrec.data._validation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from tritonrec.data import _jagged_storage, _kjt_build, _kjt_dist, _kjt_ops
from tritonrec.data._jagged_parts import JaggedParts
from tritonrec.data._kjt_checks import (
    as_strides,
    check_cached_metadata,
    check_inverse_indices,
    check_inverse_range,
    check_lengths_rows,
)
from tritonrec.data._validation import (
    UnknownKeyError,
    check_jagged_parts,
    complete_empty_offsets,
    normalise_index_tensor,
)
from tritonrec.data.jagged_tensor import JaggedTensor
from tritonrec.kernels.checks import check_optional_int


class KeyedJaggedTensor(JaggedParts):
    """Keyed, optionally weighted, jagged batch. See the module docstring for the layout."""

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | torch.Tensor | None = None,
        stride_per_key: list[int] | None = None,
        length_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
        jt_dict: dict[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must be a list of str, got {keys!r}")
        keys = list(keys)
        check_lengths_rows(lengths, keys)
        lengths = normalise_index_tensor(lengths, "lengths", flatten=True)
        offsets = normalise_index_tensor(offsets, "offsets")
        if lengths is None and offsets is None:
            if keys:
                raise ValueError(f"lengths or offsets must be given for keys {keys}")
            lengths = torch.empty(0, dtype=torch.int32, device=values.device)
        check_jagged_parts(values, weights, lengths, offsets)
        offsets = complete_empty_offsets(offsets)
        strides = as_strides(stride_per_key_per_rank)
        if inverse_indices is not None:
            check_inverse_indices(inverse_indices, keys)
        stride = check_optional_int(stride, "stride", 0)
        num_bags = lengths.numel() if lengths is not None else max(offsets.numel() - 1, 0)
        source = "lengths" if lengths is not None else "offsets (minus one)"
        if strides is not None:
            if len(strides) != len(keys):
                raise ValueError(
                    f"stride_per_key_per_rank must have one row per key ({len(keys)}), got {len(strides)} rows"
                )
            expected = sum(sum(row) for row in strides)
            if expected != num_bags:
                raise ValueError(f"{source} has {num_bags} entries but stride_per_key_per_rank sums to {expected}")
            if stride is None:
                per_key = [sum(row) for row in strides]
                stride = inverse_indices[1].shape[-1] if inverse_indices is not None else max(per_key, default=0)
        elif stride is None:
            if keys and num_bags % len(keys):
                raise ValueError(f"{source} has {num_bags} entries, not divisible by the {len(keys)} keys")
            stride = num_bags // len(keys) if keys else 0
        elif keys and stride * len(keys) != num_bags:
            raise ValueError(
                f"{source} has {num_bags} entries but stride {stride} x {len(keys)} keys = {stride * len(keys)}"
            )
        self._init(keys, values, weights, lengths, offsets, stride, strides, None, inverse_indices)
        if inverse_indices is not None:
            check_inverse_range(inverse_indices, keys, self.stride_per_key())
        check_cached_metadata(self, length_per_key, offset_per_key, stride_per_key, index_per_key, jt_dict)
        self._length_per_key = self._length_per_key if length_per_key is None else list(length_per_key)
        self._offset_per_key = self._offset_per_key if offset_per_key is None else list(offset_per_key)
        self._index_per_key = index_per_key or self._index_per_key
        self._jt_dict = jt_dict

    def _init(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None,
        stride: int,
        strides: list[list[int]] | None,
        length_per_key: list[int] | None,
        inverse_indices: tuple[list[str], torch.Tensor] | None,
    ) -> None:
        self._keys, self._values, self._weights = keys, values, weights
        self._lengths, self._offsets = lengths, offsets
        self._stride, self._stride_per_key_per_rank = stride, strides
        self._length_per_key = length_per_key
        self._inverse_indices = inverse_indices
        self._offset_per_key: list[int] | None = None
        self._index_per_key: dict[str, int] | None = None
        self._jt_dict: dict[str, JaggedTensor] | None = None
        self._stride_per_key: list[int] | None = None

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride: int,
        strides: list[list[int]] | None = None,
        length_per_key: list[int] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> KeyedJaggedTensor:
        """Build from parts already known to be consistent (results of our own ops): no checks, no syncs."""
        kjt = cls.__new__(cls)
        kjt._init(keys, values, weights, lengths, None, stride, strides, length_per_key, inverse_indices)
        return kjt

    # ----------------------------------------------------------------------------------------------- constructors
    @staticmethod
    def from_lengths_sync(
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys, values, weights, lengths=lengths, stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices,
        ).sync()  # fmt: skip

    @staticmethod
    def from_offsets_sync(
        keys: list[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys, values, weights, offsets=offsets, stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices,
        ).sync()  # fmt: skip

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One key per entry. Equal batch sizes give a plain KJT, different ones a VBE KJT (one rank per key)."""
        return _from_jt_dict(jt_dict)

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """No keys, no values (stride 0)."""
        return KeyedJaggedTensor._trusted(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            length_per_key=[],
        )

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor, device: torch.device | str | None = None) -> KeyedJaggedTensor:
        """No keys, with ``kjt``'s device, dtypes and stride (torchrec keeps the stride: the batch size). With
        ``device``: ``kjt`` with uninitialised tensors of its shapes there (to :meth:`copy_` into)."""
        return _empty_like(kjt, device)

    @staticmethod
    def concat(kjt_list: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of all inputs, in order. Inputs share the stride (or are all VBE) and all or none are weighted."""
        return _concat(kjt_list)

    # -------------------------------------------------------------------------------------------------- accessors
    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        """Batch size: bags per key (the largest per-key batch for VBE)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        if self._stride_per_key is None:
            if self._stride_per_key_per_rank is None:
                self._stride_per_key = [self._stride] * len(self._keys)
            else:
                self._stride_per_key = [sum(row) for row in self._stride_per_key_per_rank]
        return self._stride_per_key

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Per key, the batch size from each rank; ``[]`` for a fixed-stride KJT (torchrec's convention)."""
        return [] if self._stride_per_key_per_rank is None else [list(r) for r in self._stride_per_key_per_rank]

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> tuple[list[str], torch.Tensor]:
        if self._inverse_indices is None:
            raise ValueError("this KeyedJaggedTensor has no inverse_indices; use inverse_indices_or_none()")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> tuple[list[str], torch.Tensor] | None:
        return self._inverse_indices

    def lengths_offset_per_key(self) -> list[int]:
        """Where each key's bags start in ``lengths`` (and the end): ``[T + 1]``."""
        return list(accumulate(self.stride_per_key(), initial=0))

    def length_per_key(self) -> list[int]:
        """Number of values per key (one host sync on first call, then cached)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            else:
                bounds = torch.tensor(self.lengths_offset_per_key(), device=self.device())
                at_bounds = self.offsets().index_select(0, bounds)
                self._length_per_key = (at_bounds[1:] - at_bounds[:-1]).tolist()
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Where each key's values start (and the end): ``[T + 1]``."""
        if self._offset_per_key is None:
            self._offset_per_key = list(accumulate(self.length_per_key(), initial=0))
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def index_per_key(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {key: i for i, key in enumerate(self._keys)}
        return self._index_per_key

    def sync(self) -> KeyedJaggedTensor:
        """Compute (and cache) the per-key metadata now."""
        self.length_per_key()
        self.offset_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        self._length_per_key = None
        self._offset_per_key = None
        return self

    def _key_index(self, key: str) -> int:
        index = self.index_per_key().get(key)
        if index is None:
            raise UnknownKeyError(f"key {key!r} is not one of this KeyedJaggedTensor's keys {self._keys}")
        return index

    # ------------------------------------------------------------------------ reshaping (see data/_kjt_ops.py)
    def permute(self, indices: list[int], indices_tensor: torch.Tensor | None = None) -> KeyedJaggedTensor:
        """Keys in the order ``indices`` (which may repeat or drop keys); values and lengths follow."""
        return _kjt_ops.permute(self, indices, indices_tensor)

    def split(self, segments: list[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[i]`` keys each (sum(segments) == number of keys)."""
        return _kjt_ops.split(self, segments)

    def __getitem__(self, key: str) -> JaggedTensor:
        """One key's bags as a JaggedTensor (views, no copy)."""
        return _kjt_ops.getitem(self, key)

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Every key's JaggedTensor (views, cached)."""
        if self._jt_dict is None:
            self._jt_dict = _kjt_ops.to_dict(self)
        return self._jt_dict

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """Same KJT with 1-D lengths (lengths are always stored flat here, so this only drops cached views)."""
        return type(self)._trusted(
            self._keys, self._values, self._weights, self.lengths(), self._stride, self._stride_per_key_per_rank,
            self._length_per_key, self._inverse_indices,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------- movement
    def to(
        self, device: torch.device | str, non_blocking: bool = False, dtype: torch.dtype | None = None
    ) -> KeyedJaggedTensor:
        """Copy to ``device``; ``dtype`` (torchrec's meaning) converts the weights only."""
        return _kjt_ops.apply_to_tensors(self, lambda t: t.to(device, non_blocking=non_blocking), weights_dtype=dtype)

    def pin_memory(self) -> KeyedJaggedTensor:
        return _kjt_ops.apply_to_tensors(self, lambda t: t.pin_memory())

    def __repr__(self) -> str:
        return _kjt_ops.describe(self)

    # ------------------------------- storage, torchrec all-to-all protocol (data/_jagged_storage.py, _kjt_dist.py)
    def clear_storage(self) -> int:
        """Free the storage of values, lengths, offsets and weights (resized to 0 bytes); returns the bytes freed."""
        return _jagged_storage.clear_storage(self)

    def copy_(self, kjt: KeyedJaggedTensor, non_blocking: bool = False) -> KeyedJaggedTensor:
        """Copy ``kjt``'s tensors into this KJT's (same keys, equal shapes) and take over its host metadata."""
        return _jagged_storage.kjt_copy_(self, kjt, non_blocking)

    def dist_labels(self) -> list[str]:
        return _kjt_dist.dist_labels(self)

    def dist_splits(self, key_splits: list[int]) -> list[list[int]]:
        return _kjt_dist.dist_splits(self, key_splits)

    def dist_tensors(self) -> list[torch.Tensor]:
        return _kjt_dist.dist_tensors(self)

    @staticmethod
    def dist_init(
        keys: list[str],
        tensors: list[torch.Tensor],
        variable_stride_per_key: bool,
        num_workers: int,
        recat: torch.Tensor | None,
        stride_per_rank: list[int] | None,
        stagger: int = 1,
    ) -> KeyedJaggedTensor:
        """The KJT a rank receives, from ``tensors`` in ``(source, key)`` order, made key-major by ``recat``."""
        return _dist_init(keys, tensors, variable_stride_per_key, num_workers, recat, stride_per_rank, stagger)


def kjt_is_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    """Same keys, strides, lengths, values and weights (exact)."""
    return _kjt_is_equal(a, b)


# Module-level and registered with ``torch.fx.wrap`` (a function registered elsewhere than where it is called is not
# patched): under a symbolic trace each is one ``call_function`` node whose checks run when the graph runs.
@torch.fx.wrap
def _from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
    return _kjt_build.from_jt_dict(jt_dict)


@torch.fx.wrap
def _empty_like(kjt: KeyedJaggedTensor, device: torch.device | str | None) -> KeyedJaggedTensor:
    return _kjt_build.empty_like(kjt) if device is None else _jagged_storage.kjt_empty_like_device(kjt, device)


@torch.fx.wrap
def _concat(kjt_list: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    return _kjt_build.concat(kjt_list)


@torch.fx.wrap
def _dist_init(*args: object) -> KeyedJaggedTensor:
    return _kjt_dist.dist_init(KeyedJaggedTensor, *args)


@torch.fx.wrap
def _kjt_is_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    return _kjt_ops.is_equal(a, b)
