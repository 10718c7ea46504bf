"""Every codec kernel compiles for an H100 (sm_90) without a GPU: Triton's full pipeline down to PTX and ptxas.

The interpreter accepts programs the compiler rejects (type mixes, unsupported ops), so this catches GPU-only
failures on a CPU machine. The PTX is also checked for what bit-exactness with the torch twins relies on: IEEE
division (``div.rn``, not the approximate ``div.full``) and no fused multiply-adds (launches pass
``enable_fp_fusion=False``).

The test session runs kernels in the interpreter (``TRITON_INTERPRET=1`` is set before import), where they are not
compilable objects, so one subprocess with the variable cleared compiles every case (this file run as a script).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tritonrec.kernels.codecs import BF16, FP8_E4M3, FP8_E5M2, FP16, fp8_rowwise, half, int8_rowwise, mx4  # noqa: E402

pytestmark = pytest.mark.slow

SCALAR_TYPES = {
    "n": "i32",
    "loss_scale": "fp32",
    "k1": "i64",
    "k2": "i64",
    "N_BUCKET": "i32",
    "G_BUCKET": "i32",
    "num_groups": "i32",
    "cols": "i32",
    "groups_per_row": "i32",
    "row_stride": "i64",
    "row_dim": "i32",
    "words_per_row": "i32",
    "group_size": "i32",
    "row_bytes": "i32",
}
TILE = {"ROW_P2": 32, "ELEMS": 4096, "BLOCK_G": 128, "COLS": 32}


def _jit(kernel: object) -> JITFunction:
    while not isinstance(kernel, JITFunction):  # autotune / heuristics wrappers
        kernel = kernel.fn
    return kernel


def compile_ptx(kernel: object, pointers: dict[str, str], constexprs: dict[str, object], fusion: bool = False) -> str:
    fn = _jit(kernel)
    types = {**SCALAR_TYPES, **pointers}
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion})
    return compiled.asm["ptx"]


def _cases() -> dict[str, tuple[object, dict[str, str], dict[str, object]]]:
    cases = {}
    for stochastic in (False, True):
        for spec in (FP16, BF16):
            constexprs = {"HAS_SCALE": True, "STOCHASTIC": stochastic, "MBITS": spec.mbits, "BIAS": spec.bias}
            constexprs |= {"MAX_BITS": spec.max_value_bits, "INF_CODE": spec.inf_code, "NAN_CODE": spec.nan_code}
            cases[f"half_encode_{spec.name}_{stochastic}"] = (
                half._half_encode_kernel,
                {"x_ptr": "*fp32", "out_ptr": "*i16"},
                constexprs | {"BLOCK": 1024},
            )
        for spec in (FP8_E4M3, FP8_E5M2):
            constexprs = {"MBITS": spec.mbits, "BIAS": spec.bias, "EMAX": spec.emax}
            constexprs |= {"SIG_LIMIT": spec.scale_sig_limit(stochastic), "OVERFLOW_CODE": spec.overflow_code}
            constexprs |= {"NAN_CODE": spec.nan_code, "INF_CODE": spec.inf_code or -1, "STOCHASTIC": stochastic}
            cases[f"fp8_encode_{spec.name}_{stochastic}"] = (
                fp8_rowwise._fp8_encode_kernel,
                {"x_ptr": "*fp32", "words_ptr": "*i32"},
                constexprs | TILE,
            )
        cases[f"int8_encode_{stochastic}"] = (
            int8_rowwise._int8_encode_kernel,
            {"x_ptr": "*fp32", "words_ptr": "*i32"},
            {"STOCHASTIC": stochastic} | TILE,
        )
        cases[f"mx4_encode_{stochastic}"] = (
            mx4._mx4_encode_kernel,
            {"x_ptr": "*fp32", "out_ptr": "*u8"},
            {"SIG_LIMIT": 0xDFFFFF, "STOCHASTIC": stochastic} | TILE,
        )
    for kind, out in ((0, "*fp32"), (2, "*i16")):
        cases[f"half_decode_{kind}"] = (
            half._half_decode_kernel,
            {"q_ptr": "*i16", "out_ptr": out},
            {"IS_BF16": False, "HAS_SCALE": True, "OUT_KIND": kind, "BLOCK": 1024},
        )
        cases[f"fp8_decode_{kind}"] = (
            fp8_rowwise._fp8_decode_kernel,
            {"q_ptr": "*u8", "out_ptr": out},
            {"MBITS": 2, "BIAS": 15, "INF_CODE": 0x7C, "NAN_ABOVE": 0x7C, "OUT_KIND": kind} | TILE,
        )
        cases[f"int8_decode_{kind}"] = (
            int8_rowwise._int8_decode_kernel,
            {"q_ptr": "*u8", "out_ptr": out},
            {"OUT_KIND": kind} | TILE,
        )
        cases[f"mx4_decode_{kind}"] = (
            mx4._mx4_decode_kernel,
            {"q_ptr": "*u8", "out_ptr": out},
            {"OUT_KIND": kind} | TILE,
        )
    return cases


CASES = _cases()


def _compile_all() -> dict[str, dict[str, bool]]:
    results = {}
    for name, (kernel, pointers, constexprs) in CASES.items():
        ptx = compile_ptx(kernel, pointers, constexprs)
        results[name] = {
            "sm90": ".target sm_90" in ptx,
            "ieee_division": "div.full" not in ptx and "div.approx" not in ptx,
            "no_fma": re.search(r"\bfma\.", ptx) is None,
        }
    # The FMA check has teeth: with fusion on (Triton's default), INT8 decode's code * scale + bias becomes one fma.
    kernel, pointers, constexprs = CASES["int8_decode_0"]
    fused = compile_ptx(kernel, pointers, constexprs, fusion=True)
    results["int8_decode_with_fusion"] = {"fma": re.search(r"\bfma\.", fused) is not None}
    return results


@functools.cache
def compiled_in_subprocess() -> dict[str, dict[str, bool]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_for_sm90_with_exact_arithmetic(name):
    assert compiled_in_subprocess()[name] == {"sm90": True, "ieee_division": True, "no_fma": True}


def test_fma_check_detects_contraction():
    assert compiled_in_subprocess()["int8_decode_with_fusion"] == {"fma": True}


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
