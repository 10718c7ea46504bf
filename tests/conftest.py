"""Session setup shared by every test: interpreter mode, seeds, markers, and the one dtype tolerance table.

``TRITON_INTERPRET=1`` must be set before Triton (or any tritonrec kernel module) is imported, because Triton decides
at decoration time whether a kernel is compiled or interpreted. On a machine with CUDA the compiled kernels run
instead (the interpreter is not forced there), and tests marked ``gpu`` run too.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch  # importing torch does not import triton, so the variable below is still in time

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITONREC_AUTOTUNE", "0")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "tritonrec",
    deadline=None,  # the interpreter is slow and its first call compiles nothing but still warms caches
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("thorough", parent=settings.get_profile("tritonrec"), max_examples=300, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "tritonrec"))

# Tolerances for sums (pooled lookups, reductions), keyed by the dtype of the values being summed. Gathers, permutes,
# packing and codec bytes are compared exactly (rtol=atol=0) and never use this table. For low precision the
# flash-attention rule applies on top: kernel error vs an fp32 reference <= 2x the torch twin's error in that dtype.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


@pytest.fixture
def tolerance() -> Callable[[torch.dtype], dict[str, float]]:
    """``tolerance(dtype)`` -> ``assert_close`` keyword arguments for sums in ``dtype``."""
    return TOLERANCES.__getitem__


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
