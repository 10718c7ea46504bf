"""The gradient-division setting of the comm ops (torchrec's ``set_gradient_division``): every comm op divides its
input's gradient by the world size while it is on (the default). An op reads the setting when it is called, so the
setting in force then applies to its backward. Its own module so that every module of comm ops reads the one setting;
re-exported by :mod:`tritonrec.dist.comm_ops`."""

from __future__ import annotations

from tritonrec.dist import comm_checks as checks

_gradient_division: bool = True


def set_gradient_division(val: bool) -> None:
    """Divide the gradients of every comm op by the world size (``True``, default) or not."""
    global _gradient_division
    _gradient_division = checks.check_bool(val, "val")


def get_gradient_division() -> bool:
    return _gradient_division
