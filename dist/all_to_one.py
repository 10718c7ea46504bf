"""Single-process, multi-device (inference) merges of per-device embeddings onto one device (torchrec's
``EmbeddingsAllToOne``, ``EmbeddingsAllToOneReduce``, ``SeqEmbeddingsAllToOne``): plain device copies, so autograd
flows through them unchanged. FBGEMM's fused merge kernels are replaced by ``torch.cat`` / ``+`` / ``Tensor.to``.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonrec.kernels.checks import check_int


def _check_device_and_size(device: object, world_size: object) -> None:
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {device!r}")
    check_int(world_size, "world_size", 1)


def _check_tensor_list(tensors: object, world_size: int, exact: bool) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if (len(tensors) != world_size) if exact else not 0 < len(tensors) <= world_size:
        bound = f"exactly {world_size}" if exact else f"1 to {world_size}"
        raise ValueError(f"tensors must hold {bound} tensors (one per device), got {len(tensors)}")
    return list(tensors)


class EmbeddingsAllToOne(nn.Module):
    """Concatenates per-device embeddings on ``device`` along ``cat_dim`` (1 for pooled, 0 for sequence)."""

    def __init__(self, device: torch.device, world_size: int, cat_dim: int) -> None:
        super().__init__()
        _check_device_and_size(device, world_size)
        if cat_dim not in (0, 1):
            raise ValueError(f"cat_dim must be 0 (sequence) or 1 (pooled), got cat_dim={cat_dim!r}")
        self._device, self._world_size, self._cat_dim = device, world_size, cat_dim

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        tensors = _check_tensor_list(tensors, self._world_size, exact=False)
        return torch.cat([t.to(self._device, non_blocking=True) for t in tensors], dim=self._cat_dim)


class EmbeddingsAllToOneReduce(nn.Module):
    """Sums per-device pooled embeddings (same shape) on ``device``."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        _check_device_and_size(device, world_size)
        self._device, self._world_size = device, world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        tensors = _check_tensor_list(tensors, self._world_size, exact=True)
        for i, t in enumerate(tensors):
            if t.shape != tensors[0].shape:
                raise ValueError(f"tensors must share one shape, tensors[{i}] is {tuple(t.shape)}, "
                                 f"tensors[0] is {tuple(tensors[0].shape)}")  # fmt: skip
        total = tensors[0].to(self._device)
        for t in tensors[1:]:
            total = total + t.to(self._device)
        return total


class SeqEmbeddingsAllToOne(nn.Module):
    """Copies per-device sequence embeddings to ``device`` (one tensor per device, returned as a list)."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        _check_device_and_size(device, world_size)
        self._device, self._world_size = device, world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        tensors = _check_tensor_list(tensors, self._world_size, exact=True)
        return [t.to(self._device, non_blocking=True) for t in tensors]


__all__ = ["EmbeddingsAllToOne", "EmbeddingsAllToOneReduce", "SeqEmbeddingsAllToOne"]
