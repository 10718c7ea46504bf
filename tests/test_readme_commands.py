"""The README's commands stay true: the example it names runs, and .ci/run calls the README's test command."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_example_runs(tmp_path: Path) -> None:
    """Every ``python scripts/...`` line runs as written; hydra scripts write their run dir under ``tmp_path``."""
    commands = _fenced_commands((ROOT / "README.md").read_text())
    script_commands = [c.split()[1:] for c in commands if c.startswith("python scripts/")]
    assert script_commands, "README names no runnable script"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for script, *args in script_commands:
        run_dir = tmp_path / Path(script).stem
        if "@hydra.main" in (ROOT / script).read_text():
            args = [*args, f"hydra.run.dir={run_dir}"]
        result = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}"
        if script == "scripts/train.py":  # the main job: results on disk and the loss falling, as the README says
            metrics = json.loads((run_dir / "metrics.json").read_text())
            assert metrics["final_loss"] < metrics["first_loss"], metrics
            assert (run_dir / "checkpoints").is_dir()


def test_ci_runs_the_readme_test_command() -> None:
    commands = _fenced_commands((ROOT / "README.md").read_text())
    test_commands = [c for c in commands if "pytest" in c and "-m slow" not in c]
    assert len(test_commands) == 1
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines


def _train_commands(text: str) -> list[list[str]]:
    """The arguments of every ``scripts/train.py`` command the README shows: fenced, indented or inline."""
    commands = set(re.findall(r"`((?:python|torchrun)[^`\n]*scripts/train\.py[^`\n]*)`", text))
    commands |= {
        line.strip() for line in text.splitlines() if re.match(r"\s*(python|torchrun)\b.*scripts/train\.py", line)
    }
    arguments = []
    for command in sorted(commands):
        args = shlex.split(command.split("#")[0].replace("<date>", "2026-01-01_00-00-00"))
        arguments.append(args[args.index("scripts/train.py") + 1 :])
    return arguments


def test_readme_train_overrides_compose() -> None:
    """Every override the README passes to scripts/train.py composes into a valid TrainConfig (each job of a ``-m``
    sweep too); commands elided with ``...`` are skipped. Composing only: nothing trains."""
    from hydra import compose, initialize_config_dir

    from tritonrec.dist.train import as_train_config, register_configs

    register_configs()
    arguments = [args for args in _train_commands((ROOT / "README.md").read_text()) if "..." not in args]
    assert len(arguments) >= 5, arguments
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for args in arguments:
            sweep = "-m" in args
            keys, values = [], []
            for arg in (a for a in args if a != "-m"):
                key, value = arg.split("=", 1)
                keys.append(key)
                values.append(value.split(",") if sweep and "[" not in value else [value])
            for job in itertools.product(*values):
                overrides = [f"{key}={value}" for key, value in zip(keys, job, strict=True)]
                as_train_config(compose(config_name="train", overrides=overrides))
