"""Import Triton when it exists, and a stand-in that keeps kernel modules importable when it does not.

Kernel modules write ``from tritonrec.kernels._triton import tl, triton`` and decorate their kernels as usual. Without
Triton (macOS, Windows, a minimal install) the decorators return the plain Python function, ``tl`` answers any
attribute with a placeholder (so ``BLOCK: tl.constexpr`` annotations still evaluate), and the backend resolver never
selects the Triton path, so no stand-in kernel is ever launched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:  # pragma: no branch - which arm runs depends on the machine
    if os.environ.get("TRITONREC_DISABLE_TRITON", "0") == "1":
        raise ImportError("Triton disabled through TRITONREC_DISABLE_TRITON=1")
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = str(error)

    class _Placeholder:
        """Stands for any ``tl.<name>`` used at import time (annotations, dtypes)."""

        def __getattr__(self, name: str) -> _Placeholder:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
            return self

    class _TritonStandIn:
        """Decorators become the identity; ``Config`` only records its arguments."""

        __version__ = "absent"

        class Config:
            def __init__(self, kwargs: dict[str, Any], num_warps: int = 4, num_stages: int = 2, **extra: Any) -> None:
                self.kwargs, self.num_warps, self.num_stages, self.extra = kwargs, num_warps, num_stages, extra

        @staticmethod
        def jit(fn: Callable | None = None, **_: Any) -> Callable:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def autotune(*_: Any, **__: Any) -> Callable:
            return lambda f: f

        @staticmethod
        def heuristics(*_: Any, **__: Any) -> Callable:
            return lambda f: f

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _Placeholder()  # type: ignore[assignment]


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors through the interpreter.

    Triton reads the variable when a kernel is decorated, so it must be set before tritonrec's kernel modules are
    imported (tests/conftest.py does this); changing it later has no effect on kernels already defined.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
