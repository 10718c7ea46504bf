"""Managed collision handling (torchrec's ``mc_modules``): ``MCHManagedCollisionModule`` ("zero collision hash");
``ManagedCollisionCollection`` (:mod:`tritonrec.modules.mc_collection`) and the eviction policies
(:mod:`tritonrec.modules.mc_eviction`) are re-exported here under torchrec's import path.

``MCHManagedCollisionModule(zch_size, device, eviction_policy, eviction_interval, ...)`` owns rows
``[output_global_offset, output_global_offset + zch_size)``. State (torchrec's keys):

* ``_mch_sorted_raw_ids [zch_size]``: the raw ids in the table, ascending; free slots hold ``2**63 - 1``.
* ``_mch_remapped_ids_mapping [zch_size]``: the row of each slot (starts as ``arange``).
* ``_mch_<metadata>`` per policy (``_mch_counts``, ``_mch_last_access_iter``), per slot.
* ``_output_segments_tensor``, ``_current_iter_tensor`` (see :mod:`tritonrec.modules.mc_base`).
* not saved: ``_mch_slots`` (``zch_size - 1``), ``_delimiter`` (``2**63 - 1``), the history buffers.

Forward (``dict[name, JaggedTensor]`` of raw ids ``values [N]``): in training mode each batch's ids are appended to
a history buffer (sized from the first batch: ``1.25 * N * eviction_interval``; ids past it are not recorded, as in
torchrec) and every ``eviction_interval``-th batch the eviction policy merges the window into the table (see
:mod:`tritonrec.modules.mc_eviction`), before this batch is remapped. Remapping: an id in the table -> its slot's
row; any other id -> the miss row ``output_global_offset + zch_size - 1``. Eval mode only remaps, changing nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tritonrec.data import JaggedTensor
from tritonrec.kernels.checks import check_int
from tritonrec.modules.mc_base import ManagedCollisionModule, check_id_features
from tritonrec.modules.mc_collection import ManagedCollisionCollection
from tritonrec.modules.mc_eviction import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
    average_threshold_filter,
    dynamic_threshold_filter,
    probabilistic_threshold_filter,
)

__all__ = [
    "DistanceLFU_EvictionPolicy",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionModule",
    "average_threshold_filter",
    "dynamic_threshold_filter",
    "probabilistic_threshold_filter",
]

logger = logging.getLogger(__name__)

_INT64_MAX = torch.iinfo(torch.int64).max
_HASH_SIZE_MAX = 2**63 - 1  # raw ids must stay below the free-slot sentinel
_HISTORY_SLACK = 1.25  # torchrec's history buffer headroom over the first batch


def _mch_remap(
    features: dict[str, JaggedTensor], sorted_raw_ids: torch.Tensor, remapped_ids_mapping: torch.Tensor, miss_row: int
) -> dict[str, JaggedTensor]:
    """Raw ids -> rows: a binary search in ``sorted_raw_ids [Z]`` (its last slot is always the free sentinel, so the
    search runs over ``[:-1]`` and every position indexes safely); misses go to ``miss_row``. Output dtype = input's."""
    remapped: dict[str, JaggedTensor] = {}
    for name, feature in features.items():
        values = feature.values()
        slots = torch.searchsorted(sorted_raw_ids[:-1], values)
        hit = sorted_raw_ids[slots] == values
        rows = torch.where(hit, remapped_ids_mapping[slots], miss_row).to(values.dtype)
        remapped[name] = JaggedTensor(
            values=rows, lengths=feature.lengths(), offsets=feature.offsets(), weights=feature.weights_or_none()
        )
    return remapped


class MCHManagedCollisionModule(ManagedCollisionModule):
    """Zero-collision hash: each id kept by the eviction policy owns one row (see the module docstring).

    Args:
        zch_size: rows owned (``zch_size - 1`` ids fit; the last row takes every id not in the table).
        device: where the state lives.
        eviction_policy: an ``MCHEvictionPolicy`` (LFU, LRU, DistanceLFU).
        eviction_interval: training batches between two merges of the history into the table.
        input_hash_size: ids (after ``input_hash_func``) must lie in ``[0, input_hash_size)``.
        input_hash_func: optional ``f(ids, input_hash_size) -> ids`` applied first.
        mch_size, mch_hash_func: deprecated in torchrec, ignored with a warning.
        name: table name (informational).
        output_global_offset: first owned row (row-wise shards).
        output_segments: row boundaries of the shards (default ``[offset, offset + zch_size]``).
        buckets: number of uniform buckets (resharding).
    """

    def __init__(
        self,
        zch_size: int,
        device: torch.device | str | None,
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = _HASH_SIZE_MAX,
        input_hash_func: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        mch_size: int | None = None,
        mch_hash_func: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        name: str | None = None,
        output_global_offset: int = 0,
        output_segments: list[int] | None = None,
        buckets: int = 1,
    ) -> None:
        zch_size = check_int(zch_size, "zch_size", 1)
        eviction_interval = check_int(eviction_interval, "eviction_interval", 1)
        input_hash_size = check_int(input_hash_size, "input_hash_size", 1, _HASH_SIZE_MAX)
        output_global_offset = check_int(output_global_offset, "output_global_offset", 0)
        buckets = check_int(buckets, "buckets", 1)
        if not isinstance(eviction_policy, MCHEvictionPolicy):
            raise TypeError(f"eviction_policy must be an MCHEvictionPolicy, got {type(eviction_policy).__name__}")
        if input_hash_func is not None and not callable(input_hash_func):
            raise TypeError(f"input_hash_func must be callable or None, got {input_hash_func!r}")
        if output_segments is None:
            output_segments = [output_global_offset, output_global_offset + zch_size]
        super().__init__(device=device, output_segments=output_segments)
        if mch_size is not None or mch_hash_func is not None:
            logger.warning("mch_size and mch_hash_func are deprecated (as in torchrec) and ignored")
        self._init_output_segments = self._output_segments_tensor.clone()
        self._name = name
        self._zch_size = zch_size
        self._eviction_interval = eviction_interval
        self._input_hash_size = input_hash_size
        self._input_hash_func = input_hash_func
        self._output_global_offset = output_global_offset
        self._eviction_policy = eviction_policy
        self._buckets = buckets
        self._current_iter = -1  # read from _current_iter_tensor on the first training batch
        self._last_eviction_iter = -1
        self._evicted = False
        self._init_buffers()
        # non-persistent buffers (not in the state dict), so .to() / .cuda() move them with the table
        self.register_buffer("_evicted_emb_indices", torch.empty(0, dtype=torch.int64, device=self.device), False)
        self._input_history_buffer_size = -1
        self._current_history_buffer_offset = 0
        self.register_buffer("_history_accumulator", torch.empty(0, dtype=torch.int64, device=self.device), False)

    @property
    def device(self) -> torch.device:
        """Where the state lives now (follows ``.to()``)."""
        table = self._buffers.get("_mch_sorted_raw_ids")
        return self._device if table is None else table.device

    @property
    def _mch_metadata(self) -> dict[str, torch.Tensor]:
        """``{name: _mch_<name> buffer}``, looked up each time: ``.to()`` and ``load_state_dict(assign=True)`` replace
        the buffers, and a dict of the old tensors would keep (and update) stale copies."""
        return {
            info.metadata_name: getattr(self, "_mch_" + info.metadata_name)
            for info in self._eviction_policy.metadata_info
            if info.is_mch_metadata
        }

    @property
    def _history_metadata(self) -> dict[str, torch.Tensor]:
        """``{name: _history_<name> buffer}`` once the history is sized (see :attr:`_mch_metadata`)."""
        buffers = {info.metadata_name: self._buffers.get("_history_" + info.metadata_name)
                   for info in self._eviction_policy.metadata_info if info.is_history_metadata}  # fmt: skip
        return {name: buffer for name, buffer in buffers.items() if buffer is not None}

    def _init_buffers(self) -> None:
        size, device = self._zch_size, self.device
        self.register_buffer("_mch_sorted_raw_ids", torch.full((size,), _INT64_MAX, dtype=torch.int64, device=device))
        self.register_buffer("_mch_slots", torch.tensor([size - 1], dtype=torch.int64, device=device), persistent=False)
        delimiter = torch.tensor([_INT64_MAX], dtype=torch.int64, device=device)
        self.register_buffer("_delimiter", delimiter, persistent=False)
        start = self._output_global_offset
        self.register_buffer("_mch_remapped_ids_mapping", torch.arange(start, start + size, device=device))
        for info in self._eviction_policy.metadata_info:
            if info.is_mch_metadata:
                self.register_buffer("_mch_" + info.metadata_name, torch.zeros(size, dtype=torch.int64, device=device))

    def _init_history_buffers(self, features: dict[str, JaggedTensor]) -> None:
        """Size the history from this batch (torchrec's rule). An empty first batch defers sizing to the next
        non-empty one (torchrec would size it 0 and never learn an id)."""
        batch_ids = sum(feature.values().numel() for feature in features.values())
        self._input_history_buffer_size = int(batch_ids * self._eviction_interval * _HISTORY_SLACK)
        self._history_accumulator = torch.empty(self._input_history_buffer_size, dtype=torch.int64, device=self.device)
        for info in self._eviction_policy.metadata_info:
            if info.is_history_metadata:
                buffer_name = "_history_" + info.metadata_name
                history = torch.zeros(self._input_history_buffer_size, dtype=torch.int64, device=self.device)
                self.register_buffer(buffer_name, history, persistent=False)

    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        if self._input_hash_func is None:
            return features
        return {
            name: JaggedTensor(
                values=self._input_hash_func(feature.values(), self._input_hash_size),
                lengths=feature.lengths(),
                offsets=feature.offsets(),
                weights=feature.weights_or_none(),
            )
            for name, feature in features.items()
        }

    def reset_inference_mode(self) -> None:
        self._evicted = False
        self._last_eviction_iter = -1

    @torch.no_grad()
    def _sort_mch_buffers(self) -> None:
        """Restore raw-id order after slots changed (stable, so free slots keep their relative order)."""
        order = torch.argsort(self._mch_sorted_raw_ids, stable=True)
        self._mch_sorted_raw_ids.copy_(self._mch_sorted_raw_ids[order])
        self._mch_remapped_ids_mapping.copy_(self._mch_remapped_ids_mapping[order])
        for metadata in self._mch_metadata.values():
            metadata.copy_(metadata[order])

    @torch.no_grad()
    def _update_and_evict(
        self, uniq_ids: torch.Tensor, uniq_ids_counts: torch.Tensor, uniq_ids_metadata: dict[str, torch.Tensor]
    ) -> None:
        """Merge the window's ``[U]`` unique ids (ascending), counts and metadata into the table."""
        by_count = torch.argsort(uniq_ids_counts, descending=True, stable=True)
        ids_by_count, counts_by_count = uniq_ids[by_count], uniq_ids_counts[by_count]
        slots = torch.searchsorted(self._mch_sorted_raw_ids[:-1], ids_by_count)
        in_table = self._mch_sorted_raw_ids[slots] == ids_by_count
        new_ids = ids_by_count[~in_table]
        evicted_slots, chosen_new = self._eviction_policy.update_metadata_and_generate_eviction_scores(
            self._current_iter,
            self._zch_size,
            by_count,
            counts_by_count,
            in_table,
            slots[in_table],
            self._mch_metadata,
            uniq_ids_metadata,
        )
        self._mch_sorted_raw_ids[evicted_slots] = new_ids[chosen_new]
        evicted_rows = self._mch_remapped_ids_mapping[evicted_slots]
        # rows replaced since the last evict() call accumulate until the embedding module consumes them
        if self._evicted:
            evicted_rows = torch.unique(torch.cat([self._evicted_emb_indices, evicted_rows]))
        self._evicted_emb_indices = evicted_rows
        self._evicted = True
        self._sort_mch_buffers()

    @torch.no_grad()
    def _coalesce_history(self) -> None:
        history = self._history_accumulator[: self._current_history_buffer_offset]
        uniq_ids, inverse, counts = torch.unique(history, return_inverse=True, return_counts=True)
        threshold_filter = self._eviction_policy._threshold_filtering_func
        threshold_mask = threshold_filter(counts)[0] if threshold_filter is not None else None
        metadata = self._eviction_policy.coalesce_history_metadata(
            self._current_iter,
            {name: buf[: self._current_history_buffer_offset] for name, buf in self._history_metadata.items()},
            counts,
            inverse,
            threshold_mask=threshold_mask,
        )
        if threshold_mask is not None:
            uniq_ids, counts = uniq_ids[threshold_mask], counts[threshold_mask]
        self._update_and_evict(uniq_ids, counts, metadata)
        self._current_history_buffer_offset = 0

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Training mode: count the iteration, append the ids to the history, merge every ``eviction_interval``."""
        if not self.training:
            return features
        if self._current_iter == -1:
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter
        self._current_iter += 1
        self._current_iter_tensor.add_(1)
        if self._input_history_buffer_size <= 0:
            self._init_history_buffers(features)
        for feature in features.values():
            start = self._current_history_buffer_offset
            values = feature.values()[: self._input_history_buffer_size - start]
            end = start + values.numel()
            self._history_accumulator[start:end] = values
            self._eviction_policy.record_history_metadata(
                self._current_iter, values, {name: buf[start:end] for name, buf in self._history_metadata.items()}
            )
            self._current_history_buffer_offset = end
        if self._current_iter - self._last_eviction_iter == self._eviction_interval:
            self._coalesce_history()
            self._last_eviction_iter = self._current_iter
        return features

    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        """Raw ids -> rows (state untouched); ``mutate_miss_lengths``/``write_weights`` are unused, as in torchrec."""
        return _mch_remap(
            features,
            self._mch_sorted_raw_ids,
            self._mch_remapped_ids_mapping,
            self._output_global_offset + self._zch_size - 1,
        )

    def forward(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> dict[str, JaggedTensor]:
        """``{name: JaggedTensor(raw ids [N])}`` -> ``{name: JaggedTensor(rows [N])}``, same lengths and weights."""
        check_id_features(features, None, type(self).__name__)
        features = self.preprocess(features)
        check_id_features(features, self._input_hash_size, type(self).__name__)
        features = self.profile(features)
        return self.remap(features, mutate_miss_lengths)

    def output_size(self) -> int:
        return self._zch_size

    def buckets(self) -> int:
        return self._buckets

    def input_size(self) -> int:
        return self._input_hash_size

    def open_slots(self) -> torch.Tensor:
        """``[1]`` free rows: ``zch_size - 1`` minus the ids held."""
        return self._mch_slots - torch.searchsorted(self._mch_sorted_raw_ids, self._delimiter)

    @torch.no_grad()
    def evict(self) -> torch.Tensor | None:
        """Rows ``[E]`` given to new ids since the last call, or None."""
        if not self._evicted:
            return None
        self._evicted = False
        return self._evicted_emb_indices

    def validate_state(self) -> None:
        """After ``load_state_dict``: this module's rows must be buildable from the loaded segments; re-sort."""
        start, end = self._output_global_offset, self._output_global_offset + self._zch_size
        segments = self._output_segments_tensor
        if not (bool((segments == start).any()) and bool((segments == end).any())):
            raise ValueError(
                f"rows [{start}, {end}) cannot be built out of the loaded _output_segments_tensor "
                f"{segments[segments >= 0].tolist()}"
            )
        self._output_segments_tensor.copy_(self._init_output_segments.to(segments.device))
        self._sort_mch_buffers()
        # resume from the loaded state alone, as a fresh module would: the next training batch reads the iteration
        # from _current_iter_tensor and the window restarts (torchrec 1.8 keeps a live module's iteration counter,
        # history buffer and unmerged window, so its eviction schedule and LRU ages depend on what ran before)
        self._current_iter = -1
        self._last_eviction_iter = -1
        self._current_history_buffer_offset = 0
        self._input_history_buffer_size = -1  # sized again from the next batch, as a fresh module's

    def rebuild_with_output_id_range(
        self,
        output_id_range: tuple[int, int],
        output_segments: list[int],
        device: torch.device | None = None,
    ) -> MCHManagedCollisionModule:
        start, end = output_id_range
        return type(self)(
            name=self._name,
            zch_size=end - start,
            device=device or self.device,
            eviction_policy=self._eviction_policy,
            eviction_interval=self._eviction_interval,
            input_hash_size=self._input_hash_size,
            input_hash_func=self._input_hash_func,
            output_global_offset=start,
            output_segments=output_segments,
            buckets=len(output_segments) - 1,
        )
