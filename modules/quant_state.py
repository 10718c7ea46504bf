"""State-dict formats of a quantized table (``embedding_bags.<table>.``), torchrec 1.8's and ours.

What :class:`~tritonrec.modules.QuantEmbeddingBagCollection` saves is torchrec's quantized EBC state dict in its
``quant_state_dict_split_scale_bias`` mode (the one torchrec's sharded inference modules use), byte for byte:

* ``weight``: uint8 ``[rows, ceil(dim * bits / 8)]`` codes (INT4: two codes per byte, the even column in the low
  nibble; INT2: four, column ``c`` in bits ``2 * (c % 4)``). torchrec wraps INT4 / INT2 codes in a ``UInt4Tensor`` /
  ``UInt2Tensor`` whose ``.shape`` counts codes (``[rows, dim]``); its ``.view(torch.uint8)`` is these bytes. torchrec
  needs an even byte width (``dim % 2 == 0`` for INT8, ``dim % 4 == 0`` for INT4, ``dim % 8 == 0`` for INT2); other
  widths are ours only. FP16 / FP32 tables: the weights' little-endian float bytes, uint8 ``[rows, 2 * dim]`` /
  ``[rows, 4 * dim]`` (any dim).
* ``weight_qscale`` / ``weight_qbias``: fp16 ``[rows, 1]``; FP16 / FP32 tables have neither (as torchrec's).

Loading (:func:`normalize_table_state`) also takes: torchrec's ``UInt4Tensor`` / ``UInt2Tensor`` codes; torchrec's
default mode, one fused uint8 ``weight`` per table with FBGEMM's TBE row ``[scale fp16, bias fp16, codes, padding to
the row alignment]`` (FP16 / FP32: ``[float bytes, padding]``; 16 bytes by default) and no ``weight_qscale`` /
``weight_qbias`` keys; and our earlier ``[rows]`` scale / bias. Anything else of the wrong dtype or shape raises
``ValueError`` naming the key (``load_state_dict`` would otherwise cast silently).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from tritonrec.kernels.embedding.quantized import has_scale_bias, row_bytes

SCALE_BIAS_BYTES = 4  # FBGEMM's TBE row header: fp16 scale, then fp16 bias
BUFFER_NAMES = ("weight", "weight_qscale", "weight_qbias")


def buffer_names(bits: int) -> tuple[str, ...]:
    """A table's state-dict entries: codes, scale and bias (row-wise quantized), or only ``weight`` (FP16 / FP32)."""
    return BUFFER_NAMES if has_scale_bias(bits) else BUFFER_NAMES[:1]


def unwrap_packed(value: Any) -> Any:
    """A tensor subclass of packed uint8 codes (torchrec's ``UInt4Tensor`` / ``UInt2Tensor``) -> its bytes."""
    subclass = isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter)
    return value.view(torch.uint8) if subclass and value.dtype == torch.uint8 else value


def _check(key: str, value: Any, dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype or tuple(value.shape) not in shapes:
        raise ValueError(
            f"{key}: expected {dtype} of shape {' or '.join(str(list(s)) for s in shapes)}, got {value.dtype} of shape "
            f"{list(value.shape)}"
        )
    return value


def split_fused_rows(fused: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FBGEMM TBE rows ``[rows, >= 4 + width]`` uint8 -> (codes ``[rows, width]``, scale ``[rows, 1]``, bias
    ``[rows, 1]`` fp16)."""
    scale = fused[:, 0:2].contiguous().view(torch.float16)
    bias = fused[:, 2:4].contiguous().view(torch.float16)
    return fused[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + width].contiguous(), scale, bias


def normalize_table_state(state_dict: MutableMapping[str, Any], prefix: str, rows: int, dim: int, bits: int) -> None:
    """Rewrite one table's entries (``prefix + "weight"``, ...) present in ``state_dict`` into our format, in place;
    ``ValueError`` naming the key for a wrong dtype or shape. Keys not present are left to ``load_state_dict``."""
    width = row_bytes(dim, bits)
    w_key, s_key, b_key = (prefix + name for name in BUFFER_NAMES)
    header = SCALE_BIAS_BYTES if has_scale_bias(bits) else 0
    if w_key in state_dict:
        weight = unwrap_packed(state_dict[w_key])
        fused = (
            isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and weight.shape[1] >= width + max(header, 1)  # float rows: fused only when padded
            and s_key not in state_dict
            and b_key not in state_dict
        )
        if fused and header:
            weight = _check(w_key, weight, torch.uint8, ((rows, weight.shape[1]),))
            weight, state_dict[s_key], state_dict[b_key] = split_fused_rows(weight, width)
        elif fused:
            weight = _check(w_key, weight, torch.uint8, ((rows, weight.shape[1]),))[:, :width].contiguous()
        state_dict[w_key] = _check(w_key, weight, torch.uint8, ((rows, width),))
    if not header:  # FP16 / FP32: no scale / bias entries (load_state_dict reports any as unexpected)
        return
    for key in (s_key, b_key):
        if key in state_dict:
            value = _check(key, state_dict[key], torch.float16, ((rows, 1), (rows,)))
            state_dict[key] = value.reshape(rows, 1)


__all__ = [
    "BUFFER_NAMES",
    "SCALE_BIAS_BYTES",
    "buffer_names",
    "normalize_table_state",
    "split_fused_rows",
]
