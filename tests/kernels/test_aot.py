"""The AOT compiler's parts that need no compiler: launch capture and config expansion, coverage of every kernel in
the package, grid limits at production sizes, what is read from ptxas / AMDGCN output, and the committed CSV. The
compiles themselves run in ``.ci/run`` (``python -m tritonrec.kernels.aot --sweep ci``) and the full sweep wrote
``benchmarks/results/aot_compile.csv``."""

from __future__ import annotations

import csv
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tritonrec.kernels import aot_workloads, checks, jagged_to_padded_dense
from tritonrec.kernels.aot import representative
from tritonrec.kernels.aot_compile import (
    _AMDGCN,
    _PTXAS,
    TARGETS,
    _read,
    describe_arg,
    grid_problems,
    ptx_local_bytes,
    spill_status,
    stand_in,
)
from tritonrec.kernels.aot_coverage import discover_kernels, reached_kernels, unreached_kernels
from tritonrec.kernels.jagged_dense import _jagged_to_padded_dense_kernel
from tritonrec.kernels.launch_capture import capture_launches, expand_launch

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "benchmarks" / "results" / "aot_compile.csv"


def _committed_rows() -> list[dict[str, str]]:
    with CSV.open() as f:
        return list(csv.DictReader(f))


def test_committed_sweep_reaches_every_kernel_of_the_package() -> None:
    """A kernel added without a workload (or without re-running the sweep) is missing from the committed CSV."""
    compiled = {row["kernel"] for row in _committed_rows()}
    missing = discover_kernels() - reached_kernels(compiled)
    assert not missing, f"not compiled by the committed AOT sweep: {sorted(missing)}"


def test_committed_sweep_is_clean_on_every_target() -> None:
    rows = _committed_rows()
    assert {row["target"] for row in rows} == {"sm80", "sm90", "gfx942"}
    bad = [
        (r["kernel"], r["config"], r["target"], r["status"]) for r in rows if r["status"] not in ("ok", "minor-spill")
    ]
    assert not bad, bad[:10]
    for row in rows:
        assert int(row["shared_bytes"]) <= int(row["shared_limit"])


def test_an_unlaunched_kernel_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coverage check finds a kernel nobody launches, but not a helper a launched kernel calls."""
    package = tmp_path / "planted_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ops.py").write_text(
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def _helper(x):
                return x + 1

            @triton.jit
            def launched_kernel(ptr):
                tl.store(ptr, _helper(tl.load(ptr)))

            @triton.jit
            def forgotten_kernel(ptr):
                tl.store(ptr, 0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_kernels", raising=False)
    names = ("_helper", "launched_kernel", "forgotten_kernel")
    assert discover_kernels("planted_kernels") == {f"planted_kernels.ops:{n}" for n in names}
    launched = {"planted_kernels.ops:launched_kernel"}
    assert unreached_kernels(launched, "planted_kernels") == ["planted_kernels.ops:forgotten_kernel"]


def test_capture_records_the_launch_and_expands_every_config() -> None:
    values, offsets = torch.randn(5, 3), torch.tensor([0, 2, 2, 5])
    with capture_launches() as launches:
        out = jagged_to_padded_dense(values, offsets, 4, backend="triton")
    assert torch.equal(out, jagged_to_padded_dense(values, offsets, 4, backend="torch"))  # it really ran
    (launch,) = launches
    assert launch.kernel is _jagged_to_padded_dense_kernel
    variants = expand_launch(launch)
    assert [v.constexprs["BLOCK_L"] for v in variants] == [c.kwargs["BLOCK_L"] for c in launch.kernel.configs]
    for variant, config in zip(variants, launch.kernel.configs, strict=True):
        assert variant.constexprs["BLOCK_D"] == 4 and variant.options["num_warps"] == config.num_warps
        assert len(variant.args) == len(launch.kernel.arg_names)  # every parameter, config values included
        assert variant.grid[1:] == (1, 1) and variant.grid[0] == 3 * -(-4 // config.kwargs["BLOCK_L"])
    assert len(expand_launch(launch, all_configs=False)) == 1


def test_skipped_launches_run_nothing() -> None:
    values = torch.randn(5, 3)
    with capture_launches(execute=False) as launches:
        jagged_to_padded_dense(values, torch.tensor([0, 2, 2, 5]), 4, backend="triton")
    assert len(launches) == 1


def test_production_grids_fit_every_target() -> None:
    """Every launch of every op at production sizes (meta tensors, nothing runs) fits CUDA's and HIP's grid limits,
    with every autotune config (jagged_to_padded_dense put max_len / 4 on axis y before, 65536 at 2**18 rows)."""
    checks.set_value_checks(False)
    try:
        problems = []
        for name, workload in aot_workloads.production_workloads().items():
            with capture_launches(execute=False, label=name) as launches:
                workload()
            assert launches, name
            for variant in (v for launch in launches for v in expand_launch(launch)):
                for target in TARGETS.values():
                    problems += grid_problems(variant.grid, variant.options.get("num_warps", 4), target)
    finally:
        checks.set_value_checks(None)
    assert not problems, problems[:5]


def test_grid_limits() -> None:
    sm90, gfx942 = TARGETS["sm90"], TARGETS["gfx942"]
    assert grid_problems((2**31 - 1, 65535, 65535), 4, sm90) == []
    assert grid_problems((1, 65536, 1), 4, sm90) == ["grid axis y = 65536 > 65535"]
    assert grid_problems((2**24, 1, 1), 4, sm90) == []
    assert grid_problems((2**24, 1, 1), 4, gfx942) == ["grid x 16777216 x 256 threads > 2**32 - 1 work items (HIP)"]


PTXAS_LOG = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    2792 bytes stack frame, 4388 bytes spill stores, 4128 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2792 bytes cumulative stack size
"""
AMDGCN = """; NumVgprs: 30
; Occupancy: 3
    .private_segment_fixed_size: 64
    .sgpr_count:     78
    .sgpr_spill_count: 2
    .vgpr_count:     256
    .vgpr_spill_count: 12
"""


def test_stats_are_read_from_ptxas_and_amdgcn() -> None:
    cuda = _read(_PTXAS, PTXAS_LOG)
    assert cuda == {"registers": 255, "stack_bytes": 2792, "spill_store_bytes": 4388, "spill_load_bytes": 4128}
    amd = _read(_AMDGCN, AMDGCN)
    assert amd == {"registers": 256, "sgprs": 78, "vgpr_spills": 12, "sgpr_spills": 2, "scratch_bytes": 64,
                   "occupancy": 3}  # fmt: skip
    ptx = ".local .align 8 .b8 __local_depot0[48];\n.local .align 4 .b8 __local_depot1[16];"
    assert ptx_local_bytes(ptx) == 64


def test_spills_are_told_apart_from_the_allocators_small_ones() -> None:
    sm90, gfx942 = TARGETS["sm90"], TARGETS["gfx942"]
    assert spill_status(_read(_PTXAS, PTXAS_LOG), 4, sm90) == "spills"  # register-bound
    small = {"registers": 96, "stack_bytes": 8, "spill_store_bytes": 4, "spill_load_bytes": 4, "local_bytes": 0}
    assert spill_status(small, 4, sm90) == "minor-spill"
    assert spill_status({**small, "registers": 128}, 16, sm90) == "spills"  # 512 threads: the ceiling is 128
    assert spill_status({**small, "spill_store_bytes": 400}, 4, sm90) == "spills"
    assert spill_status({"registers": 32, "stack_bytes": 8, "spill_store_bytes": 0, "local_bytes": 0}, 4, sm90) is None
    assert spill_status({"registers": 40, "local_bytes": 16}, 4, sm90) == "minor-spill"  # PTX .local counts
    assert spill_status(_read(_AMDGCN, AMDGCN), 4, gfx942) == "spills"
    assert spill_status({"registers": 40, "sgpr_spills": 3, "vgpr_spills": 0, "scratch_bytes": 0}, 4, gfx942) is None


@pytest.mark.parametrize(
    ("value", "descriptor"),
    [(torch.zeros(2, dtype=torch.bfloat16), {"tensor": "bfloat16"}), (1, {"int": "i32"}), (2**40, {"int": "i64"}),
     (0.5, {"float": "fp32"}), (True, True), (None, None)],
)  # fmt: skip
def test_arguments_travel_as_descriptors(value: object, descriptor: object) -> None:
    assert describe_arg(value) == descriptor
    back = stand_in(descriptor)
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and back.data_ptr() % 16 == 0
    elif isinstance(value, int) and not isinstance(value, bool):
        assert back != 1 and back % 16 != 0 and (back >= 2**31) == (value >= 2**31)  # generic, same width


def test_ci_subset_takes_each_kernels_widest_specialisation() -> None:
    jobs = [
        {"kernel": "a", "constexprs": {"BLOCK_D": 4, "FLAG": True}},
        {"kernel": "a", "constexprs": {"BLOCK_D": 128, "FLAG": False}},
        {"kernel": "b", "constexprs": {}},
    ]
    assert [(j["kernel"], j["constexprs"].get("BLOCK_D")) for j in representative(jobs)] == [("a", 128), ("b", None)]
