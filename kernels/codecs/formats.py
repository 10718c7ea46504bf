"""The number formats the comm codecs write, their row layouts, and the input checks every codec op shares.

A :class:`MiniFloat` describes a small binary float by its mantissa width, exponent bias and largest finite code; the
rounding helpers in :mod:`.bits` (Triton) and :mod:`.bits_reference` (torch) take these numbers as constants, so one
algorithm serves FP16, BF16, FP8 E4M3 / E5M2 and the E2M1 elements of MX4.

Row-wise layouts (bytes per row of ``row_dim`` values; all multi-byte fields little-endian):

* FP8 row-wise: ``row_dim`` codes, zero bytes up to a multiple of 4, fp32 scale  -> ``ceil4(row_dim) + 4``
* INT8 row-wise: ``row_dim`` codes, zero bytes up to a multiple of 4, fp32 scale, fp32 bias -> ``ceil4(row_dim) + 8``
* MX4: ``group_size / 2`` bytes of packed E2M1 pairs (element ``2i`` in the low nibble), one E8M0 byte
  -> ``group_size / 2 + 1``
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import torch

from tritonrec.kernels.checks import check_int, check_tensor
from tritonrec.kernels.random_bits import mix32_int, stream_keys  # stream_keys: re-exported, it used to live here

NonFinitePolicy = Literal["propagate", "raise"]
NONFINITE_POLICIES: tuple[str, ...] = ("propagate", "raise")
OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Largest row (or MX group) a row-wise kernel holds in registers as one tile.
MAX_ROW_DIM = 8192


@dataclass(frozen=True)
class MiniFloat:
    """A binary float with ``mbits`` stored mantissa bits and exponent bias ``bias``.

    ``max_code`` is the magnitude code (sign bit clear) of the largest finite value. ``overflow_code`` is what a
    rounded magnitude beyond it becomes: the Inf code for IEEE-like formats, ``max_code`` for formats without Inf
    (saturation). ``nan_code`` is the canonical NaN every NaN input maps to (``None``: the format has no NaN).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_code: int
    overflow_code: int
    nan_code: int | None
    inf_code: int | None

    @property
    def sign_shift(self) -> int:
        return self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (subnormals share it)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_value(self) -> float:
        mantissa = (self.max_code & ((1 << self.mbits) - 1)) | (1 << self.mbits)
        return mantissa * 2.0 ** (self.emax - self.mbits)

    @property
    def max_value_bits(self) -> int:
        """fp32 bit pattern of :attr:`max_value` (clamping magnitudes is an integer ``min`` on these bits)."""
        return struct.unpack("<I", struct.pack("<f", self.max_value))[0]

    def scale_sig_limit(self, stochastic: bool) -> int:
        """Largest 24-bit significand of a row's absolute max that may sit at exponent :attr:`emax` after scaling.

        A row scale ``2**s`` puts ``amax / 2**s`` at exponent ``emax``; when its significand exceeds this limit the
        largest value would round past :attr:`max_value`, so the scale is doubled. Round-to-nearest-even may keep
        values up to the halfway point to the next code (inclusive when the tie goes down to an even ``max_code``);
        stochastic rounding may round any value above ``max_value`` up, so its limit is ``max_value`` itself.
        """
        max_sig = ((self.max_code & ((1 << self.mbits) - 1)) | (1 << self.mbits)) << (23 - self.mbits)
        if stochastic:
            return max_sig
        halfway = max_sig + (1 << (22 - self.mbits))
        return halfway - (self.max_code & 1)


FP16 = MiniFloat(
    "fp16", ebits=5, mbits=10, bias=15, max_code=0x7BFF, overflow_code=0x7C00, nan_code=0x7E00, inf_code=0x7C00
)
BF16 = MiniFloat(
    "bf16", ebits=8, mbits=7, bias=127, max_code=0x7F7F, overflow_code=0x7F80, nan_code=0x7FC0, inf_code=0x7F80
)
# OCP FP8 E4M3 "fn": no Inf, NaN only at S.1111.111; max 448.
FP8_E4M3 = MiniFloat("e4m3", ebits=4, mbits=3, bias=7, max_code=0x7E, overflow_code=0x7E, nan_code=0x7F, inf_code=None)
# OCP FP8 E5M2: IEEE-like, Inf at S.11111.00, max 57344. 0x7F is a quiet NaN.
FP8_E5M2 = MiniFloat("e5m2", ebits=5, mbits=2, bias=15, max_code=0x7B, overflow_code=0x7C, nan_code=0x7F, inf_code=0x7C)
# OCP MXFP4 element: E2M1, no Inf or NaN, max 6.
FP4_E2M1 = MiniFloat("e2m1", ebits=2, mbits=1, bias=1, max_code=0x7, overflow_code=0x7, nan_code=None, inf_code=None)

HALF_FORMATS: dict[str, MiniFloat] = {"fp16": FP16, "bf16": BF16}
FP8_FORMATS: dict[str, MiniFloat] = {"e4m3": FP8_E4M3, "e5m2": FP8_E5M2}
HALF_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

# E8M0 shared exponents of MX4 hold 2**(byte - 127) for byte 0..254; 0xFF is NaN (OCP MX v1.0).
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# FP8 row scales are powers of two stored as fp32, so the smallest is the fp32 subnormal 2**-149.
FP32_MIN_POW2_EXP = -149


def ceil4(n: int) -> int:
    return (n + 3) // 4 * 4


def fp8_row_bytes(row_dim: int) -> int:
    """Bytes per FP8 row: codes padded to 4 bytes, then the fp32 scale."""
    return ceil4(row_dim) + 4


def int8_row_bytes(row_dim: int) -> int:
    """Bytes per INT8 row: codes padded to 4 bytes, then the fp32 scale and the fp32 bias."""
    return ceil4(row_dim) + 8


def mx4_group_bytes(group_size: int) -> int:
    """Bytes per MX4 group: two E2M1 codes per byte, then the E8M0 shared exponent."""
    return group_size // 2 + 1


def derive_seed(*parts: int) -> int:
    """Fold several non-negative ints (a base seed, a call counter, a rank...) into one 63-bit seed."""
    acc = 0x2545F491
    for part in parts:
        acc = ((acc << 32) | mix32_int(acc ^ mix32_int(part) ^ mix32_int(part >> 32))) & ((1 << 63) - 1)
    return acc


def check_float32_input(input: torch.Tensor, name: str = "input", ndim: int | tuple[int, ...] | None = None) -> None:
    check_tensor(input, name, ndim=ndim, dtypes=(torch.float32,))


def check_row_dim(row_dim: object, name: str = "row_dim", *, even: bool = False) -> int:
    row_dim = check_int(row_dim, name)
    if not 1 <= row_dim <= MAX_ROW_DIM or (even and row_dim % 2):
        what = "an even int" if even else "an int"
        raise ValueError(f"{name} must be {what} in [1, {MAX_ROW_DIM}], got {name}={row_dim}")
    return row_dim


def check_seed(seed: object) -> int:
    seed = check_int(seed, "seed")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got seed={seed}")
    return seed


def check_output_dtype(output_dtype: object) -> torch.dtype:
    if not isinstance(output_dtype, torch.dtype):
        raise TypeError(f"output_dtype must be a torch.dtype, got {type(output_dtype).__name__}")
    if output_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"output_dtype must be one of {list(OUTPUT_DTYPES)}, got output_dtype={output_dtype}")
    return output_dtype


def check_nonfinite_policy(nonfinite: object) -> str:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got nonfinite={nonfinite!r}")
    return str(nonfinite)


def check_format(fmt: object, formats: dict[str, MiniFloat], name: str = "fmt") -> MiniFloat:
    if fmt not in formats:
        raise ValueError(f"{name} must be one of {sorted(formats)}, got {name}={fmt!r}")
    return formats[str(fmt)]


def raise_if_nonfinite(input: torch.Tensor, name: str = "input") -> None:
    """The ``nonfinite="raise"`` policy: name the first NaN/Inf (costs a device sync)."""
    bad = ~torch.isfinite(input)
    if bool(bad.any()):
        where = int(bad.reshape(-1).nonzero()[0].item())
        raise ValueError(
            f"{name} holds a non-finite value: {name}.flatten()[{where}] = {input.reshape(-1)[where].item()} "
            "(nonfinite='raise'; use nonfinite='propagate' to carry it through as NaN)"
        )


def rowwise_groups(input: torch.Tensor, row_dim: int, name: str = "input") -> tuple[int, int, int]:
    """Shape bookkeeping of a row-wise encode: ``(rows R, columns C, groups per row K)``.

    A 1-D ``[N]`` input is ``N / row_dim`` rows of ``row_dim`` (``N`` must divide); a 2-D ``[R, C]`` input keeps its
    rows and zero-pads each to ``K * row_dim`` with ``K = ceil(C / row_dim)``.
    """
    if input.dim() == 1:
        n = input.shape[0]
        if n % row_dim:
            raise ValueError(
                f"{name} has {n} values, not a multiple of row_dim={row_dim}: pass a 2-D [rows, cols] tensor (each "
                f"row is zero-padded to a multiple of row_dim, see padded_size) or pick a row_dim that divides {n}"
            )
        return n // row_dim, row_dim, 1
    rows, cols = input.shape
    return rows, cols, -(-cols // row_dim)


def check_encoded(input: torch.Tensor, unit_bytes: int, what: str, name: str = "input") -> int:
    """A 1-D or 2-D uint8 encoding made of whole ``unit_bytes`` rows/groups; returns the number of them per row."""
    check_tensor(input, name, ndim=(1, 2), dtypes=(torch.uint8,))
    width = input.shape[-1]
    if width % unit_bytes:
        raise ValueError(
            f"{name} must hold whole {what} of {unit_bytes} bytes along its last dim, got shape {tuple(input.shape)}"
        )
    return width // unit_bytes


__all__ = [
    "BF16",
    "FP4_E2M1",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP8_FORMATS",
    "FP16",
    "HALF_FORMATS",
    "MiniFloat",
    "NonFinitePolicy",
    "ceil4",
    "derive_seed",
    "fp8_row_bytes",
    "int8_row_bytes",
    "mx4_group_bytes",
    "stream_keys",
]
