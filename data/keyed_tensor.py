"""``KeyedTensor``: dense per-key blocks concatenated along one dim, e.g. pooled embeddings ``[B, sum(D)]``
(torchrec semantics).

Example (torchrec's)::

    kt = KeyedTensor.from_tensor_list(["A", "B"], [torch.ones(3, 2), 2 * torch.ones(3, 3)])
    kt.values().shape   # [3, 5]
    kt["B"]             # [3, 3] block of twos (a view)
    KeyedTensor.regroup([kt], [["B"], ["A", "B"]])   # [[3, 3], [3, 5]] tensors
"""

from __future__ import annotations

from itertools import accumulate

import torch

from tritonrec.data._fx import SparseTypeMeta
from tritonrec.data._validation import UnknownKeyError
from tritonrec.kernels.checks import check_int


def _check_same_batch(g: int, keys: list[str], blocks: list[torch.Tensor], key_dim: int) -> None:
    """The blocks of one group agree on every dim but the key dim (the batch), else they cannot be concatenated."""
    outer = [tuple(b.shape[:key_dim] + b.shape[key_dim + 1 :]) for b in blocks]
    if any(shape != outer[0] for shape in outer[1:]):
        sizes = ", ".join(
            f"key {key!r} has {shape[0] if len(shape) == 1 else shape} rows"
            for key, shape in zip(keys, outer, strict=True)
        )
        raise ValueError(f"groups[{g}] mixes batch sizes: {sizes}; keys of one group must share the batch")


class KeyedTensor(metaclass=SparseTypeMeta):
    """``values`` holds ``len(keys)`` blocks along ``key_dim``; block ``i`` is ``length_per_key[i]`` wide."""

    def __init__(
        self,
        keys: list[str],
        length_per_key: list[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must be a list of str, got {keys!r}")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if len(length_per_key) != len(keys):
            raise ValueError(f"length_per_key must have one entry per key ({len(keys)}), got {list(length_per_key)}")
        length_per_key = [check_int(n, f"length_per_key[{i}]", 0) for i, n in enumerate(length_per_key)]
        key_dim = check_int(key_dim, "key_dim", -values.dim(), values.dim() - 1,
                            what=f"a dim of values with shape {tuple(values.shape)}")  # fmt: skip
        if values.shape[key_dim] != sum(length_per_key):
            raise ValueError(
                f"values has size {values.shape[key_dim]} along key_dim={key_dim} but sum(length_per_key) = "
                f"{sum(length_per_key)}"
            )
        if offset_per_key is not None and list(offset_per_key) != list(accumulate(length_per_key, initial=0)):
            raise ValueError(
                f"offset_per_key = {offset_per_key!r} disagrees with length_per_key {list(length_per_key)} (expected "
                f"{list(accumulate(length_per_key, initial=0))})"
            )
        if index_per_key is not None and index_per_key != {key: i for i, key in enumerate(keys)}:
            raise ValueError(
                f"index_per_key = {index_per_key!r} must map each of the keys {list(keys)} to its position"
            )
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values
        self._key_dim = key_dim % values.dim()
        self._offset_per_key = offset_per_key
        self._index_per_key = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: list[str], tensors: list[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate ``tensors`` along ``cat_dim``; key ``i`` spans ``tensors[i].shape[key_dim]``."""
        return _from_tensor_list(keys, tensors, key_dim, cat_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes of ``values`` (``numel * element_size``, as torchrec counts)."""
        return self._values.element_size() * self._values.numel()

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            self._offset_per_key = list(accumulate(self._length_per_key, initial=0))
        return self._offset_per_key

    def _key_indices(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {key: i for i, key in enumerate(self._keys)}
        return self._index_per_key

    def _key_index(self, key: str) -> int:
        index = self._key_indices().get(key)
        if index is None:
            raise UnknownKeyError(f"key {key!r} is not one of this KeyedTensor's keys {self._keys}")
        return index

    def __getitem__(self, key: str) -> torch.Tensor:
        """Block of ``key`` (a view)."""
        index = self._key_index(key)
        return self._values.narrow(self._key_dim, self.offset_per_key()[index], self._length_per_key[index])

    def to_dict(self) -> dict[str, torch.Tensor]:
        blocks = self._values.split(self._length_per_key, dim=self._key_dim)
        return {key: blocks[i] for key, i in self._key_indices().items()}

    @staticmethod
    def regroup(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
        """One tensor per group: the blocks of the group's keys concatenated along the key dim, in group order.
        Keys may come from any input and appear in several groups. Differentiable (narrow + cat)."""
        return _regroup(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: list[KeyedTensor], groups: list[list[str]], keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """:meth:`regroup`, with the output of group ``i`` stored under ``keys[i]``."""
        if len(groups) != len(keys) or len(set(keys)) != len(keys):
            raise ValueError(f"keys must name each group once: {len(groups)} groups, got keys {list(keys)}")
        out = KeyedTensor.regroup(keyed_tensors, groups)
        return {key: out[i] for i, key in enumerate(keys)}  # indexing, not zip: ``out`` is a Proxy under fx

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(
            self._keys,
            self._length_per_key,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
            self._offset_per_key,
            self._index_per_key,
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self._values.record_stream(stream)

    def __repr__(self) -> str:
        if not self._keys:
            return "KeyedTensor()"
        lines = [f'    "{key}": {self[key].tolist()}' for key in self._keys]
        return "KeyedTensor({\n" + ",\n".join(lines) + "\n})"


def permute_multi_embedding(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    """torchrec's FBGEMM-backed regroup: one tensor per group, the blocks of its keys concatenated along the key dim
    (``[B, sum(D of the group's keys)]`` for pooled embeddings). Same result as :meth:`KeyedTensor.regroup`; keys may
    repeat across groups, a group may be empty (``[B, 0]``). One gather over all inputs, differentiable."""
    return _regroup_gather(keyed_tensors, groups)


def regroup_kts(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    """torchrec's other FBGEMM regroup entry point; the same result as :func:`permute_multi_embedding`."""
    return _regroup_gather(keyed_tensors, groups)


def _key_owners(keyed_tensors: object) -> dict[str, int]:
    """Which input holds each key; every key must be held once (else a group's block would be ambiguous)."""
    if not isinstance(keyed_tensors, (list, tuple)) or not keyed_tensors:
        raise ValueError(f"keyed_tensors must be a non-empty list of KeyedTensor, got {keyed_tensors!r:.200}")
    owner: dict[str, int] = {}
    for i, kt in enumerate(keyed_tensors):
        if not isinstance(kt, KeyedTensor):
            raise TypeError(f"keyed_tensors[{i}] must be a KeyedTensor, got {type(kt).__name__}")
        for key in kt.keys():
            if owner.setdefault(key, i) != i:
                raise ValueError(f"key {key!r} is held by keyed_tensors[{owner[key]}] and keyed_tensors[{i}]")
    return owner


def _check_gather_inputs(keyed_tensors: list[KeyedTensor]) -> None:
    """The inputs concatenate along the key dim: same key dim, dtype, device and every other dim."""
    first = keyed_tensors[0].values()
    key_dim = keyed_tensors[0].key_dim()
    outer = lambda t: t.shape[:key_dim] + t.shape[key_dim + 1 :]
    for i, kt in enumerate(keyed_tensors[1:], start=1):
        v = kt.values()
        if kt.key_dim() != key_dim or v.dim() != first.dim() or outer(v) != outer(first):
            raise ValueError(
                f"keyed_tensors[{i}] has values {tuple(v.shape)} with key_dim {kt.key_dim()} but keyed_tensors[0] "
                f"has {tuple(first.shape)} with key_dim {key_dim}; they must agree on every dim but the key dim"
            )
        if (v.dtype, v.device) != (first.dtype, first.device):
            raise ValueError(
                f"keyed_tensors[{i}] is {v.dtype} on {v.device} but keyed_tensors[0] is {first.dtype} on "
                f"{first.device}; convert them to one dtype and device first"
            )


# Module-level and registered with ``torch.fx.wrap``: under a symbolic trace each is one ``call_function`` node (its
# checks and key lookups run when the graph runs); otherwise a plain call.
@torch.fx.wrap
def _regroup_gather(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    """All inputs concatenated along the key dim ``[B, sum(D)]``, one ``index_select`` of the groups' columns in
    order, split per group. Column indices come from per-key (start, width): ``arange`` plus each key's shift
    repeated over its width, so nothing loops over columns or rows."""
    owner = _key_owners(keyed_tensors)
    _check_gather_inputs(keyed_tensors)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(group, (list, tuple)) for group in groups):
        raise TypeError(f"groups must be a list of lists of keys, got {groups!r:.200}")
    input_start = list(accumulate((kt.values().shape[kt.key_dim()] for kt in keyed_tensors), initial=0))
    starts, widths, group_widths = [], [], []
    for g, group in enumerate(groups):
        for key in group:
            if key not in owner:
                raise UnknownKeyError(f"groups[{g}] names key {key!r}, held by none of the keyed_tensors")
            kt = keyed_tensors[owner[key]]
            index = kt._key_index(key)
            starts.append(input_start[owner[key]] + kt.offset_per_key()[index])
            widths.append(kt.length_per_key()[index])
        group_widths.append(sum(widths[len(widths) - len(group) :]) if group else 0)
    key_dim = keyed_tensors[0].key_dim()
    values = [kt.values() for kt in keyed_tensors]
    merged = values[0] if len(values) == 1 else torch.cat(values, dim=key_dim)
    device, total = merged.device, sum(widths)
    width_t = torch.tensor(widths, dtype=torch.int64, device=device)
    out_start = torch.tensor(list(accumulate(widths, initial=0))[:-1], dtype=torch.int64, device=device)
    shift = torch.tensor(starts, dtype=torch.int64, device=device) - out_start
    columns = torch.arange(total, device=device) + shift.repeat_interleave(width_t, output_size=total)
    return list(merged.index_select(key_dim, columns).split(group_widths, dim=key_dim))


@torch.fx.wrap
def _from_tensor_list(keys: list[str], tensors: list[torch.Tensor], key_dim: int, cat_dim: int) -> KeyedTensor:
    if len(keys) != len(tensors):
        raise ValueError(f"tensors must have one tensor per key ({len(keys)}), got {len(tensors)}")
    if not tensors:
        raise ValueError("tensors must hold at least one tensor, got an empty list")
    return KeyedTensor(
        keys=keys,
        length_per_key=[t.shape[key_dim] for t in tensors],
        values=torch.cat(tensors, dim=cat_dim),
        key_dim=key_dim,
    )


@torch.fx.wrap
def _regroup(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    if not keyed_tensors:
        raise ValueError("keyed_tensors must hold at least one KeyedTensor, got an empty list")
    key_dim = keyed_tensors[0].key_dim()
    if any(kt.key_dim() != key_dim for kt in keyed_tensors):
        raise ValueError(f"keyed_tensors must share key_dim, got {[kt.key_dim() for kt in keyed_tensors]}")
    owner: dict[str, KeyedTensor] = {}
    for i, kt in enumerate(keyed_tensors):
        for key in kt.keys():
            if owner.setdefault(key, kt) is not kt:
                first = keyed_tensors.index(owner[key])
                raise ValueError(
                    f"key {key!r} is held by keyed_tensors[{first}] and keyed_tensors[{i}]; regroup needs each key "
                    "in one input"
                )
    if not isinstance(groups, (list, tuple)) or not all(isinstance(group, (list, tuple)) for group in groups):
        raise TypeError(f"groups must be a list of lists of keys, got {groups!r}")
    out = []
    for g, group in enumerate(groups):
        blocks = []
        for key in group:
            if key not in owner:
                raise UnknownKeyError(f"groups[{g}] names key {key!r}, held by none of the keyed_tensors")
            blocks.append(owner[key][key])
        if not blocks:
            raise ValueError(f"groups[{g}] is empty; every group needs at least one key")
        _check_same_batch(g, group, blocks, key_dim)
        out.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=key_dim))
    return out
