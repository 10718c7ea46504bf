"""``Batch``: what the data layer hands to the model (torchrec's ``Batch`` plus a ``valid_mask``).

``dense_features [B, Dd]`` float, ``sparse_features`` a KeyedJaggedTensor with stride ``B``, ``labels [B]`` float and
``valid_mask [B]`` bool. Rows whose mask is False are padding (the short last batch of an epoch padded up to the batch
size, so every step sees one shape): their dense row and label are zero, their bags empty, and losses and metrics
weight them by zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonrec.data.keyed_jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    """One training batch; the field names are torchrec's, ``valid_mask`` is ours (see module docstring)."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    valid_mask: torch.Tensor

    def __post_init__(self) -> None:
        check_batch_parts(self.dense_features, self.sparse_features, self.labels, self.valid_mask)

    @classmethod
    def _trusted(
        cls,
        dense_features: torch.Tensor,
        sparse_features: KeyedJaggedTensor,
        labels: torch.Tensor,
        valid_mask: torch.Tensor,
    ) -> Batch:
        """Build from parts known to fit (the collate functions' own, every batch): no checks."""
        batch = cls.__new__(cls)
        batch.dense_features, batch.sparse_features = dense_features, sparse_features
        batch.labels, batch.valid_mask = labels, valid_mask
        return batch

    @property
    def batch_size(self) -> int:
        """``B``, padded rows included."""
        return self.labels.shape[0]

    def num_valid(self) -> int:
        """Number of real (unpadded) rows; reads the mask, so it syncs a GPU."""
        return int(self.valid_mask.sum().item())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Copy every tensor to ``device`` (stage 1 of the pipeline; ``non_blocking`` needs pinned host memory)."""
        return Batch(
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            valid_mask=self.valid_mask.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            valid_mask=self.valid_mask.pin_memory(),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell the caching allocator that ``stream`` uses these tensors (after a copy on a side stream)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
        self.valid_mask.record_stream(stream)


def _tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_batch_parts(dense_features: object, sparse_features: object, labels: object, valid_mask: object) -> None:
    """Types, ranks, dtypes and the shared batch size of a Batch's fields (metadata only: no sync)."""
    dense_features = _tensor(dense_features, "dense_features")
    labels = _tensor(labels, "labels")
    valid_mask = _tensor(valid_mask, "valid_mask")
    if not isinstance(sparse_features, KeyedJaggedTensor):
        raise TypeError(f"sparse_features must be a KeyedJaggedTensor, got {type(sparse_features).__name__}")
    if dense_features.dim() != 2 or not dense_features.is_floating_point():
        raise ValueError(
            f"dense_features must be a 2-D float tensor [B, Dd], got shape {tuple(dense_features.shape)} "
            f"dtype {dense_features.dtype}"
        )
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D [B], got shape {tuple(labels.shape)}")
    if valid_mask.dtype != torch.bool:
        raise TypeError(f"valid_mask must be a bool tensor, got dtype {valid_mask.dtype}")
    batch_size = labels.shape[0]
    if valid_mask.shape != (batch_size,) or dense_features.shape[0] != batch_size:
        raise ValueError(
            f"dense_features {tuple(dense_features.shape)}, labels {tuple(labels.shape)} and valid_mask "
            f"{tuple(valid_mask.shape)} must share the batch size B = labels.shape[0] = {batch_size}"
        )
    if sparse_features.keys() and sparse_features.stride() != batch_size:
        raise ValueError(
            f"sparse_features has stride {sparse_features.stride()} but the batch size is {batch_size} "
            "(labels.shape[0])"
        )
