"""The input dist of tower-sharded modules: every tower's features to the host that runs the tower.

The features of all towers are laid out host by host (``[features of host 0's towers, host 1's, ...]``, a feature two
towers of one host read listed once), selected and permuted into that order from the caller's KJT, and sent by one
``KJTAllToAll`` over the cross-node group (whose rank ``h`` is host ``h``), and likewise for the weighted features.
Local rank ``l`` of a host then holds its towers' keys for the samples of local rank ``l`` of every host, in host
order: ``[H * B]`` bags per key.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.dist_data import KJTAllToAll, KJTAllToAllSplitsAwaitable, KJTAllToAllTensorsAwaitable
from tritonrec.dist.types import Multistreamable

# what compute receives: (features, weighted_features), each None when no tower reads that kind
TowerInputs = tuple[KeyedJaggedTensor | None, KeyedJaggedTensor | None]


class _TensorsAwaitable(Awaitable[TowerInputs]):
    """Second round: the KJTs' tensors; ``wait()`` gives ``(features, weighted_features)``."""

    def __init__(self, awaitables: list[KJTAllToAllTensorsAwaitable | None]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> TowerInputs:
        features, weighted = (a.wait() if a is not None else None for a in self._awaitables)
        return features, weighted


class _SplitsAwaitable(Awaitable[Awaitable[TowerInputs]]):
    """First round: the split sizes; ``wait()`` records each source rank's batch size in ``ctx`` (the output dist's
    row split) and launches the second round."""

    def __init__(self, awaitables: list[KJTAllToAllSplitsAwaitable | None], ctx: Multistreamable) -> None:
        super().__init__()
        self._awaitables = awaitables
        self._ctx = ctx

    def _wait_impl(self) -> Awaitable[TowerInputs]:
        tensors = [a.wait() if a is not None else None for a in self._awaitables]
        sent = next(t for t in tensors if t is not None)
        assert sent.stride_per_rank is not None  # variable batch per feature is refused before the dist
        self._ctx.batch_size_per_rank = list(sent.stride_per_rank)  # type: ignore[attr-defined]
        return _TensorsAwaitable(tensors)


def _host_layout(names_per_host: list[list[list[str]]]) -> tuple[list[str], list[int]]:
    """Per host the union of its towers' keys (first-seen order) -> ``(all keys host by host, keys per host)``."""
    keys: list[str] = []
    splits = []
    for towers in names_per_host:
        host_keys = list(dict.fromkeys(k for tower in towers for k in tower))
        keys.extend(host_keys)
        splits.append(len(host_keys))
    return keys, splits


class TowerInputDist:
    """Builds and runs the tower input dist (see module docstring).

    Args:
        features_per_host: per host (cross-group rank), per tower placed there, the keys it reads from ``features``.
        weighted_per_host: the same for ``weighted_features``.
        pg: the cross-node group.
    """

    def __init__(
        self,
        features_per_host: list[list[list[str]]],
        weighted_per_host: list[list[list[str]]],
        pg: dist.ProcessGroup,
    ) -> None:
        self._keys: list[list[str]] = []
        self._dists: list[KJTAllToAll | None] = []
        for names_per_host in (features_per_host, weighted_per_host):
            keys, splits = _host_layout(names_per_host)
            self._keys.append(keys)
            self._dists.append(KJTAllToAll(pg, splits) if keys else None)
        # input key order -> (indices, indices tensor), per kind: a model passes the same keys every batch
        self._permutes: list[dict[tuple[str, ...], tuple[list[int], torch.Tensor] | None]] = [{}, {}]

    @property
    def feature_names(self) -> list[str]:
        """Keys sent from ``features``, host by host."""
        return list(self._keys[0])

    @property
    def weighted_feature_names(self) -> list[str]:
        """Keys sent from ``weighted_features``, host by host."""
        return list(self._keys[1])

    def dist(
        self,
        ctx: Multistreamable,
        features: KeyedJaggedTensor | None,
        weighted_features: KeyedJaggedTensor | None,
    ) -> Awaitable[Awaitable[TowerInputs]]:
        """Launch the splits round of both all-to-alls; ``.wait()`` the tensors, ``.wait().wait()`` the KJTs."""
        inputs = (features, weighted_features)
        strides = set()
        for kind, (name, kjt) in enumerate(zip(("features", "weighted_features"), inputs, strict=True)):
            if not self._keys[kind]:
                continue
            if not isinstance(kjt, KeyedJaggedTensor):
                raise TypeError(f"{name} must be a KeyedJaggedTensor (a tower reads it), got {type(kjt).__name__}")
            if kjt.variable_stride_per_key():
                raise ValueError(f"{name} has a variable batch per feature, which tower sharding does not take")
            if kind == 1 and kjt.weights_or_none() is None:
                raise ValueError("weighted_features must carry weights (a tower's collection is weighted), got None")
            strides.add(kjt.stride())
        if len(strides) > 1:
            raise ValueError(f"features and weighted_features must share the batch, got strides {sorted(strides)}")
        awaitables: list[KJTAllToAllSplitsAwaitable | None] = []
        with torch.no_grad():
            for kind, (name, kjt) in enumerate(zip(("features", "weighted_features"), inputs, strict=True)):
                module = self._dists[kind]
                if module is None:
                    awaitables.append(None)
                    continue
                assert kjt is not None
                awaitables.append(module(self._select(kind, name, kjt)))
        return _SplitsAwaitable(awaitables, ctx)

    def _select(self, kind: int, name: str, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with exactly the keys sent, in their order (``ValueError`` naming ``name`` for a missing key)."""
        keys = tuple(kjt.keys())
        cache = self._permutes[kind]
        if keys not in cache:
            index = kjt.index_per_key()
            missing = [k for k in self._keys[kind] if k not in index]
            if missing:
                raise ValueError(f"{name} is missing keys {missing} that the towers read (it has {list(keys)})")
            indices = [index[k] for k in self._keys[kind]]
            tensor = torch.tensor(indices, dtype=torch.int32, device=kjt.device())
            cache[keys] = None if indices == list(range(len(keys))) else (indices, tensor)
        permute = cache[keys]
        return kjt if permute is None else kjt.permute(*permute)


__all__ = ["TowerInputDist", "TowerInputs"]
