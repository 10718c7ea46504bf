"""Shape checks for the dense modules' forward inputs (cross nets, DeepFM, interaction arches): a ``ValueError`` that
names the argument, the expected shape and the shape it got, instead of a matmul's size mismatch deep inside.

Metadata only (no device sync). Skipped while ``torch.fx`` traces symbolically: a proxy's shape is itself a proxy and
cannot be compared; the traced graph runs the eager code's maths without re-checking.
"""

from __future__ import annotations

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing


def check_dense_input(
    t: object,
    name: str,
    expected: str,
    *,
    ndim: int,
    last_dim: int | None = None,
    batch_size: int | None = None,
) -> None:
    """``t`` must be a floating tensor of ``ndim`` dimensions, ``last_dim`` wide (when given) and with ``batch_size``
    rows (when given). ``expected`` spells the shape for the error, e.g. ``"[B, in_features=8]"``. Raises
    ``TypeError`` for a non-tensor or non-floating tensor and ``ValueError`` for a wrong shape."""
    if is_fx_symbolic_tracing():
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    wrong_width = last_dim is not None and t.dim() > 0 and t.shape[-1] != last_dim
    wrong_batch = batch_size is not None and t.dim() > 0 and t.shape[0] != batch_size
    if t.dim() != ndim or wrong_width or wrong_batch:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
