"""Compile one captured launch variant for one GPU target, without a GPU, and read what the target reports.

A job is plain JSON (written by :mod:`tritonrec.kernels.aot` from captured launches): the kernel's
``module:function``, one entry per parameter (constexprs by value, tensors by dtype, ints by width) and the compile
options (warps, stages, fp fusion). :func:`compile_job` rebuilds stand-in arguments and runs Triton's own JIT path
for the target: the binder that specialises arguments, ``_pack_args``, ``ASTSource`` and ``triton.compile``.
Stand-in tensors are 16-byte aligned (as device allocations are) and ints are generic (never 1, not a multiple of
16), so the variant compiled is the general one a real launch of that kernel could take.

What is read back: shared memory (LDS on AMD) from the metadata; on CUDA, registers, stack frame and spill bytes
from ptxas' ``-v`` log and ``.local`` declarations in the PTX; on AMD, VGPR/SGPR counts, spill counts, scratch
(private segment) bytes and occupancy from the AMDGCN assembly.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch

# Generic int stand-ins: i32 and i64 values that Triton neither specialises to constexpr 1 nor marks 16-divisible.
INT_STAND_INS = {"i32": 17, "i64": (1 << 40) + 17}


@dataclass(frozen=True)
class Target:
    """A GPU target the AOT tool compiles for, with its per-block shared memory (LDS) limit in bytes."""

    name: str
    backend: str
    arch: int | str
    warp_size: int
    shared_limit: int


TARGETS = {
    "sm80": Target("sm80", "cuda", 80, 32, 163 * 1024),
    "sm90": Target("sm90", "cuda", 90, 32, 227 * 1024),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 64 * 1024),
}

# Grid limits: CUDA and HIP allow 2**31 - 1 programs on axis x and 65535 on y and z; on AMD the dispatch packet also
# stores programs x threads per axis as a uint32 (a HIP launch beyond it fails with "invalid argument").
MAX_GRID = (2**31 - 1, 65535, 65535)
HIP_MAX_WORK_ITEMS = 2**32 - 1


def grid_problems(grid: tuple[int, int, int], num_warps: int, target: Target) -> list[str]:
    """Why ``grid`` cannot launch on ``target`` with ``num_warps`` warps per program (empty when it can)."""
    problems = [f"grid axis {'xyz'[a]} = {g} > {MAX_GRID[a]}" for a, g in enumerate(grid) if g > MAX_GRID[a]]
    threads = num_warps * target.warp_size
    if target.backend == "hip" and grid[0] * threads > HIP_MAX_WORK_ITEMS:
        problems.append(f"grid x {grid[0]} x {threads} threads > 2**32 - 1 work items (HIP)")
    return problems


def describe_arg(value: Any) -> Any:
    """JSON descriptor of one launch argument (see :func:`stand_in`)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return {"int": "i32" if -(2**31) <= value < 2**31 else "i64"}
    if isinstance(value, float):
        return {"float": "fp32"}
    raise TypeError(f"cannot describe kernel argument {value!r} of type {type(value).__name__}")


def stand_in(descriptor: Any) -> Any:
    """An argument that specialises like the described one: a small aligned CPU tensor, a generic int, a float."""
    if isinstance(descriptor, dict):
        if "tensor" in descriptor:
            return torch.empty(16, dtype=getattr(torch, descriptor["tensor"]))
        if "int" in descriptor:
            return INT_STAND_INS[descriptor["int"]]
        return 1.5
    return descriptor


def resolve_kernel(name: str) -> Any:
    """``module:function`` -> the module attribute (autotuner, heuristics or jitted function)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _jit_function(kernel: Any) -> Any:
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}
_AMDGCN = {
    "registers": r"^\s*\.vgpr_count:\s+(\d+)",
    "sgprs": r"^\s*\.sgpr_count:\s+(\d+)",
    "vgpr_spills": r"^\s*\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"^\s*\.sgpr_spill_count:\s+(\d+)",
    "scratch_bytes": r"^\s*\.private_segment_fixed_size:\s+(\d+)",
    "occupancy": r"^; Occupancy: (\d+)",
}


def _read(patterns: dict[str, str], text: str) -> dict[str, int]:
    out = {}
    for key, pattern in patterns.items():
        found = re.findall(pattern, text, flags=re.MULTILINE)
        if found:
            out[key] = max(int(v) for v in found)
    return out


def ptx_local_bytes(ptx: str) -> int:
    """Bytes of ``.local`` (per-thread local memory) the PTX declares."""
    return sum(int(n) for n in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx))


# Spills below the register ceiling of at most this many bytes are the allocator's, not the tile's: Triton 3.9 runs
# ptxas with --regAllocOptLevel=2 (a ptxas 13 workaround), and the same PTX without it spills nothing at the same
# register count. They are reported as "minor-spill" and do not fail the sweep.
MINOR_SPILL_BYTES = 64


def spill_status(stats: dict[str, Any], num_warps: int, target: Target) -> str | None:
    """``"spills"`` when a compile moves values through memory because its registers ran out: on CUDA, spills or
    PTX local memory at the register ceiling (255, or 64K / threads) or of more than ``MINOR_SPILL_BYTES``; on AMD,
    any VGPR spill or scratch. ``"minor-spill"`` for smaller CUDA spills below the ceiling; None otherwise. A ptxas
    stack frame without spills, and SGPR spills (into VGPR lanes), are reported but not counted."""
    value = lambda key: int(stats.get(key) or 0)
    if target.backend == "hip":
        return "spills" if value("vgpr_spills") or value("scratch_bytes") else None
    spilled = max(value("spill_store_bytes"), value("spill_load_bytes")) + value("local_bytes")
    if not spilled:
        return None
    ceiling = min(255, 65536 // (num_warps * target.warp_size))
    return "spills" if value("registers") >= ceiling or spilled > MINOR_SPILL_BYTES else "minor-spill"


def compile_job(job: dict[str, Any], target: Target) -> dict[str, Any]:
    """Compile ``job`` for ``target``; returns the stats (plus ``error`` when Triton or the assembler fails)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(resolve_kernel(job["kernel"]))
    args = [stand_in(d) for d in job["args"]]
    kwargs = dict(job["kwargs"])
    gpu = GPUTarget(target.backend, target.arch, target.warp_size)
    backend = make_backend(gpu)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    try:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)
    except Exception as error:  # any compile failure is a result to report, not a crash of the sweep
        first = str(error).strip().splitlines()
        return {"error": f"{type(error).__name__}: {first[0] if first else ''}"[:300]}
    stats: dict[str, Any] = {"shared_bytes": int(compiled.metadata.shared)}
    if target.backend == "cuda":
        stats |= _read(_PTXAS, log.getvalue())
        stats["local_bytes"] = ptx_local_bytes(compiled.asm["ptx"])
    else:
        stats |= _read(_AMDGCN, compiled.asm["amdgcn"])
    return stats


def init_worker() -> None:
    """Per compile process: a private, throw-away Triton cache, so every job really compiles (a cache hit would
    skip ptxas and its log) and thousands of kernels do not land in ``~/.triton``."""
    from triton import knobs

    knobs.cache.dir = tempfile.mkdtemp(prefix="tritonrec-aot-")
    atexit.register(shutil.rmtree, knobs.cache.dir, ignore_errors=True)
