"""Which autotune config a kernel runs: a sweep's pin, then the device's tuned file, then runtime autotuning (or the
first config), among the configs that fit the launch; and the tuning sweep's dry run (scripts/autotune.py)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hydra import compose, initialize_config_dir

from tritonrec.kernels import backend, jagged_to_padded_dense, tuned
from tritonrec.kernels.jagged_dense import _jagged_to_padded_dense_kernel as KERNEL
from tritonrec.kernels.launch_capture import candidate_configs, capture_launches, kernel_name

ROOT = Path(__file__).resolve().parents[2]
NAME = kernel_name(KERNEL)


@functools.cache
def _script():
    """scripts/autotune.py as a module (registered, so its dataclass config resolves its own module)."""
    spec = importlib.util.spec_from_file_location("autotune_script", ROOT / "scripts" / "autotune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _launch_key() -> str:
    """The tuning key of the jagged launch below."""
    with capture_launches(execute=False) as launches:
        jagged_to_padded_dense(torch.randn(5, 3), torch.tensor([0, 2, 2, 5]), 4, backend="triton")
    launch = launches[0]
    named = {**dict(zip(KERNEL.arg_names, launch.args, strict=False)), **launch.kwargs}
    return tuned.tuning_key(KERNEL.keys, named)


def _run_and_report_config(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(KERNEL, "cache", {})  # forget the config cached for this key by earlier tests
    values, offsets = torch.randn(5, 3), torch.tensor([0, 2, 2, 5])
    out = jagged_to_padded_dense(values, offsets, 4, backend="triton")
    assert torch.equal(out, jagged_to_padded_dense(values, offsets, 4, backend="torch"))
    return KERNEL.best_config


def _tuned_file(tmp_path: Path, choices: dict, configs: list | None = None) -> Path:
    configs = configs if configs is not None else [tuned.config_record(c) for c in KERNEL.configs]
    entry = {"key": KERNEL.keys, "configs": configs, "choices": choices}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"version": 1, "device": "test", "dry_run": False, "kernels": {NAME: entry}}))
    tuned._load.cache_clear()
    return path


def test_device_file_name() -> None:
    assert tuned.device_file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert tuned.device_file_name("AMD Instinct MI300X") == "amd-instinct-mi300x.json"


def test_tuning_key_is_key_values_then_tensor_dtypes() -> None:
    args = {"x": torch.zeros(1, dtype=torch.float16), "N_BUCKET": 64, "FLAG": True, "y": torch.zeros(1)}
    assert tuned.tuning_key(["N_BUCKET", "FLAG"], args) == "N_BUCKET=64,FLAG=1|torch.float16,torch.float32"


def test_nearest_choice_matches_flags_and_dtypes_and_the_closest_buckets() -> None:
    choices = {"L_BUCKET=16,BLOCK_D=4|torch.float32": "a", "L_BUCKET=4096,BLOCK_D=4|torch.float32": "b"}
    assert tuned.nearest_choice(choices, "L_BUCKET=16,BLOCK_D=4|torch.float32") == "a"
    assert tuned.nearest_choice(choices, "L_BUCKET=1024,BLOCK_D=4|torch.float32") == "b"
    assert tuned.nearest_choice(choices, "L_BUCKET=32,BLOCK_D=4|torch.float32") == "a"
    assert tuned.nearest_choice(choices, "L_BUCKET=16,BLOCK_D=8|torch.float32") is None  # a tile width differs
    assert tuned.nearest_choice(choices, "L_BUCKET=16,BLOCK_D=4|torch.float16") is None


def test_the_tuned_file_picks_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITONREC_TUNED", str(_tuned_file(tmp_path, {_launch_key(): {"config": 2}})))
    try:
        assert _run_and_report_config(monkeypatch) is KERNEL.configs[2]  # the interpreter alone would take [0]
    finally:
        tuned._load.cache_clear()


def test_without_a_usable_entry_kernels_behave_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = [{"kwargs": {"BLOCK_L": 3}, "num_warps": 1, "num_stages": 1}]  # a config the kernel no longer has
    for path in (tmp_path / "missing.json", _tuned_file(tmp_path, {_launch_key(): {"config": 0}}, gone)):
        monkeypatch.setenv("TRITONREC_TUNED", str(path))
        try:
            assert _run_and_report_config(monkeypatch) is KERNEL.configs[0]
        finally:
            tuned._load.cache_clear()


def test_a_pin_beats_the_tuned_file_and_fits_filters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITONREC_TUNED", str(_tuned_file(tmp_path, {_launch_key(): {"config": 2}})))
    try:
        with backend.pinned_config(NAME, KERNEL.configs[3]):
            assert _run_and_report_config(monkeypatch) is KERNEL.configs[3]
    finally:
        tuned._load.cache_clear()
    chooser = backend.ConfigChooser("k", ["N"], fits=lambda config, args: config["BLOCK_L"] <= args["N"])
    configs = list(KERNEL.configs)  # BLOCK_L 16, 4, 64, 128
    monkeypatch.delenv("TRITONREC_TUNED")
    backend.set_autotune(True)
    try:
        assert [c.kwargs["BLOCK_L"] for c in chooser(configs, {"N": 20})] == [16, 4]
    finally:
        backend.set_autotune(None)
    assert chooser(configs, {"N": 20}) == [configs[0]]  # autotuning off (interpreter): the first that fits
    with pytest.raises(ValueError, match="no autotune config of k fits"):
        chooser(configs, {"N": 2})


@pytest.mark.parametrize("path", sorted(tuned.TUNED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_tuned_file_matches_the_kernels_it_names(path: Path) -> None:
    """A shipped file is read on its device only, so drift (a kernel renamed or moved, its autotune configs or key
    changed) would silently fall back to runtime autotuning there: every entry must still name an autotuned kernel
    with the same key, and every chosen config must be one of that kernel's configs."""
    table = json.loads(path.read_text())
    assert table["version"] == tuned.FORMAT_VERSION and table["dry_run"] is False, "ship only timed sweeps"
    assert path.name == tuned.device_file_name(table["device"])
    assert table["kernels"], "an empty tuned file"
    for name, entry in table["kernels"].items():
        module, _, function = name.partition(":")
        kernel = getattr(importlib.import_module(module), function)
        assert kernel_name(kernel) == name
        assert list(kernel.keys) == entry["key"], f"{name}: autotune key changed"
        candidates = [tuned.config_record(c) for c in kernel.configs]
        assert entry["choices"], f"{name}: no choices"
        for key, choice in entry["choices"].items():
            record = entry["configs"][choice["config"]]
            assert record in candidates, f"{name} at {key}: chosen config {record} is no longer one of its configs"
            assert set(tuned._parse(key)[0]) <= set(entry["key"]), f"{name}: key {key} names fields not in the key"


def test_candidates_are_every_fitting_config_whatever_the_pins() -> None:
    with capture_launches(execute=False) as launches:
        jagged_to_padded_dense(torch.randn(5, 3), torch.tensor([0, 2, 2, 5]), 4, backend="triton")
    launch = launches[0]
    with backend.pinned_config(NAME, KERNEL.configs[1]):
        assert candidate_configs(KERNEL, launch.args, launch.kwargs) == list(KERNEL.configs)


def test_every_shape_grid_composes() -> None:
    script = _script()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        for grid in ("production", "small", "dry"):
            cfg = compose(config_name="autotune", overrides=[f"autotune_shapes={grid}", "dry_run=true"])
            ops = script.check_config(script.OmegaConf.to_object(cfg))
            assert ops == list(script.autotune_sweep.OPS)
            assert all(script.shape_points(cfg.shapes[op]) for op in ops)
        bad = compose(config_name="autotune", overrides=["op=nope", "dry_run=true"])
        with pytest.raises(ValueError, match="op must be 'all' or one of"):
            script.check_config(script.OmegaConf.to_object(bad))


def test_dry_run_validates_every_config_and_writes_the_tuned_structure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every op, tiny shapes, each config once through the interpreter; the file it writes then drives the kernels."""
    script = _script()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(
            config_name="autotune",
            overrides=[
                "autotune_shapes=dry",
                "dry_run=true",
                f"tuned_dir={tmp_path / 'shared'}",
                f"out_dir={tmp_path}",
            ],
        )
    metrics = script.run(cfg)  # fmt: skip
    document = json.loads(Path(metrics["tuned_file"]).read_text())
    assert document["version"] == tuned.FORMAT_VERSION and document["dry_run"] is True
    assert (tmp_path / "shared" / "cpu.json").read_text() == Path(metrics["tuned_file"]).read_text()
    kernels = document["kernels"]
    assert NAME in kernels and len(kernels) >= 15  # every autotuned kernel of the six ops
    for name, entry in kernels.items():
        declared = [tuned.config_record(c) for c in _resolve(name).configs]
        assert all(record in declared for record in entry["configs"]), name
        for key, choice in entry["choices"].items():
            assert choice["config"] == 0 and "ms" not in choice and choice["shapes"], (name, key)
    for op in script.autotune_sweep.OPS:
        assert (tmp_path / f"{op}.csv").read_text().count("\n") > 1
    monkeypatch.setenv("TRITONREC_TUNED", metrics["tuned_file"])
    tuned._load.cache_clear()
    try:
        assert _run_and_report_config(monkeypatch) is KERNEL.configs[0]
    finally:
        tuned._load.cache_clear()


def _resolve(name: str):
    from tritonrec.kernels.aot_compile import resolve_kernel

    return resolve_kernel(name)


@pytest.mark.gpu
def test_gpu_sweep_times_every_config_and_keeps_the_fastest(tmp_path: Path) -> None:
    script = _script()
    overrides = ["op=jagged", "autotune_shapes=small", "warmup=1", "reps=3", f"tuned_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="autotune", overrides=[*overrides, f"out_dir={tmp_path}"])
    metrics = script.run(cfg)
    document = json.loads(Path(metrics["tuned_file"]).read_text())
    assert document["device"] == torch.cuda.get_device_name() and document["dry_run"] is False
    for entry in document["kernels"].values():
        for choice in entry["choices"].values():
            times = {int(i): ms for i, ms in choice["ms"].items()}
            assert all(ms > 0 for ms in times.values()) and choice["config"] == min(times, key=times.__getitem__)
    assert (tmp_path / "jagged.png").is_file()
