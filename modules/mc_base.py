"""``ManagedCollisionModule``: torchrec's abstract base of the managed-collision modules, and their input checks.

A managed-collision module maps raw ids (from a space much larger than the table, e.g. ``[0, 2**63 - 1)``) to
table rows ``[output_global_offset, output_global_offset + output_size())``. It takes and returns
``dict[name, JaggedTensor]`` whose ``values [N]`` are the ids; lengths, offsets and weights pass through.

State every module keeps (torchrec's state-dict keys): ``_output_segments_tensor [1025]`` (the row boundaries of
the shards it may be rebuilt into, padded with -1; resharding support) and ``_current_iter_tensor [1]`` (training
iterations seen, so a restored module resumes its eviction schedule).
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from tritonrec.data import JaggedTensor
from tritonrec.kernels.checks import check_tensor, host_ints, value_checks_enabled

_MAX_SEGMENTS = 1025  # torchrec's limit: at most 1024 row-wise shards


def check_id_features(
    features: object, input_hash_size: int | None, owner: str, nonnegative: bool = False
) -> dict[str, JaggedTensor]:
    """``features`` must be a dict of ``JaggedTensor`` with 1-D int32/int64 ids; with ``input_hash_size``, ids must
    lie in ``[0, input_hash_size)``, without it but ``nonnegative``, in ``[0, inf)`` (value checks, skipped with
    value checks off). Errors name the feature."""
    if not isinstance(features, dict):
        raise TypeError(f"{owner}: features must be a dict[str, JaggedTensor], got {type(features).__name__}")
    for name, feature in features.items():
        if not isinstance(feature, JaggedTensor):
            raise TypeError(f"{owner}: features[{name!r}] must be a JaggedTensor, got {type(feature).__name__}")
        values = check_tensor(feature.values(), f"features[{name!r}].values()", ndim=1, integer=True)
        if (input_hash_size is not None or nonnegative) and values.numel() > 0 and value_checks_enabled():
            _check_id_range(values, f"features[{name!r}].values()", input_hash_size)
    return features


def _check_id_range(values: torch.Tensor, name: str, input_hash_size: int | None) -> None:
    """Ids in ``[0, input_hash_size)`` (``None``: ``[0, inf)``): one ``aminmax`` and one host read; the culprit is
    searched in int64 only on failure (an int32 tensor compared with a bound past its range would wrap)."""
    low, high = host_ints(*torch.aminmax(values))
    if low >= 0 and (input_hash_size is None or high < input_hash_size):
        return
    wide = values.to(torch.int64)
    bad = wide < 0 if input_hash_size is None else (wide < 0) | (wide >= input_hash_size)
    where = int(bad.nonzero()[0].item())
    allowed = (
        "negative (ids must be >= 0)"
        if input_hash_size is None
        else (f"outside [0, input_hash_size={input_hash_size})")
    )
    raise ValueError(f"{name} out of range: {name}[{where}] = {int(wide[where])} is {allowed}")


class ManagedCollisionModule(nn.Module):
    """Abstract base: maps input ids to ``[0, output_size())`` (plus the module's global offset when sharded).

    Args:
        device: where the module's state lives.
        output_segments: row boundaries ``[start, ..., end]`` of the shards the module may be rebuilt into.
        skip_state_validation: register no segment/iteration buffers and no post-load validation (torchrec's
            option for modules that are never resharded).
        read_only_suffix: suffix of read-only feature names (kept for torchrec's API).
        enable_per_feature_lookups: kept for torchrec's API (hash-ZCH modules).
    """

    def __init__(
        self,
        device: torch.device | str | None,
        output_segments: list[int],
        skip_state_validation: bool = False,
        read_only_suffix: str = "_readonly",
        enable_per_feature_lookups: bool = False,
    ) -> None:
        super().__init__()
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._enable_per_feature_lookups = bool(enable_per_feature_lookups)
        self._read_only_suffix = read_only_suffix
        if skip_state_validation:
            return
        if not isinstance(output_segments, (list, tuple)) or not 2 <= len(output_segments) <= _MAX_SEGMENTS:
            raise ValueError(
                f"output_segments must be a list of 2 to {_MAX_SEGMENTS} row boundaries, got {output_segments!r}"
            )
        padded = list(output_segments) + [-1] * (_MAX_SEGMENTS - len(output_segments))
        self.register_buffer("_output_segments_tensor", torch.tensor(padded, dtype=torch.int64, device=self._device))
        self.register_buffer("_current_iter_tensor", torch.tensor([0], dtype=torch.int64, device=self._device))
        self.register_load_state_dict_post_hook(lambda module, _keys: module.validate_state())

    @property
    def readable_suffix(self) -> str:
        return self._read_only_suffix

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Hash raw ids into the input range (identity without a hash function)."""

    @abc.abstractmethod
    def evict(self) -> torch.Tensor | None:
        """Rows replaced since the last call (``[E]`` output ids, for the embedding module to reset), or None."""

    @abc.abstractmethod
    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        """Raw ids -> output ids, state untouched."""

    @abc.abstractmethod
    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Record the ids (training only) and run the eviction policy when due."""

    @abc.abstractmethod
    def forward(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> dict[str, JaggedTensor]:
        """``preprocess`` -> ``profile`` -> ``remap``."""

    @abc.abstractmethod
    def output_size(self) -> int:
        """Number of output rows (must equal the table's ``num_embeddings``)."""

    @abc.abstractmethod
    def input_size(self) -> int:
        """Size of the input id range."""

    @abc.abstractmethod
    def buckets(self) -> int:
        """Number of uniform buckets (resharding)."""

    @abc.abstractmethod
    def validate_state(self) -> None:
        """Check and normalise the state after ``load_state_dict``."""

    @abc.abstractmethod
    def open_slots(self) -> torch.Tensor:
        """``[1]`` number of unused rows."""

    @abc.abstractmethod
    def rebuild_with_output_id_range(
        self,
        output_id_range: tuple[int, int],
        output_segments: list[int],
        device: torch.device | None = None,
    ) -> ManagedCollisionModule:
        """A fresh module owning rows ``[start, end)`` of this one (a row-wise shard)."""
