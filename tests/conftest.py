"""Session setup shared by every test: interpreter mode, seeds, markers, and the one dtype tolerance table.

``TRITON_INTERPRET=1`` must be set before Triton (or any tritonrec kernel module) is imported, because Triton decides
at decoration time whether a kernel is compiled or interpreted, for the whole process. So a session runs one of two
suites, on any machine:

* ``python -m pytest`` (the default, CI's): the interpreter is on; kernels run on CPU tensors against their twins.
  Tests marked ``gpu`` are skipped.
* ``TRITON_INTERPRET=0 python -m pytest -m gpu`` on a CUDA machine: the compiled kernels on the GPU. The CPU suite's
  tests would hand CPU tensors to compiled kernels, so they are skipped in this mode, naming the other command.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch  # importing torch does not import triton, so the variable below is still in time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITONREC_AUTOTUNE", "0")

import pytest
from hypothesis import HealthCheck, settings

# TRITON_INTERPRET=0 chosen by the caller: the compiled suite (tests marked gpu), see the module docstring
COMPILED = os.environ["TRITON_INTERPRET"].strip().lower() in ("0", "false", "off", "no")

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


def _old_interpreter_note() -> str | None:
    """Why the CPU suite will fail with the installed Triton, when its interpreter is too old (None otherwise)."""
    try:
        import triton
    except ImportError:
        return None
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if COMPILED or version >= (3, 9):
        return None
    return (
        f"triton {triton.__version__}: its interpreter mis-runs some kernels (a reduction used as a loop bound fails "
        "with numpy 2; fixed in 3.9), so kernel tests under TRITON_INTERPRET=1 need triton>=3.9. The compiled suite "
        "(TRITON_INTERPRET=0 python -m pytest -m gpu) passed on triton 3.6 / torch 2.11."
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    return _old_interpreter_note()


def pytest_configure(config: pytest.Config) -> None:
    note = _old_interpreter_note()
    if note is not None:  # also under -q, which hides the header
        config.issue_config_time_warning(pytest.PytestConfigWarning(note), stacklevel=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not has_cuda():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    elif not COMPILED:
        skip_gpu = pytest.mark.skip(reason="compiled kernels: run TRITON_INTERPRET=0 python -m pytest -m gpu")
    else:
        skip_gpu = None
    skip_cpu_suite = pytest.mark.skip(reason="the CPU suite runs under the interpreter: python -m pytest")
    for item in items:
        if "gpu" in item.keywords:
            if skip_gpu is not None:
                item.add_marker(skip_gpu)
        elif COMPILED:
            item.add_marker(skip_cpu_suite)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
