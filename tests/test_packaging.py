"""The wheel's package list (pyproject.toml): every folder under the package roots that Python could import (an
identifier name, holding files) is a listed package, so setuptools ships it and does not warn that it is missing.
``kernels/tuned/``, the tuned launch configs' folder next to the module ``kernels/tuned.py``, was such a folder: every
build warned, and the JSON reached the wheel only through the parent's package data. It is now the package
``tritonrec.kernels.tuned`` itself, its JSON files its package data."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_importable_folder_is_a_listed_package() -> None:
    config = _setuptools_config()
    found = set()
    for package, folder in config["package-dir"].items():
        root = ROOT / folder
        for path in [root, *root.rglob("*")]:
            parts = path.relative_to(root).parts
            if not path.is_dir() or "__pycache__" in parts or not all(p.isidentifier() for p in parts):
                continue
            if any(child.is_file() for child in path.iterdir()):
                found.add(".".join([package, *parts]))
    assert found == set(config["packages"])


def test_tuned_configs_are_the_tuned_packages_data() -> None:
    from tritonrec.kernels import tuned

    assert Path(tuned.__file__).parent == tuned.TUNED_DIR
    shipped = sorted(p.name for p in tuned.TUNED_DIR.glob("*.json"))
    assert "nvidia-h200.json" in shipped
    assert _setuptools_config()["package-data"]["tritonrec.kernels.tuned"] == ["*.json"]
