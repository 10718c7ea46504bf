"""Eviction policies and threshold filters of the managed-collision hash (torchrec's ``mc_modules`` names).

An ``MCHManagedCollisionModule`` keeps a table of ``zch_size`` slots. Every ``eviction_interval`` training batches
it coalesces the ids it saw in that window (``torch.unique`` with counts) and asks its policy to score the current
slots together with the window's new ids; the ``zch_size`` best scores keep or win a slot. The policies:

* ``LFU_EvictionPolicy``: score = access count (a slot's count accumulates while it stays in the table).
* ``LRU_EvictionPolicy``: score = ``-(iter - last_access_iter + 1) ** decay_exponent`` (recent is better).
* ``DistanceLFU_EvictionPolicy``: score = ``count / (iter - last_access_iter + 1) ** decay_exponent``.

Ties keep the candidate order (stable sorts): existing slots in raw-id order, then the new ids by window count,
descending, then raw id. The table's last slot is the "miss" row (ids not in the table map there) and is pinned
with the best possible score, so ``zch_size - 1`` rows hold real ids.

Threshold filters (torchrec's experimental ``threshold_filtering_func``) take the window's ``[U]`` unique-id counts
and return ``(mask [U] bool, threshold)``; ids failing the filter are ignored in that window.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import NamedTuple

import torch

from tritonrec.kernels.checks import check_tensor

_INT64_MAX = torch.iinfo(torch.int64).max

ThresholdFilter = Callable[[torch.Tensor], tuple[torch.Tensor, float | torch.Tensor]]


def _check_counts(id_counts: object) -> torch.Tensor:
    return check_tensor(id_counts, "id_counts", ndim=1)


@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: torch.Tensor, threshold_skew_multiplier: float = 10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[U]`` counts -> (counts > ``threshold_skew_multiplier`` * mean count, that threshold)."""
    counts = _check_counts(id_counts)
    threshold = (1 / counts.numel()) * threshold_skew_multiplier * counts.sum()
    return counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[U]`` counts -> (counts strictly above their mean, the mean)."""
    counts = _check_counts(id_counts)
    counts = counts if counts.dtype == torch.float else counts.float()
    threshold = counts.mean()
    return counts > threshold, threshold


@torch.no_grad()
def probabilistic_threshold_filter(
    id_counts: torch.Tensor, per_id_probability: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[U]`` counts -> (random mask, the uniform draws): an id seen ``c`` times passes with probability
    ``1 - (1 - per_id_probability) ** c``. Draws from torch's global generator."""
    counts = _check_counts(id_counts)
    keep_probability = torch.full_like(counts, 1 - per_id_probability, dtype=torch.float)
    scores = 1 - torch.pow(keep_probability, counts)
    threshold = torch.rand(counts.size(), device=counts.device)
    return scores > threshold, threshold


class MCHEvictionPolicyMetadataInfo(NamedTuple):
    """One metadata tensor of a policy: per-slot (``_mch_<name>`` buffer, saved) and/or per-history-entry."""

    metadata_name: str
    is_mch_metadata: bool
    is_history_metadata: bool


class MCHEvictionPolicy(abc.ABC):
    """Base of the eviction policies (torchrec's interface, so a policy written for torchrec plugs in).

    Args:
        metadata_info: the metadata tensors the policy keeps.
        threshold_filtering_func: optional filter of the window's unique-id counts (see the module docstring).
    """

    def __init__(
        self,
        metadata_info: list[MCHEvictionPolicyMetadataInfo],
        threshold_filtering_func: ThresholdFilter | None = None,
    ) -> None:
        if threshold_filtering_func is not None and not callable(threshold_filtering_func):
            raise TypeError(f"threshold_filtering_func must be callable or None, got {threshold_filtering_func!r}")
        self._metadata_info = metadata_info
        self._threshold_filtering_func = threshold_filtering_func

    @property
    def metadata_info(self) -> list[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    def record_history_metadata(
        self, current_iter: int, incoming_ids: torch.Tensor, history_metadata: dict[str, torch.Tensor]
    ) -> None:
        """Fill the history metadata views ``[n]`` for ``incoming_ids [n]`` seen at ``current_iter``."""
        if "last_access_iter" in history_metadata:
            history_metadata["last_access_iter"][:] = current_iter

    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: torch.Tensor | None = None,
        threshold_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-history-entry metadata ``[H]`` -> per-unique-id metadata ``[U]`` (``[U']`` after ``threshold_mask``):
        the latest access of each id (``unique_inverse_mapping [H]`` maps entries to unique ids)."""
        if "last_access_iter" not in history_metadata:
            return {}
        last_access = history_metadata["last_access_iter"]
        if additional_ids is not None:
            last_access = torch.cat([last_access, torch.full_like(additional_ids, current_iter)])
        coalesced = torch.zeros_like(unique_ids_counts).scatter_reduce_(
            0, unique_inverse_mapping, last_access, reduce="amax", include_self=False
        )
        return {"last_access_iter": coalesced if threshold_mask is None else coalesced[threshold_mask]}

    @abc.abstractmethod
    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the per-slot metadata ``[mch_size]`` in place and choose the replacements.

        The window's ``U`` unique ids arrive sorted by count, descending (``coalesced_history_argsort_mapping [U]``
        is that order, ``..._sorted_unique_ids_counts [U]`` the counts); ``..._matching_elements_mask [U]`` marks
        those already in the table, ``..._matching_indices [M]`` their slots. Returns ``(evicted_indices [E],
        selected_new_indices [E])``: the slots to give up and, pairwise, which of the unmatched ids take them.
        """

    @staticmethod
    def _compute_selected_eviction_and_replacement_indices(
        pivot: int, eviction_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[pivot + N]`` scores (slots then new ids) -> slots ranked below ``pivot`` and new ids ranked within it,
        each in rank order, so the best new id takes the best-ranked evicted slot."""
        ranked = torch.argsort(eviction_scores, descending=True, stable=True)
        kept, dropped = ranked[:pivot], ranked[pivot:]
        evicted_indices = dropped[dropped < pivot]
        selected_new_indices = kept[kept >= pivot] - pivot
        return evicted_indices, selected_new_indices


def _update_counts(
    mch_counts: torch.Tensor, window_counts: torch.Tensor, matched_mask: torch.Tensor, matched_slots: torch.Tensor
) -> torch.Tensor:
    """Add the window's counts to matched slots (in place); return the unmatched ids' counts ``[N]``."""
    mch_counts[matched_slots] += window_counts[matched_mask]
    return window_counts[~matched_mask]


def _update_last_access(
    mch_last_access: torch.Tensor,
    window_metadata: dict[str, torch.Tensor],
    argsort_mapping: torch.Tensor,
    matched_mask: torch.Tensor,
    matched_slots: torch.Tensor,
) -> torch.Tensor:
    """Reorder the window's last access ``[U]`` into count order, write it to matched slots (in place); return the
    unmatched ids' last access ``[N]``."""
    window_last = window_metadata["last_access_iter"]
    window_last.copy_(window_last[argsort_mapping])
    mch_last_access[matched_slots] = window_last[matched_mask]
    return window_last[~matched_mask]


def _age(current_iter: int, last_access: torch.Tensor, decay_exponent: float) -> torch.Tensor:
    """``(current_iter - last_access + 1) ** decay_exponent``, float32 as in torchrec (ties depend on it)."""
    return torch.pow(current_iter - last_access + 1, decay_exponent)


class LFU_EvictionPolicy(MCHEvictionPolicy):
    """Least frequently used: keeps the ids with the largest access counts (``_mch_counts`` buffer)."""

    def __init__(self, threshold_filtering_func: ThresholdFilter | None = None) -> None:
        super().__init__([MCHEvictionPolicyMetadataInfo("counts", True, False)], threshold_filtering_func)

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        counts = mch_metadata["counts"]
        new_counts = _update_counts(
            counts,
            coalesced_history_sorted_unique_ids_counts,
            coalesced_history_mch_matching_elements_mask,
            coalesced_history_mch_matching_indices,
        )
        counts[mch_size - 1] = _INT64_MAX  # the miss row is never evicted
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(
            mch_size, torch.cat([counts, new_counts])
        )
        counts[evicted] = new_counts[selected]
        return evicted, selected


class LRU_EvictionPolicy(MCHEvictionPolicy):
    """Least recently used: keeps the most recently seen ids (``_mch_last_access_iter`` buffer)."""

    def __init__(self, decay_exponent: float = 1.0, threshold_filtering_func: ThresholdFilter | None = None) -> None:
        super().__init__([MCHEvictionPolicyMetadataInfo("last_access_iter", True, True)], threshold_filtering_func)
        self._decay_exponent = decay_exponent

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        last_access = mch_metadata["last_access_iter"]
        new_last_access = _update_last_access(
            last_access,
            coalesced_history_metadata,
            coalesced_history_argsort_mapping,
            coalesced_history_mch_matching_elements_mask,
            coalesced_history_mch_matching_indices,
        )
        last_access[mch_size - 1] = current_iter  # the miss row is never evicted
        merged = torch.cat([last_access, new_last_access])
        scores = torch.neg(_age(current_iter, merged, self._decay_exponent))
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(mch_size, scores)
        last_access[evicted] = new_last_access[selected]
        return evicted, selected


class DistanceLFU_EvictionPolicy(MCHEvictionPolicy):
    """Counts discounted by the time since the last access (``_mch_counts`` and ``_mch_last_access_iter``)."""

    def __init__(self, decay_exponent: float = 1.0, threshold_filtering_func: ThresholdFilter | None = None) -> None:
        super().__init__(
            [
                MCHEvictionPolicyMetadataInfo("counts", True, False),
                MCHEvictionPolicyMetadataInfo("last_access_iter", True, True),
            ],
            threshold_filtering_func,
        )
        self._decay_exponent = decay_exponent

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        counts, last_access = mch_metadata["counts"], mch_metadata["last_access_iter"]
        new_last_access = _update_last_access(
            last_access,
            coalesced_history_metadata,
            coalesced_history_argsort_mapping,
            coalesced_history_mch_matching_elements_mask,
            coalesced_history_mch_matching_indices,
        )
        new_counts = _update_counts(
            counts,
            coalesced_history_sorted_unique_ids_counts,
            coalesced_history_mch_matching_elements_mask,
            coalesced_history_mch_matching_indices,
        )
        counts[mch_size - 1] = _INT64_MAX  # the miss row is never evicted
        last_access[mch_size - 1] = current_iter
        distance = _age(current_iter, torch.cat([last_access, new_last_access]), self._decay_exponent)
        scores = torch.div(torch.cat([counts, new_counts]), distance)
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(mch_size, scores)
        counts[evicted] = new_counts[selected]
        last_access[evicted] = new_last_access[selected]
        return evicted, selected
