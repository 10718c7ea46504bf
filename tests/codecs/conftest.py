"""Shared inputs of the codec tests: edge-case values, random data with edge cases mixed in, bit-exact comparison.

Codec outputs are compared as bit patterns (NaN != NaN as floats), so every check goes through :func:`bits`.
Test modules reach these helpers through the session fixtures below (this folder is not importable: its name is a
stdlib module's), which hypothesis tests may use too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

FP32_MAX = 3.4028234663852886e38

# Zeros, +-max of every format, ties of every format, the boundaries where a row scale bumps, fp32 denormals and
# the fp32 extremes, then the non-finite values (kept last so tests can slice them off).
EDGE_VALUES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    65504.0,
    -65504.0,
    65519.996,
    65520.0,
    448.0,
    464.0,
    -465.0,
    480.0,
    57344.0,
    61440.0,
    6.0,
    7.0,
    -7.0,
    1.75,
    0.25,
    0.75,
    3.5,
    2.9802322e-08,  # fp16 smallest subnormal / 2: a tie with 0
    5.9604645e-08,
    1.0000001,
    1.00390625,  # bf16 tie between 1 and 1 + 2**-7
    1e-40,  # fp32 subnormals
    -1.4e-45,
    1.1754942e-38,
    FP32_MAX,
    -FP32_MAX,
    3.3e38,
    float("nan"),
    float("inf"),
    float("-inf"),
]
NUM_FINITE_EDGES = len(EDGE_VALUES) - 3


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bit patterns (same shape), for exact comparison including NaN payloads."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = bits(actual) != bits(expected)
    if bool(diff.any()):
        where = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{int(diff.sum())} differing entries, first at {where}")


def mixed_values(shape: tuple[int, ...], seed: int, finite: bool = False, scale: float = 10.0) -> torch.Tensor:
    """Normal values times ``scale`` with the edge values sprinkled in at random positions."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * scale
    edges = torch.tensor(EDGE_VALUES[:NUM_FINITE_EDGES] if finite else EDGE_VALUES)
    flat = values.view(-1)
    if flat.numel():
        count = min(flat.numel() // 3, edges.numel())
        positions = torch.randperm(flat.numel(), generator=generator)[:count]
        flat[positions] = edges[torch.randperm(edges.numel(), generator=generator)[:count]]
    return values


@pytest.fixture(scope="session")
def same_bits() -> Callable[[torch.Tensor, torch.Tensor], None]:
    return assert_same_bits


@pytest.fixture(scope="session")
def values() -> Callable[..., torch.Tensor]:
    """``values(shape, seed, finite=False, scale=10.0)``: see :func:`mixed_values`."""
    return mixed_values


@pytest.fixture(autouse=True)
def _quiet_interpreter_float_warnings() -> Iterator[None]:
    """The Triton interpreter runs kernels in numpy, which warns about the overflowing and NaN-producing fp32
    arithmetic that the edge values cause on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield
