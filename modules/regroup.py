"""``KTRegroupAsDict`` (``torchrec.modules.regroup``): a list of KeyedTensors (e.g. several collections' pooled
embeddings) regrouped into a dict of tensors, one per group of keys, as :meth:`KeyedTensor.regroup_as_dict` does, with
the key -> (input, offset, width) look-up computed once, on the first call, and reused afterwards.

Example (torchrec's)::

    regroup = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["object", "user"])
    kt = KeyedTensor.from_tensor_list(["f1", "f2", "f3"], [torch.randn(2, 4), torch.randn(2, 8), torch.randn(2, 2)])
    out = regroup([kt])   # {"object": [2, 12] (f1 then f2), "user": [2, 2]}

The output dict follows ``keys``' order; group ``i`` concatenates its keys' blocks, in the group's order, along the
inputs' key dim. The module has no parameters and no buffers (an empty state dict, like torchrec's, whose permute
buffers are non-persistent).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from tritonrec.data import KeyedTensor
from tritonrec.modules.embedding_configs import DataType, data_type_to_dtype

# per output group, the runs it concatenates: (input index, offset along the key dim, width)
_Spans = list[list[tuple[int, int, int]]]
# what the cache was built from: per input, its keys and their widths; and the key dim
_Layout = tuple[tuple[tuple[tuple[str, ...], tuple[int, ...]], ...], int]


def _check_str_list(value: object, name: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"{name} must be a list of str, got {name}={value!r}")
    return list(value)


def _layout_of(keyed_tensors: list[KeyedTensor]) -> _Layout:
    layout = tuple((tuple(kt.keys()), tuple(kt.length_per_key())) for kt in keyed_tensors)
    return layout, keyed_tensors[0].key_dim()


def _spans_of(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> _Spans:
    """Each group's blocks as runs of (input, offset, width); a key following its neighbour in the same input extends
    the run, so a group that is a contiguous stretch of one input is a single ``narrow``."""
    where: dict[str, tuple[int, int, int]] = {}
    for i, kt in enumerate(keyed_tensors):
        offsets, lengths = kt.offset_per_key(), kt.length_per_key()
        for j, key in enumerate(kt.keys()):
            where[key] = (i, offsets[j], lengths[j])
    spans: _Spans = []
    for group in groups:
        runs: list[tuple[int, int, int]] = []
        for key in group:
            i, offset, width = where[key]
            if runs and runs[-1][0] == i and runs[-1][1] + runs[-1][2] == offset:
                runs[-1] = (i, runs[-1][1], runs[-1][2] + width)
            else:
                runs.append((i, offset, width))
        spans.append(runs)
    return spans


class KTRegroupAsDict(nn.Module):
    """Regroups ``list[KeyedTensor]`` into ``{keys[i]: [B, sum of groups[i]'s widths]}`` (for KeyedTensors whose key
    dim is 1; in general the blocks are concatenated along the key dim).

    Args:
        groups: the keys of each output group (a key may appear in several groups; at least one key per group).
        keys: the output name of each group (unique, one per group).
        emb_dtype: cast the outputs to this :class:`DataType`'s dtype (``None``: keep the inputs' dtype).
        multi_device: accepted for torchrec's signature; this module holds no index buffers, so the outputs are on
            the inputs' device either way.

    The first call (and the first after :meth:`clear_cache`) checks the inputs (non-empty, one device, one key dim,
    each key held by one input, every group's keys present, one batch per group) with
    :meth:`KeyedTensor.regroup_as_dict`, and caches where each group's blocks sit. Later calls reuse the cache. Where
    torchrec's cached permutation would silently read stale positions from inputs laid out differently (other keys,
    order or widths), this module raises a ``ValueError``; call :meth:`clear_cache` to re-read the layout.

    Under plain ``torch.fx.symbolic_trace`` it records itself as one ``call_module`` node, so the traced graph keeps
    the cache's behaviour. ``torch.compile`` traces through it (the cached runs are Python ints: constants).
    """

    def __init__(
        self,
        groups: list[list[str]],
        keys: list[str],
        emb_dtype: DataType | None = None,
        multi_device: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"groups must be a list of lists of keys, got groups={groups!r}")
        self._groups = [_check_str_list(group, f"groups[{g}]") for g, group in enumerate(groups)]
        self._keys = _check_str_list(keys, "keys")
        if len(self._keys) != len(self._groups) or len(set(self._keys)) != len(self._keys):
            raise ValueError(f"keys must name each of the {len(self._groups)} groups once, got keys={self._keys}")
        for g, group in enumerate(self._groups):
            if not group:
                raise ValueError(f"groups[{g}] is empty; every group needs at least one key")
        if emb_dtype is not None and not isinstance(emb_dtype, DataType):
            raise TypeError(f"emb_dtype must be a DataType or None, got emb_dtype={emb_dtype!r}")
        self._emb_dtype = emb_dtype
        self._dtype = None if emb_dtype is None else data_type_to_dtype(emb_dtype)
        self._multi_device = bool(multi_device)
        self._is_inited = False
        self._layout: _Layout | None = None
        self._spans: _Spans = []
        self._dim = 1

    def clear_cache(self) -> None:
        """Forget the cached layout: the next call reads it afresh (torchrec's ``CacheMixin`` API)."""
        self._is_inited = False
        self._layout = None
        self._spans = []

    def _check_inputs(self, keyed_tensors: list[KeyedTensor]) -> None:
        if not isinstance(keyed_tensors, (list, tuple)) or not keyed_tensors:
            raise ValueError(f"keyed_tensors must be a non-empty list of KeyedTensors, got {keyed_tensors!r}")
        for i, kt in enumerate(keyed_tensors):
            if not isinstance(kt, KeyedTensor) and not callable(getattr(kt, "length_per_key", None)):
                raise TypeError(f"keyed_tensors[{i}] must be a KeyedTensor, got {type(kt).__name__}")
        devices = [kt.device() for kt in keyed_tensors]
        if any(device != devices[0] for device in devices):
            raise ValueError(f"keyed_tensors must be on one device, got {[str(d) for d in devices]}")

    def _cast(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._dtype is None:
            return out
        return {key: value.to(self._dtype) for key, value in out.items()}

    def forward(self, keyed_tensors: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        """``keyed_tensors`` -> ``{keys[i]: tensor}``, group ``i``'s blocks concatenated along the key dim."""
        if is_fx_symbolic_tracing() and (leaf := self._fx_leaf(keyed_tensors)) is not None:
            return leaf  # type: ignore[return-value]
        self._check_inputs(keyed_tensors)
        if not self._is_inited:
            out = KeyedTensor.regroup_as_dict(list(keyed_tensors), self._groups, self._keys)
            self._layout = _layout_of(keyed_tensors)
            self._dim = keyed_tensors[0].key_dim()
            self._spans = _spans_of(keyed_tensors, self._groups)
            self._is_inited = True
            return self._cast(out)
        layout = _layout_of(keyed_tensors)
        if layout != self._layout:
            raise ValueError(
                f"keyed_tensors are laid out as {layout} (per input: keys, widths; key dim), but this module cached "
                f"{self._layout} on its first call; call clear_cache() to regroup inputs with another layout"
            )
        values = [kt.values() for kt in keyed_tensors]
        out: dict[str, torch.Tensor] = {}
        for key, runs in zip(self._keys, self._spans, strict=True):
            blocks = [values[i].narrow(self._dim, offset, width) for i, offset, width in runs]
            out[key] = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self._dim)
        return self._cast(out)

    def _fx_leaf(self, keyed_tensors: object) -> torch.fx.Proxy | None:
        """Under plain fx: one ``call_module`` node for this module (its argument is the proxy of the list, or a
        list holding proxies); None when no argument is a proxy."""
        items = keyed_tensors if isinstance(keyed_tensors, (list, tuple)) else [keyed_tensors]
        proxy = next((item for item in items if isinstance(item, torch.fx.Proxy)), None)
        if proxy is None:
            return None
        path = proxy.tracer.path_of_module(self)
        if path == "":
            raise TypeError("torch.fx cannot trace a KTRegroupAsDict as the root module: trace a model that holds it")
        return proxy.tracer.create_proxy("call_module", path, (keyed_tensors,), {})


__all__ = ["KTRegroupAsDict"]
