"""How tritonrec's kernels become PyTorch operators (``torch.ops.tritonrec.*``), so ``torch.compile``,
``torch.export`` and fx tracing see each public op as one graph node instead of tracing into launchers and twins.

Every public op is a ``torch.library.custom_op`` in the ``tritonrec`` namespace, registered in its own kernel module
next to the public Python function, with:

* an implementation that runs the Triton launcher or the torch twin, chosen by a ``backend`` argument that the public
  function has already resolved (``"triton"`` or ``"torch"``, see :func:`tritonrec.kernels.backend.resolve_backend`);
  a compiled graph therefore keeps the choice made while tracing, and the twin stays the CPU implementation;
* a fake (meta) implementation that gives output shapes and dtypes from input metadata alone; outputs whose size
  depends on tensor contents (``dense_to_jagged`` without ``total_len``, a permute without ``permuted_lengths_sum``)
  get an unbacked size from :func:`dynamic_size`;
* an autograd formula when the op is differentiable; the backward is built from other ``tritonrec`` ops, so it
  compiles too (the fused optimizers' update is an op that declares the weights and state it mutates).

Value checks (negative lengths, offsets that do not match values, out-of-range ids) read tensor contents. They run
inside the op implementations, which always see real tensors, so a compiled or exported graph checks its inputs at
run time exactly as eager code does; checks left in Python code that dynamo traces (the sparse types' constructors)
are skipped while tracing (:func:`tritonrec.kernels.checks.value_checks_enabled`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# torch wraps every custom op implementation in a dynamo-disabling decorator that imports torch._dynamo on the first
# call (~1 s). Importing it with tritonrec moves that cost to import time, instead of into the first KJT op of a job,
# which may sit inside a collective's timeout window.
import torch._dynamo

NAMESPACE = "tritonrec"
_UINT64 = 1 << 64
_INT64_MAX = (1 << 63) - 1


def custom_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op`` for ``tritonrec::<name>`` (the schema is inferred from the type hints)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))


def dynamic_size() -> torch.SymInt:
    """A fresh unbacked size for an output whose length depends on tensor contents (only inside fake impls)."""
    return torch.library.get_ctx().new_dynamic_size()


def seed_arg(seed: int) -> int:
    """A seed in ``[0, 2**64)`` as the int64 an op schema can carry (two's complement); undone by
    :func:`seed_from_arg`."""
    return seed - _UINT64 if seed > _INT64_MAX else seed


def seed_from_arg(seed: int) -> int:
    return seed + _UINT64 if seed < 0 else seed


def optional_outputs(outputs: list[torch.Tensor], present: Iterable[bool]) -> list[torch.Tensor | None]:
    """Re-insert ``None`` for the optional outputs an op did not return (op schemas cannot return ``None`` inside a
    list, so ops return only the present ones, in order)."""
    it = iter(outputs)
    return [next(it) if flag else None for flag in present]


__all__ = ["NAMESPACE", "custom_op", "dynamic_size", "optional_outputs", "seed_arg", "seed_from_arg"]
