"""The benchmark harness writes a run's CSVs (and the plots next to them) under ``benchmarks/results/runs/<date>/``
(git-ignored), and over the committed results only when asked (``--commit-results``, or bench_comm's
``commit_results=true``); bench_comm's ``csv=`` (empty) prints without writing."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402

ROW = {"world_size": 2, "message_bytes": 64, "impl": "ours", "codec": "fp32", "median_ms": 1.0, "p90_ms": 1.2,
       "algbw_gbps": 0.1, "wire_bytes": 64, "wire_gbps": 0.1, "max_abs_err": 0.0, "backend": "gloo"}  # fmt: skip


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("TRITONREC_COMMIT_RESULTS", raising=False)
    monkeypatch.setattr(harness, "_commit_override", None, raising=False)
    return tmp_path


def _bench_comm():
    spec = importlib.util.spec_from_file_location("tritonrec_bench_comm", ROOT / "scripts" / "bench_comm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_results_go_to_a_dated_run_folder_by_default(results: Path) -> None:
    path = harness.append_csv("bench.csv", [{"case": "a", "ms": 1.0}])
    today = datetime.date.today().isoformat()
    assert path == results / "runs" / today / "bench.csv" and path.is_file()
    assert not (results / "bench.csv").exists()
    assert harness.results_dir() == results / "runs" / today


def test_commit_results_writes_the_committed_files(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harness.set_commit_results(True)
    assert harness.append_csv("bench.csv", [{"case": "a"}]) == results / "bench.csv"
    harness.set_commit_results(None)
    monkeypatch.setenv("TRITONREC_COMMIT_RESULTS", "1")
    assert harness.results_dir() == results


def test_a_rows_own_thread_count_is_kept(results: Path) -> None:
    """A benchmark whose ranks ran with their own thread count records it, not the parent process's."""
    import csv

    path = harness.append_csv("bench.csv", [{"case": "a", "threads": 7}, {"case": "b"}])
    written = list(csv.DictReader(path.open()))
    assert list(written[0])[:2] == ["case", "threads"]
    assert written[0]["threads"] == "7" and written[1]["threads"] == str(torch.get_num_threads())


def test_commit_flag_is_taken_off_the_command_line() -> None:
    argv = ["bench_x.py", "--repeats", "3", "--commit-results"]
    assert harness.take_commit_flag(argv) is True and argv == ["bench_x.py", "--repeats", "3"]
    assert harness.take_commit_flag(argv) is False


def test_empty_csv_path_is_refused(results: Path) -> None:
    with pytest.raises(ValueError, match="path is empty"):
        harness.append_csv("", [{"case": "a"}])


def test_bench_comm_empty_csv_prints_without_writing(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench_comm = _bench_comm()
    monkeypatch.setattr(bench_comm, "_spawn_world", lambda cfg, world: [dict(ROW, world_size=world)])
    rows = bench_comm.run(bench_comm.BenchCommConfig(world_sizes=[2], csv="", plot=False))
    assert rows == [ROW] and not any(results.rglob("*.csv"))
    bench_comm.run(bench_comm.BenchCommConfig(world_sizes=[2], csv="comm.csv", plot=False, commit_results=True))
    assert (results / "comm.csv").is_file()


def test_cpu_device_names_the_model_and_the_vector_isa(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rows from different CPUs must be told apart: ratios against FBGEMM's CPU kernels flipped between two VMs."""
    cpu = "model name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n"
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\n{cpu}\nprocessor\t: 1\n{cpu}")
    monkeypatch.setattr(harness, "CPUINFO", str(tmp_path / "cpuinfo"))
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)
    assert harness.device_name("cpu") == "Some CPU 9000, avx512f (2 cores)"
    (tmp_path / "cpuinfo").write_text("model name\t: Older CPU\nflags\t\t: fpu sse2 avx2\n")
    assert harness.device_name("cpu") == "Older CPU, avx2 (2 cores)"
    monkeypatch.setattr(harness, "CPUINFO", str(tmp_path / "absent"))  # not Linux: the architecture alone
    monkeypatch.setattr(harness.platform, "processor", lambda: "")
    monkeypatch.setattr(harness.platform, "machine", lambda: "arm64")
    assert harness.device_name("cpu") == "arm64 (2 cores)"
