"""Backend resolution, autotune pinning, and the library working without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tritonrec.kernels import backend as backend_mod
from tritonrec.kernels import lengths_to_offsets, resolve_backend
from tritonrec.kernels._triton import HAS_TRITON, interpreter_enabled


def test_auto_follows_interpreter_on_cpu() -> None:
    x = torch.zeros(3)
    expected = "triton" if HAS_TRITON and interpreter_enabled() else "torch"
    assert resolve_backend("auto", x) == expected


def test_torch_is_always_available() -> None:
    assert resolve_backend("torch", torch.zeros(1)) == "torch"


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="backend=.*'cuda'"):
        resolve_backend("cuda", torch.zeros(1))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        resolve_backend("triton", torch.zeros(1))
    assert resolve_backend("auto", torch.zeros(1)) == "torch"


def test_autotune_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITONREC_AUTOTUNE", "1")
    monkeypatch.setenv("TRITONREC_TUNED", "off")
    assert backend_mod.autotune_enabled()
    configs = ["first", "second"]
    choose = backend_mod.ConfigChooser("module:kernel", key=[], fits=None)
    assert choose(configs, {}) == configs
    backend_mod.set_autotune(False)
    try:
        assert choose(configs, {}) == ["first"]
    finally:
        backend_mod.set_autotune(None)
    monkeypatch.setenv("TRITONREC_AUTOTUNE", "0")
    assert not backend_mod.autotune_enabled()


def test_interpreter_pins_the_first_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITONREC_AUTOTUNE", "1")
    assert not backend_mod.autotune_enabled()


@pytest.mark.parametrize("n", [0, 1, 7, 64])
def test_pow2_bucket(n: int) -> None:
    bucket = backend_mod.pow2_bucket(n)
    assert bucket >= max(n, 1) and bucket & (bucket - 1) == 0 and bucket < 2 * max(n, 1)


def test_library_works_without_triton() -> None:
    """With Triton unimportable, ops run their twins and asking for 'triton' says why it cannot."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from tritonrec.kernels import lengths_to_offsets, resolve_backend
        from tritonrec.kernels._triton import HAS_TRITON
        from tritonrec.data import KeyedJaggedTensor
        assert not HAS_TRITON
        assert lengths_to_offsets(torch.tensor([2, 0, 3])).tolist() == [0, 2, 2, 5]
        kjt = KeyedJaggedTensor(["a", "b"], torch.arange(5), lengths=torch.tensor([2, 0, 1, 2]))
        assert kjt.permute([1, 0]).values().tolist() == [2, 3, 4, 0, 1]
        try:
            resolve_backend("triton", torch.zeros(1))
        except RuntimeError as error:
            assert "Triton cannot be imported" in str(error)
        else:
            raise AssertionError("expected a RuntimeError")
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_public_op_rejects_float_lengths() -> None:
    with pytest.raises(TypeError, match="lengths must be int32 or int64"):
        lengths_to_offsets(torch.tensor([1.0, 2.0]))


def test_a_lone_chosen_config_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6 (torch 2.11's) times even the one config our chooser kept, running the kernel again and again at
    each key's first launch (and failing without a GPU driver under the interpreter): the timer we hand it skips
    that case. With several configs it defers to Triton's own benchmarker."""
    from types import SimpleNamespace

    chooser = backend_mod.ConfigChooser("k", ["N"], None)
    bench = backend_mod._ChosenConfigBench(chooser)
    configs = [SimpleNamespace(all_kwargs=lambda b=b: {"BLOCK": b}) for b in (64, 128)]

    def must_not_run() -> None:
        raise AssertionError("the lone config was run to be timed")

    monkeypatch.setattr(backend_mod, "autotune_enabled", lambda: False)
    assert len(chooser(configs, {"N": 8})) == 1
    assert bench(must_not_run, (0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]

    calls: list[tuple] = []
    benchmarker = lambda fn, quantiles: calls.append((fn, quantiles)) or [1.0, 0.5, 1.5]
    monkeypatch.setattr(backend_mod, "_default_benchmarker", lambda: benchmarker)
    monkeypatch.setattr(backend_mod, "autotune_enabled", lambda: True)
    assert len(chooser(configs, {"N": 8})) == 2
    assert bench(must_not_run, (0.5, 0.2, 0.8)) == [1.0, 0.5, 1.5] and calls == [(must_not_run, (0.5, 0.2, 0.8))]
